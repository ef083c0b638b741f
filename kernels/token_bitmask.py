"""Structured outputs' logit mask: rows of a [B, V] logit matrix keep only the tokens their
grammar's bitmask allows (bit t % 32 of word t // 32), the rest become -inf.

`apply_token_bitmask_(x, rows, bitmask)` works in place and returns, per masked row, whether no
allowed token is left above -inf. On fp32 CPU tensors one compiled pass does it
(kernels/csrc/cpu_ops.c; 32 rows of a 49k vocabulary in about a millisecond where the twin's
unpack-and-select passes took tens under load); elsewhere the torch twin, `apply_token_bitmask_torch_`.
"""

from __future__ import annotations

import numpy as np
import torch

from zeroserve.kernels import cpu_native

__all__ = ["apply_token_bitmask_", "apply_token_bitmask_torch_", "unpack_bitmask"]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[K, W] int32 words -> [K, vocab_size] bool (token t allowed: bit t % 32 of word t // 32)."""
    if bitmask.device.type == "cpu":  # numpy's C unpack (shifts on int32 tensors: ~20 ms for 32 rows)
        words = bitmask.to(torch.int32).contiguous().numpy()
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_torch_(x: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The reference: x[rows] masked in place; -> [K] bool, True where nothing allowed is left."""
    allowed = unpack_bitmask(bitmask, x.shape[1]).to(x.device)
    sub = torch.where(allowed, x.index_select(0, rows), float("-inf"))
    x.index_copy_(0, rows, sub)
    return torch.isneginf(sub.amax(dim=-1)) if sub.shape[1] else torch.ones(sub.shape[0], dtype=torch.bool)


def apply_token_bitmask_(x: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    lib = cpu_native.ops_lib() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or bitmask.shape[1] * 32 < x.shape[1]:
        return apply_token_bitmask_torch_(x, rows, bitmask)
    rows = rows.to(torch.int64).contiguous()
    words = bitmask.to(torch.int32).contiguous()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= x.shape[0]):
        raise IndexError(f"bitmask rows outside the {x.shape[0]} rows of the logits")
    dead = torch.zeros(rows.shape[0], dtype=torch.uint8)
    rc = lib.zs_apply_token_bitmask_f32(x.data_ptr(), x.stride(0), rows.data_ptr(), words.data_ptr(), words.stride(0),
                                        rows.shape[0], x.shape[1], dead.data_ptr(), torch.get_num_threads())
    if rc != 0:
        return apply_token_bitmask_torch_(x, rows, bitmask)
    return dead.bool()
