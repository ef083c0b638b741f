"""Our model code (Llama / Mistral / Qwen2 / Qwen3) and its safetensors loader.

    model = load_model(cfg, device, dtype, ops, tp_rank=0, tp_size=1, tp_group=None)
    model = build_model(cfg, device, dtype, ops, ..., init="random", seed=0)   # no files
    hidden = model(input_ids[T], positions[T], kv_caches, meta)      # -> [T, hidden]
    logits = model.compute_logits(hidden[N, H])                      # -> [N, vocab] float32

`kv_caches[i] = (k_cache, v_cache)`, each `[num_blocks, block_size, model.num_kv_heads, model.head_dim]`
(num_kv_heads is per tensor-parallel shard). `ops = kernels.get_ops(backend, device)`.
"""

from __future__ import annotations

import torch

from common.errors import ModelLoadError
from common.model_config import ModelConfig
from services.worker.model.llama import CausalLM
from services.worker.model.loader import load_weights

__all__ = ["CausalLM", "build_model", "load_model"]

INITS = ("random", "empty", "none")


def build_model(cfg: ModelConfig, device, dtype: torch.dtype, ops, tp_rank: int = 0, tp_size: int = 1,
                tp_group=None, init: str = "random", seed: int = 0) -> CausalLM:
    """Build the model for this shard without reading any weight file.

    init="random": deterministic N(0, 0.02) linears/embeddings and unit norms (seeded per rank);
    init="empty"/"none": uninitialized memory (the loader fills it)."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    model = CausalLM(cfg, device, dtype, ops, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
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
               tp_group=None) -> CausalLM:
    """Build this shard's model and fill it from the safetensors files in `cfg.model_dir`."""
    if not cfg.model_dir:
        raise ModelLoadError("ModelConfig has no model_dir to load weights from (use build_model for random weights)")
    model = build_model(cfg, device, dtype, ops, tp_rank, tp_size, tp_group, init="empty")
    load_weights(model, cfg.model_dir)
    return model
