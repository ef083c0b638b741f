"""Hugging Face transformers as the reference for the engine tests, cached per test process.

    from tests.hf_reference import hf_greedy, hf_logprobs, explain_mismatch, model_dir

    ref = hf_greedy("qwen2", prompt_ids, 16)            # 16 greedy tokens, EOS not special
    ref = hf_greedy("qwen2", prompt_ids, 16, "min_new")  # HF min_new_tokens=16 (EOS banned)
    lp = hf_logprobs("llama", prompt_ids + out_ids)      # [len, vocab] log-softmax, fp32

The reference runs one prompt at a time (no padding), fp32 on CPU. Every generation and every
forward is cached by (arch, token ids, N, mode), so the engine tests can compare many engine
configurations (batching, preemption, chunked prefill, prefix cache) against one HF run.

Two EOS modes, because HF's `min_new_tokens` and zeroserve's `ignore_eos` are not the same
thing: `min_new_tokens=N` bans EOS from the logits (the model then emits its second choice),
while `ignore_eos=True` (vLLM semantics) lets the model emit EOS and keeps going.

- "ignore" (default): `generate(..., eos_token_id=[])`: EOS is an ordinary token; compare with
  `SamplingParams(temperature=0, ignore_eos=True, max_tokens=N)`.
- "min_new": `generate(..., min_new_tokens=N)`: EOS is banned for N tokens; compare with
  `SamplingParams(temperature=0, min_tokens=N, max_tokens=N)`.

`single_torch_thread` is a module-scoped autouse fixture that test modules import: the tiny
models are ~100x faster with one intra-op thread on a loaded 2-core machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tests.helpers import cached_model_dir

ARCHS = ("llama", "qwen2", "qwen3")

_MODELS: dict[str, object] = {}
_GEN: dict[tuple, list[int]] = {}
_LOGITS: dict[tuple, torch.Tensor] = {}


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def model_dir(arch: str) -> Path:
    """The shared tiny model directory of `arch` (read-only)."""
    return cached_model_dir(arch)


def hf_model(arch: str):
    if arch not in _MODELS:
        from transformers import AutoModelForCausalLM

        _MODELS[arch] = AutoModelForCausalLM.from_pretrained(str(model_dir(arch)), dtype=torch.float32).eval()
    return _MODELS[arch]


@torch.no_grad()
def hf_greedy(arch: str, prompt: Sequence[int], n: int, mode: str = "ignore") -> list[int]:
    """HF greedy continuation of `prompt`: exactly `n` new token ids (see the module docstring)."""
    key = (arch, tuple(prompt), n, mode)
    if key not in _GEN:
        model = hf_model(arch)
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        kw = {"do_sample": False, "max_new_tokens": n, "pad_token_id": 0,
                  "attention_mask": torch.ones_like(ids)}
        if mode == "ignore":
            kw["eos_token_id"] = []  # no stopping criterion on EOS, no logits processor either
        elif mode == "min_new":
            kw["min_new_tokens"] = n
        else:
            raise ValueError(mode)
        out = model.generate(ids, **kw)[0, ids.shape[1]:].tolist()
        assert len(out) == n, f"HF stopped early ({len(out)} of {n} tokens): {out}"
        _GEN[key] = out
    return list(_GEN[key])


@torch.no_grad()
def hf_logits(arch: str, token_ids: Sequence[int]) -> torch.Tensor:
    """[len, vocab] fp32 logits of one full causal forward (row i predicts token i+1)."""
    key = (arch, tuple(token_ids))
    if key not in _LOGITS:
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        _LOGITS[key] = hf_model(arch)(input_ids=ids).logits[0].float()
    return _LOGITS[key]


def hf_logprobs(arch: str, token_ids: Sequence[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(arch, token_ids), dim=-1)


def explain_mismatch(arch: str, prompt: Sequence[int], ours: Sequence[int], ref: Sequence[int]) -> str:
    """A diagnosis for a greedy mismatch: where it starts and how close HF's top-2 logits are
    there (a gap near fp32 noise, ~1e-4, means a near-tie; a large gap means a real bug)."""
    ours, ref = list(ours), list(ref)
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    if i >= min(len(ours), len(ref)):
        return f"lengths differ: ours {len(ours)} tokens, HF {len(ref)} tokens"
    row = hf_logits(arch, list(prompt) + ref[:i])[-1]
    top = torch.topk(row, 2)
    gap = float(top.values[0] - top.values[1])
    ours_gap = float(top.values[0] - row[ours[i]])
    return (f"[{arch}] prompt len {len(prompt)}: first mismatch at output index {i}: ours {ours[i]} vs HF {ref[i]}; "
            f"HF top-2 {top.indices.tolist()} gap {gap:.3e}; HF logit(top1) - logit(ours) = {ours_gap:.3e}\n"
            f"  ours {ours}\n  HF   {ref}")
