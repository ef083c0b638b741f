"""Triton kernels with the torch twins' signatures (docs/architecture.md): the GPU path.

Importing this module touches neither CUDA nor triton: the kernels live in
kernels/_triton_kernels.py and are imported on first use. On CPU they run under
TRITON_INTERPRET=1 (tests), which must be set before the first op call.

paged_attention dispatches on host ints only (no device sync):
  * meta.max_query_len == 1 (pure decode): flash-decoding. The KV of each request is cut into
    `num_splits` partitions processed by parallel programs (one per request x kv head x split,
    each covering all query heads of its GQA group), and a second small kernel merges the
    partials by log-sum-exp.
  * otherwise (prefill, chunked prefill, prefix-cache hits, mixed with decodes): one launch of
    the same kernel over (request, query tile, kv head); each query tile attends to the cached
    prefix plus itself causally. Decode rows in a mixed batch are tiles with one token.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from zeroserve.kernels.metadata import AttentionMetadata
from zeroserve.kernels.moe import align_block_size

__all__ = [
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_tanh_and_mul",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv",
]

_LOG2E = 1.4426950408889634
_NO_SPLIT_LEN = 1 << 30  # split length when not splitting (one value: one compiled variant)


@lru_cache(maxsize=1)
def _k():
    from zeroserve.kernels import _triton_kernels

    return _triton_kernels


def _np2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# --------------------------------------------------------------------------- norms / mlp
def _rms(x, residual, weight, eps):
    x = _last_contig(x)
    t, h = x.shape
    out = torch.empty((t, h), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is not None:
        residual = _last_contig(residual)
        res_out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    else:
        residual, res_out = x, out
    if t == 0:
        return out, res_out
    block = _np2(h)
    _k().rms_norm_kernel[(t,)](
        x, residual, weight.contiguous(), out, res_out,
        x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0),
        h, float(eps),
        BLOCK_H=block, HAS_RES=res_out is not out,
        num_warps=_warps_for(block),
    )
    return out, res_out


def _warps_for(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms(x, residual, weight, eps)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): the torch twin on the tensor's device (no Triton kernel yet)."""
    from zeroserve.kernels import torch_ops

    return torch_ops.gelu_tanh_and_mul(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x = _last_contig(x)
    t, two_i = x.shape
    i = two_i // 2
    out = torch.empty((t, i), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block = min(1024, _np2(i))
    _k().silu_and_mul_kernel[(t, triton_cdiv(i, block))](
        x, out, x.stride(0), out.stride(0), i, BLOCK=block, num_warps=_warps_for(block)
    )
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- rotary
def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX rotary on the first rot_dim dims; returns new tensors (inputs untouched)."""
    q, k = _last_contig(q), _last_contig(k)
    t, hq, d = q.shape
    hk = k.shape[1]
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return qo, ko
    cache = _last_contig(cos_sin_cache)
    half_pad = _np2(half)
    bh = max(1, min(_np2(max(hq, hk)), max(1, 4096 // half_pad)))
    _k().rotary_kernel[(t,)](
        positions.contiguous(), q, k, cache, qo, ko,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cache.stride(0),
        hq, hk,
        HALF=half, HALF_PAD=half_pad, ROT=rot, HEAD_DIM=d, TAIL_PAD=_np2(max(1, d - rot)),
        BLOCK_HEADS=bh, num_warps=4,
    )
    return qo, ko


# --------------------------------------------------------------------------- kv cache
def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    k, v = _last_contig(k), _last_contig(v)
    t, hk, d = k.shape
    if t == 0:
        return
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    bs = k_cache.shape[1]
    block = _np2(hk * d)
    _k().write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HK=hk, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_HD=block, num_warps=_warps_for(block),
    )


# --------------------------------------------------------------------------- attention
@lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: keep the split count (and the test run time) small


# Decode programs (request x kv head x split) wanted per SM: each program only streams K/V, so
# several resident programs per SM are needed to keep enough loads in flight. Untuned guess;
# benchmarks/gpu/bench_kernels.py prints a split sweep to tune it on real hardware.
DECODE_PROGRAMS_PER_SM = 8
MIN_SPLIT_TILES = 4  # a split covers at least this many BLOCK_N tiles


def _decode_splits(batch: int, hk: int, max_seq_len: int, block_n: int, device) -> tuple[int, int]:
    """(num_splits, split_len) for flash-decoding; split_len is a multiple of block_n."""
    progs = max(1, batch * hk)
    want = max(1, triton_cdiv(DECODE_PROGRAMS_PER_SM * _num_sms(device), progs))
    max_splits = max(1, triton_cdiv(max_seq_len, MIN_SPLIT_TILES * block_n))
    return _split_len(max_seq_len, min(want, max_splits), block_n)


def _split_len(max_seq_len: int, splits: int, block_n: int) -> tuple[int, int]:
    seq = max(max_seq_len, 1)
    split_len = triton_cdiv(triton_cdiv(seq, max(1, splits)), block_n) * block_n
    return triton_cdiv(seq, split_len), split_len


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    return paged_attention_impl(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window, softcap=softcap)


def paged_attention_impl(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """paged_attention with tuning knobs (tests force split counts / tiles through these).

    num_splits only applies to pure-decode batches (max_query_len == 1). `sliding_window` /
    `softcap`: as the torch twin's (a window skips the KV tiles before it)."""
    # runtime args (one compiled variant for every window); the cap is a constexpr switch
    extra = (int(sliding_window or 0), float(scale), float(softcap or 1.0))
    cap = softcap is not None
    q = _last_contig(q)
    t, hq, d = q.shape
    _, bs, hk, dk = k_cache.shape
    assert dk == d and hq % hk == 0, "GQA needs Hq % Hk == 0"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    nreq = meta.query_start_loc.shape[0] - 1
    # zeros: rows past query_start_loc[-1] (padding tokens) are never written by the kernels
    out = torch.zeros_like(q)
    if t == 0 or nreq <= 0:
        return out
    group = hq // hk
    g_pad = _np2(group)
    block_d = max(16, _np2(d))
    ieee = q.dtype == torch.float32
    upcast = q.dtype == torch.bfloat16 and q.device.type == "cpu"  # interpreter bf16 dot bug
    bt = meta.block_tables
    if bt.stride(-1) != 1:
        bt = bt.contiguous()
    qsl = meta.query_start_loc
    seq_lens = meta.seq_lens
    if qsl.dtype != torch.int32:
        qsl = qsl.to(torch.int32)
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.to(torch.int32)
    qk_scale = float(scale) * _LOG2E
    kern = _k()
    on_gpu = q.device.type == "cuda"

    if meta.max_query_len <= 1:
        # ---- flash-decoding (split-K over the KV sequence) + LSE merge
        bn = block_n or (64 if on_gpu else 32)
        bm = max(16, g_pad)
        if num_splits is None:
            splits, split_len = _decode_splits(nreq, hk, meta.max_seq_len, bn, q.device)
        else:
            splits, split_len = _split_len(meta.max_seq_len, num_splits, bn)
        if splits == 1:
            # one partition: write the output directly, no merge pass
            grid = (nreq, 1, hk)
            kern.paged_attn_kernel[grid](
                q, k_cache, v_cache, out, out, out, bt, seq_lens, qsl,
                q.stride(0), q.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                out.stride(0), out.stride(1), bt.stride(0),
                0, 0, 0, 0, 0,
                qk_scale, 1, _NO_SPLIT_LEN, *extra,
                GROUP=group, G_PAD=g_pad, BLOCK_Q=1, BLOCK_M=bm, BLOCK_N=bn,
                HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=bs, SPLIT=False,
                IEEE=ieee, UPCAST=upcast, SOFTCAP=cap, num_warps=4, num_stages=2,
            )
            return out
        part_o = torch.empty((nreq, hq, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((nreq, hq, splits), dtype=torch.float32, device=q.device)
        kern.paged_attn_kernel[(nreq, splits, hk)](
            q, k_cache, v_cache, out, part_o, part_lse, bt, seq_lens, qsl,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out.stride(0), out.stride(1), bt.stride(0),
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            qk_scale, splits, split_len, *extra,
            GROUP=group, G_PAD=g_pad, BLOCK_Q=1, BLOCK_M=bm, BLOCK_N=bn,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=bs, SPLIT=True,
            IEEE=ieee, UPCAST=upcast, SOFTCAP=cap, num_warps=4, num_stages=2,
        )
        kern.combine_kernel[(nreq, hq)](
            part_o, part_lse, out, qsl,
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
            splits,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=max(2, _np2(splits)), num_warps=4,
        )
        return out

    # ---- prefill / extend / mixed: one launch, query tiles x kv heads, no split
    bm = block_m or (64 if on_gpu else 32)
    bm = max(bm, g_pad, 16)
    block_q = max(1, bm // g_pad)
    bn = block_n or (64 if (on_gpu and d <= 64) else 32)
    n_qt = triton_cdiv(meta.max_query_len, block_q)
    kern.paged_attn_kernel[(nreq, n_qt, hk)](
        q, k_cache, v_cache, out, out, out, bt, seq_lens, qsl,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), bt.stride(0),
        0, 0, 0, 0, 0,
        qk_scale, 1, _NO_SPLIT_LEN, *extra,
        GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_M=bm, BLOCK_N=bn,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=bs, SPLIT=False, IEEE=ieee, UPCAST=upcast, SOFTCAP=cap,
        num_warps=4 if bm <= 64 else 8, num_stages=2,
    )
    return out


# ---- mixture of experts: vLLM's fused_moe scheme (routing and the tile layout: kernels/moe.py)

def _grouped_gemm(a, w, out, sorted_slots, tile_expert, weights, top_k, mul_weight, block_m):
    """out[slot] = (a[slot // top_k] @ w[e].T) (* weights[slot]) for every slot of every tile."""
    from zeroserve.kernels import _triton_moe as K

    n_out, kdim = w.shape[1], w.shape[2]
    block_n = 64 if n_out >= 64 else 32 if n_out >= 32 else 16
    block_k = 64 if kdim >= 64 else 32 if kdim >= 32 else 16
    grid = (tile_expert.numel(), -(-n_out // block_n))
    K.fused_moe_kernel[grid](
        a, w, out, sorted_slots, tile_expert, weights,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        n_out, kdim, top_k, out.shape[0],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, MUL_WEIGHT=mul_weight,
        IEEE=a.dtype == torch.float32, UPCAST=a.dtype == torch.bfloat16 and a.device.type == "cpu",
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor, expert_start: int = 0, block_m: int = 16) -> torch.Tensor:
    """kernels/moe.py's fused_moe on the GPU (or under TRITON_INTERPRET=1): two grouped-GEMM launches
    over the tiles moe.align_block_size lays out."""
    t, h = x.shape
    k = ids.shape[1]
    x = x.contiguous()
    sorted_slots, tile_expert = align_block_size(ids, w13.shape[0], block_m, expert_start)
    flat_w = weights.reshape(-1).float().contiguous()
    # slots routed to another shard's experts are never written: zeros, so they add nothing
    inter = torch.zeros((t * k, w13.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, inter, sorted_slots, tile_expert, flat_w, k, False, block_m)
    act = silu_and_mul(inter)
    down = torch.zeros((t * k, h), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, sorted_slots, tile_expert, flat_w, 1, True, block_m)
    return down.view(t, k, h).sum(dim=1)
