"""Exactness of the real cluster in each numeric mode (services/worker/numerics.py): a request's
tokens and logprob bits are a function of (model, mode, prompt, params, seed) only.

Per mode (float32, the default; bfloat16, `--matmul-dtype bfloat16`), one module cluster
(scheduler, detokenizer, groups g0 and g1) and an in-process engine in the same mode as the
reference, each request computed there alone:

1. the cluster reports the mode, per group and fixed per model;
2. each request alone, then all 16 at once, equal the reference (tokens and logprobs);
3. SIGKILL of a worker mid-stream: its requests finish on the other group, still equal;
4. a worker of the other mode is refused with the reason, and `status` shows it;
5. a stream equals its result: seeded requests with stop strings, streamed and sent again
   (streamed and not) under concurrent load, join to exactly the same token ids and text;
6. a restarted cluster (fresh scheduler and worker) gives the reference again.

Greedy and seeded requests alike; the prompts are random token ids (no tie filtering: exact
arithmetic makes near ties harmless).
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import LocalCluster, no_leftover_processes  # noqa: E402,F401 (fixture)
from tests.helpers import cached_model_dir, torch_single_thread  # noqa: E402,F401 (fixture)
from tests.test_cluster import _pick_stop  # noqa: E402
from zeroserve.kernels import cpu_native  # noqa: E402

pytestmark = [pytest.mark.usefixtures("torch_single_thread", "no_leftover_processes"),
              pytest.mark.skipif(cpu_native.quant_lib() is None, reason="compiled kernels unavailable")]

MODES = {"float32": [], "bfloat16": ["--matmul-dtype", "bfloat16"]}
VOCAB = 512
N = 16


def _params(i: int, **kw):
    """Request i's params: odd ones seeded sampling, even ones greedy."""
    from zeroserve import SamplingParams

    kw = {"max_tokens": 12 + i % 7, "ignore_eos": True, "logprobs": 0, **kw}
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, **kw)
    return SamplingParams(temperature=0.0, **kw)


def _bits(c) -> tuple[list[int], list[float]]:
    """A completion's token ids and its sampled tokens' logprobs (floats compare bit for bit)."""
    return list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


@pytest.fixture(scope="module", params=list(MODES))
def mode(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_model_dir("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(32)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 70))] for _ in range(N)]


@pytest.fixture(scope="module")
def reference(model_dir, mode, prompts) -> list[tuple[list[int], list[float]]]:
    """Each request alone on an in-process engine in the same mode."""
    from zeroserve import LLM

    llm = LLM(str(model_dir), matmul_dtype=mode, num_kv_blocks=256)
    assert llm.engine.runner.numeric_mode.startswith(mode + "/")
    return [_bits(llm.generate(p, _params(i))[0].outputs[0]) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def cluster(model_dir, mode):
    with LocalCluster(model_dir, workers=2, num_kv_blocks=256, worker_args=MODES[mode]).running(groups=2) as c:
        yield c


async def _stream(c, prompt, params, on_tokens=None) -> dict:
    """One streamed request: its joined token ids, text, logprobs and each delta's finish reason."""
    out = {"tokens": [], "text": "", "logprobs": [], "reasons": []}
    async for d in c.stream(prompt, params):
        out["tokens"] += d.token_ids
        out["text"] += d.text
        out["logprobs"] += [lp[t].logprob for lp, t in zip(d.logprobs or [], d.token_ids)]
        out["reasons"].append(d.finish_reason)
        if on_tokens is not None:
            on_tokens(len(d.token_ids))
    return out


def _run_streams(cluster, jobs, action=None, after_tokens: int = 0) -> list[dict]:
    """Stream every (prompt, params) at once; call `action` once after `after_tokens` tokens."""
    from zeroserve import AsyncClient

    seen = [0, False]

    def count(n: int) -> None:
        seen[0] += n
        if action is not None and not seen[1] and seen[0] >= after_tokens:
            seen[1] = True
            action()

    async def main():
        async with AsyncClient(cluster.address, timeout_s=120.0) as c:
            return await asyncio.gather(*(_stream(c, p, sp, count) for p, sp in jobs))

    return asyncio.run(main())


def _check(got: list[dict], reference, cluster) -> None:
    bad = [i for i, (g, ref) in enumerate(zip(got, reference)) if (g["tokens"], g["logprobs"]) != ref]
    assert not bad, f"requests {bad} differ from their reference\n{cluster.logs()}"


# ---------------------------------------------------------------------------------- tests

def test_the_cluster_reports_one_numeric_mode_per_model(cluster, mode, model_dir):
    st = cluster.stats()
    [(model, fixed)] = st["numeric_modes"].items()
    assert fixed.startswith(mode + "/cpu-") and fixed.split("/")[1].endswith(
        ("-vdpbf16ps", "-emulated") if mode == "bfloat16" else ("avx512", "avx2", "portable"))
    assert {g["numeric_mode"] for g in st["groups"]} == {fixed}


@pytest.mark.timeout(300)
def test_alone_and_in_a_batch_of_16_equal_the_reference(cluster, reference, prompts):
    with cluster.client(timeout_s=30.0, request_timeout_s=120.0) as c:
        alone = [_bits(c.generate(p, _params(i)).outputs[0]) for i, p in enumerate(prompts[:4])]
    assert alone == reference[:4]
    _check(_run_streams(cluster, [(p, _params(i)) for i, p in enumerate(prompts)]), reference, cluster)


@pytest.mark.timeout(300)
def test_worker_failover_mid_stream_equals_the_reference(cluster, reference, prompts):
    got = _run_streams(cluster, [(p, _params(i)) for i, p in enumerate(prompts)],
                       action=lambda: cluster.kill("g0-r0", signal.SIGKILL), after_tokens=40)
    _check(got, reference, cluster)
    cluster.wait_exit("g0-r0", timeout=30)
    cluster.start_worker("g0")  # back to two groups for the tests after this one
    cluster.wait_ready(groups=2, timeout=180)


@pytest.mark.timeout(300)
def test_a_worker_of_another_mode_is_refused_and_status_says_why(cluster, mode):
    other = next(m for m in MODES if m != mode)
    cluster.start_worker("x", extra=MODES[other] or ["--matmul-dtype", "float32"])
    assert cluster.wait_exit("x-r0", timeout=180) != 0, cluster.logs()
    st = cluster.stats()
    [why] = [r["reason"] for r in st["refused"] if r["worker_id"] == "x-r0"]
    [fixed] = st["numeric_modes"].values()
    assert "numeric mode" in why and other in why and fixed in why
    assert sorted(g["name"] for g in st["groups"]) == ["g0", "g1"]


@pytest.mark.timeout(400)
def test_streams_with_stop_strings_equal_their_results_under_load(cluster, prompts):
    """Seeded and greedy requests with a stop string taken from the middle of their own text:
    the streamed deltas (ids and text) join to exactly the non-streamed result, and a second
    stream of the same request equals both, all 48 requests of a round in flight at once."""
    from zeroserve import AsyncClient

    with cluster.client(timeout_s=30.0, request_timeout_s=120.0) as c:
        full = [c.generate(p, _params(i, max_tokens=24)).outputs[0].text for i, p in enumerate(prompts)]
    stops = [_pick_stop(t) for t in full]
    jobs = [(p, _params(i, max_tokens=24, stop=[s[0]])) for i, (p, s) in enumerate(zip(prompts, stops)) if s]
    assert len(jobs) >= N // 2, full

    async def main():
        async with AsyncClient(cluster.address, timeout_s=120.0) as c:
            return await asyncio.gather(*(_stream(c, p, sp) for p, sp in jobs),
                                        *(c.generate(p, sp) for p, sp in jobs),
                                        *(_stream(c, p, sp) for p, sp in jobs))

    res = asyncio.run(main())
    n = len(jobs)
    first, results, second = res[:n], res[n:2 * n], res[2 * n:]
    stopped = 0
    for i, (a, r, b) in enumerate(zip(first, results, second)):
        o = r.outputs[0]
        assert a["tokens"] == list(o.token_ids) == b["tokens"], (i, a["tokens"], o.token_ids, b["tokens"])
        assert a["text"] == o.text == b["text"], (i, a["text"], o.text, b["text"])
        assert a["reasons"][-1] == o.finish_reason == b["reasons"][-1]
        stopped += o.finish_reason == "stop"
    assert stopped >= n // 2, "most requests should end at their stop string"


@pytest.mark.timeout(400)
def test_a_restarted_cluster_gives_the_same_bits(model_dir, mode, reference, prompts):
    with LocalCluster(model_dir, workers=1, num_kv_blocks=256, worker_args=MODES[mode]).running(groups=1) as c:
        _check(_run_streams(c, [(p, _params(i)) for i, p in enumerate(prompts)]), reference, c)
