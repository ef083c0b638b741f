"""The @triton.jit kernels behind kernels/triton_ops.py.

Imported lazily by triton_ops (so `import zeroserve.kernels.triton_ops` works without triton or a GPU).
Under TRITON_INTERPRET=1 (set before this module is imported) they run on CPU tensors.

Conventions: the last dim of every tensor is contiguous (stride 1); other strides are passed
in. Row / block indices are widened to int64 before being multiplied by strides.
"""

from __future__ import annotations

import triton
import triton.language as tl


# --------------------------------------------------------------------------- RMSNorm
@triton.jit
def rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    s_x, s_r, s_o, s_ro,
    H, eps,
    BLOCK_H: tl.constexpr, HAS_RES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    cm = cols < H
    x = tl.load(x_ptr + row * s_x + cols, mask=cm, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * s_r + cols, mask=cm, other=0.0)
        # the sum is rounded to the activation dtype, like `x + residual` in torch
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * s_ro + cols, x, mask=cm)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    normed = (xf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)  # HF: .to(input_dtype) before weight
    w = tl.load(w_ptr + cols, mask=cm, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * s_o + cols, y.to(out_ptr.dtype.element_ty), mask=cm)


# --------------------------------------------------------------------------- SiLU-and-mul
@triton.jit
def silu_and_mul_kernel(
    x_ptr, out_ptr, s_x, s_o, I,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = cols < I
    g = tl.load(x_ptr + row * s_x + cols, mask=cm, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * s_x + I + cols, mask=cm, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # torch rounds silu(gate) first
    tl.store(out_ptr + row * s_o + cols, (act * u).to(dt), mask=cm)


# --------------------------------------------------------------------------- RoPE (NeoX)
@triton.jit
def _rope_heads(
    x_ptr, o_ptr, t, cos, sin, s_xt, s_xh, s_ot, s_oh, NH,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROT: tl.constexpr, HEAD_DIM: tl.constexpr,
    TAIL_PAD: tl.constexpr, BLOCK_HEADS: tl.constexpr,
):
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    for h0 in range(0, NH, BLOCK_HEADS):
        h = h0 + tl.arange(0, BLOCK_HEADS)
        hm = h < NH
        m = hm[:, None] & jm[None, :]
        xb = x_ptr + t * s_xt + h[:, None] * s_xh
        ob = o_ptr + t * s_ot + h[:, None] * s_oh
        x1 = tl.load(xb + j[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xb + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        dt = o_ptr.dtype.element_ty
        tl.store(ob + j[None, :], o1.to(dt), mask=m)
        tl.store(ob + HALF + j[None, :], o2.to(dt), mask=m)
        if ROT < HEAD_DIM:  # partial rotary: copy the untouched tail
            c = tl.arange(0, TAIL_PAD)
            cmask = hm[:, None] & (c[None, :] < HEAD_DIM - ROT)
            tail = tl.load(xb + ROT + c[None, :], mask=cmask, other=0.0)
            tl.store(ob + ROT + c[None, :], tail.to(dt), mask=cmask)


@triton.jit
def rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, qo_ptr, ko_ptr,
    s_qt, s_qh, s_kt, s_kh, s_qot, s_qoh, s_kot, s_koh, s_c,
    HQ, HK,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROT: tl.constexpr, HEAD_DIM: tl.constexpr,
    TAIL_PAD: tl.constexpr, BLOCK_HEADS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    cos = tl.load(cache_ptr + pos * s_c + j, mask=jm, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * s_c + HALF + j, mask=jm, other=0.0).to(tl.float32)
    _rope_heads(q_ptr, qo_ptr, t, cos, sin, s_qt, s_qh, s_qot, s_qoh, HQ,
                HALF, HALF_PAD, ROT, HEAD_DIM, TAIL_PAD, BLOCK_HEADS)
    _rope_heads(k_ptr, ko_ptr, t, cos, sin, s_kt, s_kh, s_kot, s_koh, HK,
                HALF, HALF_PAD, ROT, HEAD_DIM, TAIL_PAD, BLOCK_HEADS)


# --------------------------------------------------------------------------- KV write
@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    s_kt, s_kh, s_vt, s_vh,
    s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
    HK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK_HD)
    # the slot broadcast to a vector (the interpreter rejects scalar & vector masks)
    slot = tl.load(slot_ptr + t).to(tl.int64) + tl.zeros([BLOCK_HD], tl.int64)
    ok = slot >= 0
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    hh = idx // HEAD_DIM
    dd = idx % HEAD_DIM
    m = (idx < HK * HEAD_DIM) & ok
    kv = tl.load(k_ptr + t * s_kt + hh * s_kh + dd, mask=m, other=0.0)
    tl.store(kc_ptr + blk * s_kcb + off * s_kcs + hh * s_kch + dd,
             kv.to(kc_ptr.dtype.element_ty), mask=m)
    vv = tl.load(v_ptr + t * s_vt + hh * s_vh + dd, mask=m, other=0.0)
    tl.store(vc_ptr + blk * s_vcb + off * s_vcs + hh * s_vch + dd,
             vv.to(vc_ptr.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------- paged attention
@triton.jit
def paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    bt_ptr, seq_lens_ptr, qsl_ptr,
    s_qt, s_qh,
    s_kb, s_ks, s_kh,
    s_vb, s_vs, s_vh,
    s_ot, s_oh,
    s_bt,
    s_pb, s_ph, s_ps,  # part_o [B, Hq, S, D]
    s_lb, s_lh,  # part_lse [B, Hq, S] (last stride 1)
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    num_splits, split_len,
    window,  # sliding window (> 0): a query at p sees keys p - window < j <= p; 0 = all
    scale, softcap,  # SOFTCAP: scores = softcap * tanh(q.k * scale / softcap), then * log2(e)
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr = False,
):
    """One program = (request b, query tile x KV split, kv head).

    The tile's rows are BLOCK_Q query tokens x the G_PAD query heads sharing kv head `kh`
    (row r -> token r // G_PAD, head kh * GROUP + r % G_PAD), so K/V are loaded once per GQA
    group. KV is walked in BLOCK_N-token tiles gathered through the block table, independent
    of BLOCK_SIZE. With SPLIT, the program covers KV [split*split_len, (split+1)*split_len)
    (split_len a multiple of BLOCK_N)
    and writes a normalized partial output + its base-2 log-sum-exp for combine_kernel.
    """
    b = tl.program_id(0)
    pid1 = tl.program_id(1)
    kh = tl.program_id(2)
    qt = pid1 // num_splits
    sp = pid1 % num_splits

    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # tokens before this step's queries
    m_start = qt * BLOCK_Q

    rows = tl.arange(0, BLOCK_M)
    tok = rows // G_PAD
    g = rows % G_PAD
    row_ok = (tok < BLOCK_Q) & (m_start + tok < q_len) & (g < GROUP)
    head = kh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_row = (q_start + m_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter's bf16 tl.dot is wrong: do the dots in fp32 there
        q = q.to(tl.float32)
    qpos = ctx + m_start + tok  # absolute position of each row's token

    # KV range this program needs: causal limit of its last real token, then the split.
    last_tok = tl.minimum(m_start + BLOCK_Q, q_len) - 1
    hi = tl.minimum(seq_len, ctx + last_tok + 1)
    lo = sp * split_len
    hi = tl.minimum(hi, lo + split_len)
    if window > 0:  # keys before the window of the tile's first token are never read
        lo = tl.maximum(lo, ctx + m_start - window + 1)
    win_lo = tl.where(window > 0, qpos - window, -1)  # per row: keys j > win_lo are visible
    hi = tl.where(m_start < q_len, hi, lo)  # dead query tile: no work

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_head_k = kh.to(tl.int64) * s_kh
    kv_head_v = kh.to(tl.int64) * s_vh
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = (n % BLOCK_SIZE).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + blk[:, None] * s_kb + off[:, None] * s_ks + kv_head_k + d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if SOFTCAP:  # tanh(x) = sign(x) (1 - e^-2|x|) / (1 + e^-2|x|): no overflow
            x = s * scale / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -t, t) * (softcap * 1.4426950408889634)
        else:
            s = s * qk_scale
        vis = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= qpos[:, None]) & (n[None, :] > win_lo[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + blk[:, None] * s_vb + off[:, None] * s_vs + kv_head_v + d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    st_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        pb = part_o_ptr + b.to(tl.int64) * s_pb + head.to(tl.int64) * s_ph + sp * s_ps
        tl.store(pb[:, None] + d[None, :], o, mask=st_mask)
        tl.store(part_lse_ptr + b.to(tl.int64) * s_lb + head * s_lh + sp, lse, mask=row_ok)
    else:
        tl.store(out_ptr + q_row[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=st_mask)


@triton.jit
def combine_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, qsl_ptr,
    s_pb, s_ph, s_ps, s_lb, s_lh, s_ot, s_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge the split-K partials of one (decode request, query head) by log-sum-exp."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b.to(tl.int64) * s_lb + h * s_lh + s, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    tot = tl.sum(w, axis=0)
    tot = tl.where(tot == 0.0, 1.0, tot)
    pb = part_o_ptr + b.to(tl.int64) * s_pb + h.to(tl.int64) * s_ph
    o = tl.load(pb + s[:, None] * s_ps + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tot
    tl.store(out_ptr + q_start.to(tl.int64) * s_ot + h * s_oh + d,
             res.to(out_ptr.dtype.element_ty), mask=d_ok & ((d * 0 + q_len) > 0))
