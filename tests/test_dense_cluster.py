"""A dense family beyond Llama/Qwen (Gemma 2: sliding window 8, soft-caps, sandwich norms,
GeGLU) served by a real cluster (scheduler, detokenizer, worker processes) with a small token
budget, so long prompts are prefilled in chunks across the window's edge: greedy tokens equal
Hugging Face transformers' (fp32), one at a time and concurrently."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import LocalCluster
from tests.helpers import cached_model_dir, random_prompt
from tests.hf_reference import hf_greedy, single_torch_thread  # noqa: F401 (fixture)

ARCH = "gemma2"
MAX_TOKENS = 12
PROMPT_LENS = (3, 9, 21, 45)  # under / over the window (8); 45 spans 3 KV blocks and 3 chunks


def _params():
    from zeroserve import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    # 20 tokens per step: the 45-token prompt is prefilled as 20 + 20 + 5 (chunk edges off the window's)
    with LocalCluster(cached_model_dir(ARCH), workers=1, num_kv_blocks=64,
                      scheduler_args=["--max-num-batched-tokens", "20"]).running(groups=1) as c:
        yield c


@pytest.mark.parametrize("concurrent", [False, True], ids=["sequential", "concurrent"])
def test_gemma2_cluster_greedy_matches_hf(cluster, concurrent):
    prompts = [random_prompt(n, 512, seed=200 + i) for i, n in enumerate(PROMPT_LENS)]
    ref = [hf_greedy(ARCH, p, MAX_TOKENS) for p in prompts]
    with cluster.client(timeout_s=60.0) as c:
        if concurrent:
            with ThreadPoolExecutor(len(prompts)) as ex:
                outs = list(ex.map(lambda p: c.generate(p, _params()), prompts))
        else:
            outs = [c.generate(p, _params()) for p in prompts]
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == ref[i], f"prompt {i} (len {PROMPT_LENS[i]}): cluster != HF"
