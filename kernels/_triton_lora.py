"""The @triton.jit kernels behind kernels/lora.py's add_lora_triton (imported lazily).

BGMV: one program per (row, tile); the row's adapter slot picks which A / B it reads, so a batch
mixing adapters is one launch per phase, whatever the mix. Rows of slot -1 return at once. The
weights are transposed as kernels/lora.py keeps them (at[s]: [K, P*R], bt[s]: [R, N]). The shrink
writes tmp[t, P*R] in fp32; the expand adds (tmp[t, part] @ bt[s]) * scale[s] to y, an output o
of part p = (o >= b1) + (o >= b2) reading tmp's columns [p*R, p*R + R).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, tmp_ptr, slots_ptr, s_x, PR, K,
                       BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    pid_j = tl.program_id(1)
    s = tl.load(slots_ptr + t).to(tl.int64)
    if s < 0:
        return
    offs_j = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    j_ok = offs_j < PR
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_J,), dtype=tl.float32)
    a_base = a_ptr + s * K * PR + offs_j.to(tl.int64)[:, None]
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        xv = tl.load(x_ptr + t.to(tl.int64) * s_x + kk, mask=k_ok, other=0.0).to(tl.float32)
        av = tl.load(a_base + kk.to(tl.int64)[None, :] * PR, mask=j_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(tmp_ptr + t.to(tl.int64) * PR + offs_j, acc, mask=j_ok)


@triton.jit
def lora_expand_kernel(tmp_ptr, b_ptr, scale_ptr, y_ptr, slots_ptr, s_y, PR, N, R, b1, b2,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.load(slots_ptr + t).to(tl.int64)
    if s < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    part = (offs_n >= b1).to(tl.int32) + (offs_n >= b2).to(tl.int32)
    h = tl.load(tmp_ptr + t.to(tl.int64) * PR + part[:, None] * R + offs_r[None, :],
                mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    bv = tl.load(b_ptr + s * R * N + offs_r.to(tl.int64)[None, :] * N + offs_n[:, None],
                 mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    d = tl.sum(bv * h, axis=1) * tl.load(scale_ptr + s)
    y_ptrs = y_ptr + t.to(tl.int64) * s_y + offs_n
    yv = tl.load(y_ptrs, mask=n_ok, other=0.0)
    tl.store(y_ptrs, (yv.to(tl.float32) + d).to(yv.dtype), mask=n_ok)
