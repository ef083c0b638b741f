"""Compute dtype of a worker: the user's choice, or one chosen for the checkpoint and the device.

A rule, never a measurement: the same arguments on the same machine give the same dtype on
every start (a start-up timing once picked bf16 on a busy host and fp32 on a quiet one, and the
same request gave other tokens after a restart).

- accelerator, "auto": the checkpoint's own dtype.
- CPU, "auto": float32 parameters and activations, whatever the checkpoint; whether the linears
  then multiply in fp32 or in the bf16 regime is services/worker/numerics.py's rule (bf16 on a
  CPU with native bf16 for a checkpoint that is not fp32; `--dtype float32` is exact against
  HF's fp32 everywhere).
- CPU, "bfloat16": activations, norms and attention still compute in float32; what bf16 means
  on a CPU is the bf16 matmul regime of the compiled kernels (x and w rounded to bf16, products
  summed in fp32, the same at every row count), applied by services/worker/numerics.py, with
  the linears' weights held in bf16 (half the bytes). torch's own bf16 ops are not used there:
  oneDNN's GEMM blocking (and so a row's rounding) depends on the batch.
"""

from __future__ import annotations

import torch

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.model_config import ModelConfig

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
    """The dtype the model's parameters and activations have (see the module's docstring): a
    CPU computes in float32 unless float16 is asked for; a bf16 request there is the matmul
    regime (`wants_bf16`), not a torch dtype."""
    name = dtype_name(dtype)
    cpu = torch.device(device).type == "cpu"
    if name == "auto":
        if cpu:
            return torch.float32
        cfg_dtype = config.torch_dtype if isinstance(config, ModelConfig) else config
        return _DTYPE_NAMES.get(dtype_name(cfg_dtype or "float32"), torch.float32)
    t = _DTYPE_NAMES[name]
    return torch.float32 if cpu and t is torch.bfloat16 else t


def dtype_name(dtype: str | torch.dtype) -> str:
    """A user's dtype as "auto" or a key of _DTYPE_NAMES, checked."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ModelLoadError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return str(dtype).removeprefix("torch.")
    if not isinstance(dtype, str):
        raise ModelLoadError(f"dtype must be a string, got {dtype!r}")
    name = dtype.strip().lower().replace("torch.", "")
    if name != "auto" and name not in _DTYPE_NAMES:
        raise ModelLoadError(
            f"unsupported dtype {dtype!r}; use 'auto', 'float32' (float, fp32), 'bfloat16' (bf16) "
            "or 'float16' (half, fp16)"
        )
    return name


def requested(dtype: str | torch.dtype) -> torch.dtype | None:
    """The torch dtype a user's dtype names (None: auto)."""
    name = dtype_name(dtype)
    return None if name == "auto" else _DTYPE_NAMES[name]


def wants_bf16(dtype: str | torch.dtype) -> bool:
    """Whether a user's dtype asks for bf16 (on a CPU: the bf16 matmul regime)."""
    return requested(dtype) is torch.bfloat16


KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_kv_dtype(name: str | None, compute_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype`: "auto" (or None) = the compute dtype; float32 or bfloat16 (half an fp32
    cache's bytes: keys and values rounded to bf16 when written, widened to fp32 when read)."""
    key = (name or "auto").strip().lower().replace("torch.", "")
    key = {"fp32": "float32", "float": "float32", "bf16": "bfloat16"}.get(key, key)
    if key == "auto":
        return compute_dtype
    if key not in KV_CACHE_DTYPES:
        raise ModelLoadError(f"unsupported kv_cache_dtype {name!r}; use 'auto', 'float32' or 'bfloat16'")
    return KV_CACHE_DTYPES[key]
