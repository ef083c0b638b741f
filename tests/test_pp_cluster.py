"""Pipeline parallelism through the real cluster (gloo on CPU): worker groups of two stages,
each stage its own `zeroserve worker --pp-size 2 --pp-rank S` process.

One module-scoped cluster (scheduler, detokenizer, groups g0 and g1 of two stages each, llama):

1. the stages joined as one group each: `status` (and the stats behind the console) list the
   stages, their hosts and their layers' weights (each stage about half of the model);
2. greedy tokens equal Hugging Face fp32's, one at a time and concurrently; embeddings (pooled
   on the last stage) equal HF's pooled hidden states, beside a generation;
3. a stage SIGKILLed while 64 greedy requests stream, once its group has two steps in flight
   (the first stage of g0: the answering last stage survives, blocked on a peer that is gone)
   takes its group out, and every request of both steps finishes on g1 with the reference
   tokens and text, no stream repeating or skipping a token (tests/test_failover.py's harness
   and workload);
4. a stage of a new group g2 stopped (SIGSTOP) mid-run: the same, once its heartbeats are missed.

Then, each in a cluster of its own: an MoE family (mixtral) at pp=2, and tp=2 x pp=2 (four
shards in one group), both equal to HF's greedy tokens; three stages with three steps in flight,
equal to pp=1's tokens.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import LocalCluster  # noqa: E402
from tests.helpers import cached_model_dir, random_prompt, torch_single_thread  # noqa: F401,E402
from tests.hf_reference import hf_greedy  # noqa: E402
from tests.test_failover import N_REQUESTS, Run, _wait, workload  # noqa: F401,E402 (workload: a fixture)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

MAX_TOKENS = 12
PROMPT_LENS = (3, 17, 40, 70)


def _prompts() -> list[list[int]]:
    return [random_prompt(n, 512, seed=200 + i) for i, n in enumerate(PROMPT_LENS)]


def _params():
    from zeroserve import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _generate_all(cluster: LocalCluster, concurrent: bool) -> list[list[int]]:
    with cluster.client(timeout_s=90.0) as c:
        if concurrent:
            with ThreadPoolExecutor(len(PROMPT_LENS)) as ex:
                outs = list(ex.map(lambda p: c.generate(p, _params()), _prompts()))
        else:
            outs = [c.generate(p, _params()) for p in _prompts()]
    return [list(o.outputs[0].token_ids) for o in outs]


def _group(cluster: LocalCluster, name: str) -> dict | None:
    return next((g for g in cluster.stats()["groups"] if g["name"] == name), None)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(model_dir):
    with LocalCluster(model_dir, workers=2, pp=2, num_kv_blocks=256).running(groups=2, timeout=240) as c:
        yield c


def test_stages_joined_and_shown(cluster):
    g = _group(cluster, "g0")
    assert g["state"] == "ready" and g["tp_size"] == 1 and g["pp_size"] == 2, g
    ws = g["workers"]
    assert [(w["worker_id"], w["rank"], w["stage"]) for w in ws] == [("g0-s0-r0", 0, 0), ("g0-s1-r0", 1, 1)]
    assert all(w["host"] for w in ws)
    # each stage holds one of the two layers (+ the embedding, or the norm and the LM head)
    full = sum(p.stat().st_size for p in Path(cluster.model).glob("*.safetensors"))
    assert all(0.3 * full <= w["param_bytes"] <= 0.7 * full for w in ws), ([w["param_bytes"] for w in ws], full)
    text = subprocess.run([sys.executable, "-m", "zeroserve.services.cli", "status", "--address", cluster.address],
                          capture_output=True, text=True, timeout=60, cwd=ROOT).stdout
    assert re.search(r"group g0 \[ready\] .* tp 1 pp 2", text), text
    for w in ws:
        assert re.search(rf"worker {w['worker_id']} rank {w['rank']} stage {w['stage']} .*host {re.escape(w['host'])}",
                         text), text
    # the last stage answers: its log says which layers it holds
    log = (cluster.logdir / "g0-s1-r0.log").read_text(errors="replace")
    assert re.search(r"model loaded.*layers[=\":\s]+'?1-1", log), log[-2000:]


@pytest.mark.parametrize("concurrent", [False, True], ids=["sequential", "concurrent"])
def test_pp2_greedy_matches_hf(cluster, concurrent):
    got = _generate_all(cluster, concurrent)
    for i, (toks, p) in enumerate(zip(got, _prompts())):
        assert toks == hf_greedy("llama", p, MAX_TOKENS), f"prompt {i} (len {PROMPT_LENS[i]}): pp=2 != HF"
    if concurrent:  # two requests per group: two micro-batches, two steps in flight (stage 0 ahead)
        peaks = [_group(cluster, g)["peak_steps_in_flight"] for g in ("g0", "g1")]
        assert max(peaks) == 2, peaks


def test_pp2_seeded_matches_pp1(cluster, model_dir):
    """Seeded sampling, eight requests at once (two micro-batches per group, two steps in
    flight): the tokens equal the in-process pp=1 engine's for the same seeds."""
    from zeroserve import LLM, SamplingParams

    prompts = _prompts() * 2
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=31 + k, ignore_eos=True)
              for k in range(len(prompts))]
    with cluster.client(timeout_s=90.0) as c, ThreadPoolExecutor(len(prompts)) as ex:
        got = [list(o.outputs[0].token_ids) for o in ex.map(c.generate, prompts, params)]
    want = [list(o.outputs[0].token_ids) for o in LLM(str(model_dir), num_kv_blocks=256).generate(prompts, params)]
    assert got == want


def test_pp2_embeddings_match_hf(cluster):
    """Embedding requests pool on the last stage (it has the final-normed states) beside a
    generation in the same steps; the earlier stage expects no token for them."""
    import asyncio

    import numpy as np

    from tests.helpers import load_hf_model
    from tests.test_embeddings import PROMPTS, TOL, reference
    from zeroserve import AsyncClient

    hf = load_hf_model(cached_model_dir("llama"))

    async def together():
        async with AsyncClient(cluster.address, timeout_s=60.0) as ac:
            return await asyncio.gather(ac.embed(PROMPTS, pooling="mean"), ac.embed(PROMPTS, pooling="last"),
                                        ac.generate(_prompts()[1], _params()))

    mean, last, gen = asyncio.run(together())
    for pooling, outs in (("mean", mean), ("last", last)):
        for p, o in zip(PROMPTS, outs):
            np.testing.assert_allclose(o.embedding, reference(hf, p, pooling), atol=TOL)
    assert list(gen.outputs[0].token_ids) == hf_greedy("llama", _prompts()[1], MAX_TOKENS)


def _kill_with_two_in_flight(cluster: LocalCluster, group: str, worker: str, seen: list) -> None:
    """SIGKILL `worker` once its group has two steps in flight (a pipeline of two stages keeps
    two in flight while it has work: services/scheduler/groups.py); `seen`: what stats said."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        g = _group(cluster, group) or {}
        seen.append(g.get("steps_in_flight"))
        if seen[-1] == 2:
            break
    cluster.kill(worker, signal.SIGKILL)


def test_stage_sigkill_midrun(cluster, workload):
    seen: list = []
    run = Run(cluster, workload, threshold=N_REQUESTS * 3,
              action=lambda: _kill_with_two_in_flight(cluster, "g0", "g0-s0-r0", seen), timeout_s=120.0).run()
    assert run.fired_at is not None and run.fired_at < run.total, "the kill should land mid-run"
    assert seen and seen[-1] == 2, f"g0 never had two steps in flight before the kill: {seen}"
    run.check()
    _wait(lambda: _group(cluster, "g0") is None, 30, "g0 to leave", cluster)
    g1 = _group(cluster, "g1")
    assert g1["state"] == "ready" and g1["tokens"] > 0
    # the surviving stage of g0 does not hang on: it leaves once its group is given up
    assert cluster.wait_exit("g0-s1-r0", timeout=60) != 0


def test_stage_hangs_midrun(cluster, workload):
    """A stage that stops (SIGSTOP: no heartbeats, no steps) takes a new group g2 out after the
    heartbeat timeout; every request finishes with the reference tokens."""
    for s in range(2):
        cluster.start_worker("g2", stage=s)
    _wait(lambda: (_group(cluster, "g2") or {}).get("state") == "ready", 120, "g2 to be ready", cluster)
    requeued = cluster.stats()["metrics"].get("requeued", 0)
    try:
        run = Run(cluster, workload, threshold=N_REQUESTS * 3,
                  action=lambda: cluster.kill("g2-s1-r0", signal.SIGSTOP), timeout_s=120.0).run()
        assert run.fired_at is not None and run.fired_at < run.total, "the stop should land mid-run"
        run.check()
        _wait(lambda: _group(cluster, "g2") is None, 30, "g2 to leave", cluster)
        assert cluster.stats()["metrics"]["requeued"] > requeued, "g2 held no request when it stopped"
    finally:
        cluster.kill("g2-s1-r0", signal.SIGCONT)
    # woken, the stopped stage finds its group given up and leaves (code 3: its collectives are gone)
    assert cluster.wait_exit("g2-s1-r0", timeout=60) != 0


@pytest.mark.parametrize("arch,tp", [("mixtral", 1), ("llama", 2)], ids=["mixtral_pp2", "llama_tp2_pp2"])
def test_more_shapes_match_hf(arch, tp):
    with LocalCluster(cached_model_dir(arch), workers=1, tp=tp, pp=2, num_kv_blocks=128).running(
            groups=1, timeout=240) as c:
        g = _group(c, "g0")
        assert len(g["workers"]) == 2 * tp and sorted(w["stage"] for w in g["workers"]) == [0] * tp + [1] * tp
        got = _generate_all(c, concurrent=True)
    for i, (toks, p) in enumerate(zip(got, _prompts())):
        assert toks == hf_greedy(arch, p, MAX_TOKENS), f"{arch} tp={tp} pp=2, prompt {i}: != HF"


def test_pp3_three_steps_in_flight_match_pp1():
    """Three stages (a middle one that both receives hidden states and is owed tokens), three
    steps in flight over eight concurrent requests: greedy tokens equal the in-process pp=1
    engine's on the same three-layer model."""
    from zeroserve import LLM

    d = cached_model_dir("llama", num_hidden_layers=3)
    prompts = _prompts() * 2
    with LocalCluster(d, workers=1, pp=3, num_kv_blocks=128).running(groups=1, timeout=240) as c:
        with c.client(timeout_s=90.0) as cl, ThreadPoolExecutor(len(prompts)) as ex:
            got = [list(o.outputs[0].token_ids) for o in ex.map(lambda p: cl.generate(p, _params()), prompts)]
        g = _group(c, "g0")
        assert sorted(w["stage"] for w in g["workers"]) == [0, 1, 2] and g["peak_steps_in_flight"] == 3, g
    want = [list(o.outputs[0].token_ids) for o in LLM(str(d), num_kv_blocks=128).generate(prompts, _params())]
    assert got == want


@pytest.mark.timeout(600)
def test_up_pp2_serves_with_two_stages(tmp_path):
    """`zeroserve up --pp 2`: one group of two stage processes that serves HF's greedy tokens."""
    from tests.cluster import free_port_block
    from tests.test_cli_up import Up

    port = free_port_block(4)
    u = Up("pp", ["--model", str(cached_model_dir("llama")), "--port", str(port), "--pp", "2", "--no-gateway",
                  "--num-kv-blocks", "64", "--threads", "1"], tmp=tmp_path)
    try:
        u.wait_line(r"^ready: 1 worker group\(s\) x 2 shard\(s\)")
        for s in range(2):
            u.child_pids.add(int(u.wait_line(rf"^worker g0 stage {s}\s+pid (\d+)").group(1)))
        from zeroserve import Client

        with Client(u.address, timeout_s=60.0) as c:
            got = [list(c.generate(p, _params()).outputs[0].token_ids) for p in _prompts()[:2]]
            g = c.stats()["groups"][0]
        assert [(w["worker_id"], w["stage"]) for w in g["workers"]] == [("g0-s0-r0", 0), ("g0-s1-r0", 1)], g
        for toks, p in zip(got, _prompts()):
            assert toks == hf_greedy("llama", p, MAX_TOKENS)
    finally:
        u.stop()
