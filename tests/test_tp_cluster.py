"""Tensor parallelism through the real cluster: one worker group of two shards (gloo on CPU).

One module-scoped cluster (scheduler, detokenizer, group "g0" = shards g0-r0 + g0-r1, tp=2):

1. the tp=2 group gives the same greedy tokens (and text) as Hugging Face transformers (fp32)
   and as the in-process tp=1 engine (`zeroserve.LLM`), for prompts of several lengths, one at
   a time and concurrently;
2. the weights really are split: each shard loads about half of the tp=1 parameter bytes (read
   from the shard's "model loaded" log line: the scheduler's stats do not expose the
   `memory.param_bytes` each shard sends in its Hello, see `test_param_bytes_visible_in_stats`);
3. a tp=1 group started in the same cluster gives the same tokens once the tp=2 group has been
   drained (SIGTERM on rank 0: both shards leave with exit code 0 and the group disappears).
"""

from __future__ import annotations

import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import LocalCluster
from tests.helpers import cached_model_dir, random_prompt
from tests.hf_reference import hf_greedy, single_torch_thread  # noqa: F401 (fixture)

ARCH = "llama"
MAX_TOKENS = 12
PROMPT_LENS = (3, 17, 40, 70)  # under, over, and several KV blocks (block_size 16)


def _prompts() -> list[list[int]]:
    return [random_prompt(n, 512, seed=100 + i) for i, n in enumerate(PROMPT_LENS)]


def _params():
    from zeroserve import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_model_dir(ARCH)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with LocalCluster(model_dir, workers=1, tp=2, num_kv_blocks=128).running(groups=1) as c:
        yield c


@pytest.fixture(scope="module")
def reference(model_dir) -> dict:
    """HF greedy tokens and the in-process tp=1 engine's tokens + text, per prompt."""
    from zeroserve import LLM

    prompts = _prompts()
    hf = [hf_greedy(ARCH, p, MAX_TOKENS) for p in prompts]
    llm = LLM(str(model_dir), num_kv_blocks=64)
    outs = llm.generate(prompts, _params())
    ours = [list(o.outputs[0].token_ids) for o in outs]
    texts = [o.outputs[0].text for o in outs]
    return {"prompts": prompts, "hf": hf, "tp1": ours, "tp1_text": texts}


def _group(stats: dict, name: str) -> dict | None:
    return next((g for g in stats["groups"] if g["name"] == name), None)


def _log_param_bytes(cluster: LocalCluster, worker: str) -> int:
    text = (cluster.logdir / f"{worker}.log").read_text(errors="replace")
    m = re.findall(r"model loaded.*?param_bytes[=\":\s]+(\d+)", text)
    assert m, f"no 'model loaded ... param_bytes' line in {worker}'s log:\n{text[-2000:]}"
    return int(m[-1])


def _generate_all(cluster: LocalCluster, prompts, concurrent: bool):
    with cluster.client(timeout_s=60.0) as c:
        if not concurrent:
            return [c.generate(p, _params()) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as ex:
            return list(ex.map(lambda p: c.generate(p, _params()), prompts))


def test_hf_reference_is_tp1_engine(reference):
    """Sanity of the references themselves: the in-process tp=1 engine matches HF."""
    assert reference["tp1"] == reference["hf"]


def test_both_shards_joined(cluster):
    s = cluster.stats()
    g = _group(s, "g0")
    assert g is not None and g["state"] == "ready", s
    assert g["tp_size"] == 2
    assert [w["rank"] for w in g["workers"]] == [0, 1]
    assert [w["worker_id"] for w in g["workers"]] == ["g0-r0", "g0-r1"]
    assert all(w["kv_blocks"] == 128 for w in g["workers"])


@pytest.mark.parametrize("concurrent", [False, True], ids=["sequential", "concurrent"])
def test_tp2_greedy_matches_hf_and_tp1(cluster, reference, concurrent):
    before = _group(cluster.stats(), "g0")
    outs = _generate_all(cluster, reference["prompts"], concurrent)
    for i, o in enumerate(outs):
        c = o.outputs[0]
        assert c.token_ids == reference["hf"][i], f"prompt {i} (len {PROMPT_LENS[i]}): tp=2 != HF"
        assert c.token_ids == reference["tp1"][i], f"prompt {i}: tp=2 != tp=1 engine"
        assert c.text == reference["tp1_text"][i]
        assert c.finish_reason == "length"
    after = _group(cluster.stats(), "g0")
    assert after["steps"] > before["steps"]
    # both shards ran the steps (rank 1 applies them too, it just does not answer); the w_* figures
    # come with the shards' heartbeats (every second), so give them a moment
    deadline = time.monotonic() + 10
    while True:
        w0, w1 = _group(cluster.stats(), "g0")["workers"]
        # a shard that has not sent a heartbeat since joining has no w_* figures yet
        if w0.get("w_steps", 0) >= after["steps"] and w1.get("w_steps", 0) >= after["steps"]:
            break
        assert time.monotonic() < deadline, (w0, w1, after["steps"])
        time.sleep(0.3)
    assert w0["w_steps"] == w1["w_steps"] or abs(w0["w_steps"] - w1["w_steps"]) <= 2


def test_weights_are_split(cluster, model_dir):
    """Each shard holds about half of the parameter bytes of the unsharded model."""
    from tests.helpers import load_our_model

    _, full = load_our_model(model_dir)
    total = sum(p.numel() * p.element_size() for p in full.parameters())
    del full
    shards = [_log_param_bytes(cluster, w) for w in ("g0-r0", "g0-r1")]
    # norms (and nothing else) are replicated; they are tiny next to the sharded matrices
    for b in shards:
        assert 0.45 * total <= b <= 0.56 * total, (shards, total)
    assert 0.98 * total <= sum(shards) <= 1.1 * total, (shards, total)


def test_param_bytes_visible_in_stats(cluster):
    """Each shard reports what it holds: about half the model's parameter bytes at tp=2."""
    g = _group(cluster.stats(), "g0")
    from safetensors import safe_open

    per_shard = [w["param_bytes"] for w in g["workers"]]
    full = 0
    for f in Path(cluster.model).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            full += sum(st.get_tensor(k).numel() * st.get_tensor(k).element_size() for k in st.keys())
    assert len(per_shard) == 2 and all(0.45 * full <= b <= 0.55 * full for b in per_shard), (per_shard, full)


def test_tp1_group_after_tp2_drain(cluster, reference):
    """Drain the tp=2 group (SIGTERM rank 0), serve the same prompts with a tp=1 group."""
    cluster.start_worker("t1", 0, tp=1)
    cluster.wait_ready(groups=2, timeout=180)
    cluster.kill("g0-r0", signal.SIGTERM)
    assert cluster.wait_exit("g0-r0", timeout=60) == 0, cluster.logs()
    assert cluster.wait_exit("g0-r1", timeout=60) == 0, cluster.logs()
    deadline = time.monotonic() + 30
    while _group(cluster.stats(), "g0") is not None:
        assert time.monotonic() < deadline, cluster.stats()
        time.sleep(0.2)
    outs = _generate_all(cluster, reference["prompts"], concurrent=True)
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == reference["tp1"][i], f"prompt {i}: tp=1 cluster != tp=1 engine"
        assert o.outputs[0].text == reference["tp1_text"][i]
    t1 = _group(cluster.stats(), "t1")
    assert t1 is not None and t1["tp_size"] == 1 and t1["steps"] > 0
    # the tp=1 shard holds the whole model: about twice what each tp=2 shard holds
    full, half = _log_param_bytes(cluster, "t1-r0"), _log_param_bytes(cluster, "g0-r0")
    assert 1.8 * half <= full <= 2.2 * half, (full, half)
