"""Kernels: Triton kernels for GPUs and their torch twins, behind one dispatch point.

`get_ops(backend, device)` returns a module exposing the op set documented in
docs/architecture.md. Nothing here touches CUDA at import time, so the package imports on
machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from common.config import ATTENTION_BACKENDS as BACKENDS


@dataclass
class AttentionMetadata:
    """Where every token of a flat batch lives in the paged KV cache."""

    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset; < 0 = padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache after this step
    query_start_loc: torch.Tensor  # [B + 1] int32, row offsets of each request's queries
    max_query_len: int
    max_seq_len: int


def resolve_backend(backend: str, device: torch.device | str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" else "cpu"
    if backend == "cpu" and torch.device(device).type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on CPU tensors only, not on {device}; use auto or triton")
    return backend


def get_ops(backend: str = "auto", device: torch.device | str = "cpu") -> ModuleType:
    """Return the op namespace for `backend` ("auto" = triton on CUDA, cpu elsewhere)."""
    name = resolve_backend(backend, device)
    if name == "triton":
        from kernels import triton_ops

        return triton_ops
    if name == "cpu":
        from kernels import cpu_native, cpu_ops

        cpu_native.available()  # build (or load the cached build) now, not inside the first step

        return cpu_ops
    from kernels import torch_ops

    return torch_ops
