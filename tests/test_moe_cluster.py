"""MoE through the real cluster (scheduler, detokenizer, worker processes): greedy tokens equal
Hugging Face's for Qwen3-MoE (sparse + dense layers) on a tp=1 worker and on a tp=2 group with
expert parallelism (`--enable-expert-parallel`: each shard holds 4 of the 8 experts), Mixtral on
tp=1 and OLMoE on a tp=2 group (every expert sliced, q/k norms all-reduced)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import LocalCluster, no_leftover_processes  # noqa: E402,F401 (fixture)
from tests.helpers import cached_model_dir, random_prompt  # noqa: E402
from tests.hf_reference import explain_mismatch, hf_greedy, single_torch_thread  # noqa: E402,F401 (fixture)

MAX_TOKENS = 10
PROMPTS = [random_prompt(n, 512, seed=500 + i) for i, n in enumerate((4, 18, 45))]

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _generate(cluster: LocalCluster) -> list[list[int]]:
    from zeroserve import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with cluster.client(timeout_s=60.0) as c, ThreadPoolExecutor(len(PROMPTS)) as ex:
        outs = list(ex.map(lambda p: c.generate(p, params), PROMPTS))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch,tp,extra", [("qwen3moe", 1, []), ("qwen3moe", 2, ["--enable-expert-parallel"]),
                                           ("mixtral", 1, []), ("olmoe", 2, [])],
                         ids=["qwen3moe-tp1", "qwen3moe-ep2", "mixtral-tp1", "olmoe-tp2"])
def test_moe_cluster_greedy_matches_hf(arch, tp, extra):
    d = cached_model_dir(arch)
    with LocalCluster(d, workers=1, tp=tp, num_kv_blocks=64, worker_args=extra).running(groups=1) as c:
        got = _generate(c)
    for p, toks in zip(PROMPTS, got):
        ref = hf_greedy(arch, p, MAX_TOKENS)
        assert toks == ref, explain_mismatch(arch, p, toks, ref)
