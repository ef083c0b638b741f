"""The compiled decode step (services/worker/model/cpu_step.py, kernels/csrc/decode_step.c).

It must be the Python forward bit for bit: the same hidden states and the same KV cache
contents after every decode step, for each family switch (Qwen2's q/k/v bias, Qwen3's q/k norm,
Llama's tied embeddings) and packed format, in fp32 and in the bf16 regime, with ragged batches
over non-contiguous block tables; and it must stand aside wherever it does not apply.
"""

from __future__ import annotations

import copy

import pytest
import torch

from zeroserve.common.model_config import ModelConfig
from zeroserve.kernels.dispatch import get_ops
from zeroserve.kernels import cpu_native
from zeroserve.services.worker.model import load_model
from zeroserve.services.worker import numerics
from zeroserve.services.worker.model.cpu_step import CpuDecodeStep
from tests.helpers import PagedKV, cached_model_dir, random_prompt

pytestmark = pytest.mark.skipif(
    cpu_native.step_lib() is None or cpu_native.quant_lib() is None,
    reason=f"compiled kernels unavailable: {cpu_native.unavailable_reason() or cpu_native.quant_unavailable_reason()}")

CPU = get_ops("cpu", "cpu")


def _model(arch: str, quantization: str, backend=CPU):
    d = cached_model_dir(arch, "tiny", seed=3)
    cfg = ModelConfig.from_dir(d)
    return cfg, load_model(cfg, "cpu", torch.float32, backend, quantization=quantization)


def _python_forward(model, *args):
    step, model._step = model._cpu_step(), None
    try:
        return model(*args)
    finally:
        model._step = step


@pytest.mark.parametrize("arch,quantization,bf16", [("llama", "int4", False), ("qwen2", "int8", False),
                                                    ("qwen3", "int4", False), ("mistral", "int8", False),
                                                    ("llama", "int4", True), ("qwen2", "int8", True)])
def test_decode_steps_equal_the_python_forward(arch, quantization, bf16):
    """bf16: the model in the bf16 numeric mode (every linear in the bf16 regime, here on the
    packed bytes as in the Python path's QuantizableWeight.matmul)."""
    cfg, model = _model(arch, quantization)
    numerics.apply(model, bf16)
    assert isinstance(model._cpu_step(), CpuDecodeStep)
    kv = PagedKV(model, num_blocks=48, block_size=4, order="random", seed=1)
    lens = [1, 3, 4, 9, 17]  # ragged, at and across the 4-token block edges
    prompts = {i: random_prompt(n, cfg.vocab_size, seed=10 + i) for i, n in enumerate(lens)}
    with torch.inference_mode():
        ids, pos, meta, _ = kv.step(list(prompts.items()))
        model(ids, pos, kv.caches, meta)  # prefill: the Python path (q_len > 1)
        twin = copy.deepcopy(kv)
        nxt = {i: [int(p[-1])] for i, p in prompts.items()}
        for step in range(6):
            items = [(i, nxt[i]) for i in prompts]
            ids, pos, meta, _ = kv.step(items)
            assert model._cpu_step().applies(meta, torch.empty(len(items), cfg.hidden_size), kv.caches)
            got = model(ids, pos, kv.caches, meta)
            ids2, pos2, meta2, _ = twin.step(items)
            want = _python_forward(model, ids2, pos2, twin.caches, meta2)
            assert torch.equal(got, want), (arch, step, (got - want).abs().max())
            for (k, v), (k2, v2) in zip(kv.caches, twin.caches):
                assert torch.equal(k, k2) and torch.equal(v, v2)
            logits = model.compute_logits(got)
            nxt = {i: [int(logits[b].argmax())] for b, i in enumerate(prompts)}


def test_stands_aside_where_it_does_not_apply(monkeypatch):
    _, floats = _model("llama", "none")
    assert CpuDecodeStep.build(floats) is None  # float linears: the Python path
    _, twin_ops = _model("llama", "int4", backend=get_ops("torch", "cpu"))
    assert CpuDecodeStep.build(twin_ops) is None  # the torch reference op set stays pure torch
    monkeypatch.setenv("ZEROSERVE_CPU_STEP", "0")
    cfg, model = _model("llama", "int4")
    assert CpuDecodeStep.build(model) is None
    monkeypatch.delenv("ZEROSERVE_CPU_STEP")
    step = CpuDecodeStep.build(model)
    kv = PagedKV(model, num_blocks=16, block_size=4)
    _, _, meta, _ = kv.step([(0, [5, 6, 7]), (1, [8])])  # a prefill in the batch
    assert not step.applies(meta, torch.empty(4, cfg.hidden_size), kv.caches)


def test_bad_position_raises_and_writes_nothing():
    cfg, model = _model("llama", "int4")
    kv = PagedKV(model, num_blocks=16, block_size=4)
    with torch.inference_mode():
        ids, pos, meta, _ = kv.step([(0, [5])])
        before = [(k.clone(), v.clone()) for k, v in kv.caches]
        pos = torch.tensor([cfg.max_position_embeddings + 5])
        with pytest.raises(ValueError, match="position past the rotary table"):
            model(ids, pos, kv.caches, meta)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv.caches, before))
