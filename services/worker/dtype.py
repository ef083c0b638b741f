"""Compute dtype of a worker: the user's choice, or the checkpoint's on accelerators."""

from __future__ import annotations

import torch

from common.errors import ModelLoadError
from common.model_config import ModelConfig

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(
    dtype: str | torch.dtype,
    device: torch.device | str,
    config: ModelConfig | str | None = None,
) -> torch.dtype:
    """Turn a user dtype name into a torch dtype.

    "auto" = the checkpoint's `torch_dtype` (from `config`, a ModelConfig or the dtype string) on
    accelerators, float32 when unknown, and always float32 on CPU (half precision matmuls on CPU
    are slow and less accurate)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ModelLoadError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if not isinstance(dtype, str):
        raise ModelLoadError(f"dtype must be a string, got {dtype!r}")
    name = dtype.strip().lower().replace("torch.", "")
    if name == "auto":
        if torch.device(device).type == "cpu":
            return torch.float32
        cfg_dtype = config.torch_dtype if isinstance(config, ModelConfig) else config
        cfg_dtype = (cfg_dtype or "float32").lower().replace("torch.", "")
        return _DTYPE_NAMES.get(cfg_dtype, torch.float32)
    if name not in _DTYPE_NAMES:
        raise ModelLoadError(
            f"unsupported dtype {dtype!r}; use 'auto', 'float32' (float, fp32), 'bfloat16' (bf16) "
            "or 'float16' (half, fp16)"
        )
    return _DTYPE_NAMES[name]
