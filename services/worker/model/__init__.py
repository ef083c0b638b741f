"""Our model code (Llama / Mistral / Qwen2 / Qwen3) and its safetensors and GGUF loaders.

    model = load_model(cfg, device, dtype, ops, tp_rank=0, tp_size=1, tp_group=None, quantization=None)
    model = build_model(cfg, device, dtype, ops, ..., init="random", seed=0)   # no files
    hidden = model(input_ids[T], positions[T], kv_caches, meta)      # -> [T, hidden]
    logits = model.compute_logits(hidden[N, H])                      # -> [N, vocab] float32

`kv_caches[i] = (k_cache, v_cache)`, each `[num_blocks, block_size, model.num_kv_heads, model.head_dim]`
(num_kv_heads is per tensor-parallel shard). `ops = zeroserve.kernels.dispatch.get_ops(backend, device)`.

`quantization` (services/worker/model/quantize.py): None/"auto" keeps a GGUF's Q8_0/Q4_0/Q4_1/Q4_K
weights packed (safetensors: floats), "none" dequantizes everything at load, "int8"/"int4"
quantize every linear at load. `model.weight_bytes()` is what the weights occupy (packed sizes).
"""

from __future__ import annotations

import torch

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.model_config import ModelConfig, resolve_model_path
from zeroserve.services.worker.model.llama import CausalLM
from zeroserve.services.worker.model.loader import load_weights
from zeroserve.services.worker.model.quantize import QUANTIZATIONS, resolve_quantization

__all__ = ["QUANTIZATIONS", "CausalLM", "build_model", "load_model"]

INITS = ("random", "empty", "none")


def build_model(cfg: ModelConfig, device, dtype: torch.dtype, ops, tp_rank: int = 0, tp_size: int = 1,
                tp_group=None, init: str = "random", seed: int = 0, expert_parallel: bool = False,
                pp_rank: int = 0, pp_size: int = 1) -> CausalLM:
    """Build the model for this shard without reading any weight file.

    init="random": deterministic N(0, 0.02) linears/embeddings and unit norms (seeded per rank);
    init="empty"/"none": uninitialized memory (the loader fills it)."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    model = CausalLM(cfg, device, dtype, ops, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                     expert_parallel=expert_parallel, pp_rank=pp_rank, pp_size=pp_size)
    model.eval()
    if init == "random":
        _random_init(model, seed * 1009 + tp_rank)
    return model


@torch.no_grad()
def _random_init(model: CausalLM, seed: int) -> None:
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            # sample in fp32 then cast (normal_ on half dtypes is fine on GPU but not everywhere)
            if p.dtype == torch.float32:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                for chunk in p.view(-1).split(1 << 24):
                    chunk.copy_(torch.empty(chunk.shape, device=dev).normal_(0.0, 0.02, generator=gen))


def load_model(cfg: ModelConfig, device, dtype: torch.dtype, ops, tp_rank: int = 0, tp_size: int = 1,
               tp_group=None, quantization: str | None = None, expert_parallel: bool = False,
               pp_rank: int = 0, pp_size: int = 1) -> CausalLM:
    """Build this shard's model and fill it from `cfg.model_dir`: safetensors files, or a .gguf file
    (a pipeline stage reads only its layers' tensors, services/worker/pipeline.py).

    quantization: None/"auto" (GGUF: packed where a kernel exists), "none", "int8" or "int4"."""
    if not cfg.model_dir:
        raise ModelLoadError("ModelConfig has no model_dir to load weights from (use build_model for random weights)")
    quantization = resolve_quantization(quantization)
    kind, path = resolve_model_path(cfg.model_dir)
    model = build_model(cfg, device, dtype, ops, tp_rank, tp_size, tp_group, init="empty",
                        expert_parallel=expert_parallel, pp_rank=pp_rank, pp_size=pp_size)
    if kind == "gguf":  # imported here: only GGUF models need the gguf package
        from zeroserve.services.worker.model.gguf_loader import load_gguf_weights

        load_gguf_weights(model, path, quantization)
    else:
        load_weights(model, cfg.model_dir, quantization)
    return model
