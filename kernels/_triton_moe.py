"""The @triton.jit grouped GEMM behind kernels/triton_ops.py's fused_moe (imported lazily).

One program computes a BLOCK_M x BLOCK_N tile of `out` for one tile of expert-sorted slots:
all BLOCK_M rows of a tile belong to the same expert (zeroserve.kernels.moe.align_block_size), so the
tile is a plain GEMM against that expert's weight [N, K], as in vLLM's fused_moe. Rows holding
the padding sentinel (slot >= num_slots) are masked; tiles with expert -1 return at once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fused_moe_kernel(
    a_ptr, w_ptr, out_ptr, slots_ptr, tile_expert_ptr, weights_ptr,
    s_a, s_we, s_wn, s_o,
    N, K, top_k, num_slots,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(slots_ptr + offs_m).to(tl.int64)
    row_ok = slots < num_slots
    a_rows = slots // top_k  # the token of each slot (top_k = 1: the slot itself)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows[:, None] * s_a
    w_base = w_ptr + expert * s_we + offs_n.to(tl.int64)[None, :] * s_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        a = tl.load(a_base + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong (as in _triton_kernels.py)
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:  # fp32 models: full-precision dots, not TF32
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if MUL_WEIGHT:
        rw = tl.load(weights_ptr + slots, mask=row_ok, other=0.0)
        acc = acc * rw[:, None]
    out = out_ptr + slots[:, None] * s_o + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
