"""The CPU op set: the torch twins, with decode attention read in place by a compiled kernel.

Decode dominates a serving step on CPU, and the twin's gather of every request's blocks into a
padded buffer costs more than the attention itself; ``kernels/csrc/paged_decode.c`` reads the
blocks where they are. Prefill/extend rows, the other ops, other dtypes and machines where the
kernel cannot be built run the torch twins unchanged.
"""

from __future__ import annotations

import torch

from kernels import AttentionMetadata, cpu_native, torch_ops
from kernels.torch_ops import fused_add_rms_norm, rms_norm, rotary_embedding, silu_and_mul, write_kv

__all__ = list(torch_ops.__all__)  # the same op set; only paged_attention differs


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``torch_ops.paged_attention``."""
    if not cpu_native.supports(q, k_cache):
        return torch_ops.paged_attention(q, k_cache, v_cache, meta, scale)

    def decode(q_rows, block_tables, seq_lens):
        return cpu_native.paged_decode(q_rows, k_cache, v_cache, block_tables, seq_lens, scale)

    return torch_ops.paged_attention(q, k_cache, v_cache, meta, scale, decode=decode)
