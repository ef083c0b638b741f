"""The one dispatch point for the kernels: Triton kernels on GPUs, the C kernels (with their torch
fallbacks) on CPUs, and the pure-torch reference twins every kernel is tested against.

`get_ops(backend, device)` returns a module exposing the op set documented in
docs/architecture.md. Nothing here touches CUDA at import time, so the package imports on
machines without a GPU.
"""

from __future__ import annotations

from types import ModuleType

import torch

from zeroserve.common.config import ATTENTION_BACKENDS as BACKENDS


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
        from zeroserve.kernels import triton_ops

        return triton_ops
    if name == "cpu":
        from zeroserve.kernels import cpu_native, cpu_ops

        cpu_native.available()  # build (or load the cached build) now, not inside the first step

        return cpu_ops
    from zeroserve.kernels import torch_ops

    return torch_ops
