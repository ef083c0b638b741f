"""End to end: the engine on the Triton kernels (interpreted on CPU) gives the same greedy tokens
as on the torch twins and as HF transformers."""

import os

import pytest
import torch

from tests.helpers import cached_model_dir
from zeroserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs a GPU or TRITON_INTERPRET=1")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_matches_torch_and_hf(arch):
    from transformers import AutoModelForCausalLM

    d = cached_model_dir(arch)
    prompts = [[5, 9, 17, 33, 65, 129, 200, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [42], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    # block 16 with a 40-token prompt crosses block boundaries; 24 tokens per step chunks the prefill
    common = dict(num_kv_blocks=32, max_num_batched_tokens=24, device=device)
    tri = [o.outputs[0].token_ids for o in LLM(str(d), attention_backend="triton", **common).generate(prompts, params)]
    ref = [o.outputs[0].token_ids for o in LLM(str(d), attention_backend="torch", **common).generate(prompts, params)]
    assert tri == ref
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    for p, got in zip(prompts, tri):
        out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6, min_new_tokens=6)
        assert got == out[0, len(p):].tolist()
