"""Every Triton kernel vs its torch twin.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it); with
ZEROSERVE_TEST_GPU=1 the same tests run compiled on CUDA.

Tolerances (max abs error vs the twin, which itself is checked against a naive fp64 reference
in test_torch_ops.py):
  fp32: attention 2e-5 abs / 1e-4 rel; elementwise ops 1e-5
  fp16: attention 2e-3 (P is rounded to fp16 before the P@V dot on GPU); elementwise 1 ulp-ish
  bf16: attention 2e-2; elementwise 2 bf16 ulps at the value's magnitude (rtol 1.6e-2)
Interpreter note: its bf16 tl.dot is wrong, so on CPU bf16 attention does the dots in fp32
(UPCAST); compiled GPU runs use real bf16 MMAs (benchmarks/gpu/bench_kernels.py checks them).
"""

from __future__ import annotations

import os

import pytest
import torch

from zeroserve.kernels.metadata import AttentionMetadata
from zeroserve.kernels import torch_ops as ref_ops
from zeroserve.kernels import triton_ops as tri
from tests.kernels._ref import make_cos_sin_cache, make_paged_batch, naive_paged_attention

pytest.importorskip("triton")

DEV = "cuda" if os.environ.get("ZEROSERVE_TEST_GPU") else "cpu"
if DEV == "cuda" and not torch.cuda.is_available():
    pytest.skip("ZEROSERVE_TEST_GPU set but no CUDA device", allow_module_level=True)

ATTN_TOL = {torch.float32: (1e-4, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
EW_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}


def _close(a, b, tol):
    rtol, atol = tol
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- elementwise
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_and_fused_add(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 96, generator=g).to(dtype).to(DEV)  # H not a power of two
    r = torch.randn(6, 96, generator=g).to(dtype).to(DEV)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype).to(DEV)
    _close(tri.rms_norm(x, w, 1e-6), ref_ops.rms_norm(x, w, 1e-6), EW_TOL[dtype])
    out, res = tri.fused_add_rms_norm(x, r, w, 1e-5)
    rout, rres = ref_ops.fused_add_rms_norm(x, r, w, 1e-5)
    if dtype == torch.bfloat16 and DEV == "cpu":
        _close(res, rres, EW_TOL[dtype])  # the interpreter rounds fp32 -> bf16 differently
    else:
        assert torch.equal(res, rres)
    _close(out, rout, EW_TOL[dtype])
    # strided rows (a slice of a wider buffer)
    wide = torch.randn(6, 128, generator=g).to(dtype).to(DEV)[:, :96]
    _close(tri.rms_norm(wide, w, 1e-6), ref_ops.rms_norm(wide, w, 1e-6), EW_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 80, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEV)
    _close(tri.silu_and_mul(x), ref_ops.silu_and_mul(x), EW_TOL[dtype])


@pytest.mark.parametrize(
    "dtype,head_dim,rot_dim", [(torch.float32, 64, 64), (torch.float32, 128, 64),
                               (torch.bfloat16, 128, 128)]
)
def test_rotary(dtype, head_dim, rot_dim):
    g = torch.Generator().manual_seed(3)
    t, hq, hk = 7, 6, 2
    cache = make_cos_sin_cache(4096, rot_dim).to(DEV)
    pos = torch.tensor([0, 1, 15, 16, 17, 4095, 1000], device=DEV)
    # q and k as strided views of a fused qkv projection, like the model produces them
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, generator=g).to(dtype).to(DEV)
    q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hk) * head_dim].view(t, hk, head_dim)
    qa, ka = tri.rotary_embedding(pos, q, k, cache)
    qb, kb = ref_ops.rotary_embedding(pos, q, k, cache)
    _close(qa, qb, EW_TOL[dtype])
    _close(ka, kb, EW_TOL[dtype])
    if rot_dim < head_dim:
        assert torch.equal(qa[..., rot_dim:], q[..., rot_dim:])


@pytest.mark.parametrize("block_size,dtype", [(16, torch.float32), (32, torch.bfloat16)])
def test_write_kv(block_size, dtype):
    g = torch.Generator().manual_seed(4)
    nb, hk, d, t = 5, 2, 64, 9
    kv = torch.randn(t, 2 * hk, d, generator=g).to(dtype).to(DEV)
    k, v = kv[:, :hk], kv[:, hk:]  # strided views
    slots = torch.tensor([0, -1, 15, 16, block_size * 4 + 3, -1, 33, 2, block_size * nb - 1],
                         device=DEV)
    caches = [torch.zeros(nb, block_size, hk, d, dtype=dtype, device=DEV) for _ in range(4)]
    tri.write_kv(k, v, caches[0], caches[1], slots)
    ref_ops.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0


# --------------------------------------------------------------------------- attention
def _run_attention(seq_lens, q_lens, hq, hk, d, bs, dtype=torch.float32, naive=False, window=None, softcap=None,
                   **kw):
    q, kc, vc, meta = make_paged_batch(seq_lens, q_lens, hq, hk, d, bs, dtype=dtype,
                                       device=DEV, seed=sum(seq_lens))
    scale = d ** -0.5
    if softcap is not None:  # scores large enough that the cap bends them
        q = q * 4
    out = tri.paged_attention_impl(q, kc, vc, meta, scale, sliding_window=window, softcap=softcap, **kw)
    ref = ref_ops.paged_attention(q, kc, vc, meta, scale, sliding_window=window, softcap=softcap)
    _close(out, ref, ATTN_TOL[dtype])
    if naive:
        torch.testing.assert_close(out.double().cpu(),
                                   naive_paged_attention(q.cpu(), kc.cpu(), vc.cpu(),
                                                         _cpu_meta(meta), scale),
                                   rtol=1e-4, atol=2e-5)
    return out


def _cpu_meta(m):
    return AttentionMetadata(m.slot_mapping.cpu(), m.block_tables.cpu(), m.seq_lens.cpu(),
                             m.query_start_loc.cpu(), m.max_query_len, m.max_seq_len)


# (Hq, Hk, D, BS): GQA 1/2/4/8 (+ a non power of two group), D 64/128, BS 16/32/48/64
DECODE_SHAPES = [
    (4, 4, 64, 16),
    (4, 2, 128, 32),
    (8, 2, 64, 48),
    (8, 1, 128, 16),
    (6, 2, 64, 64),
]


@pytest.mark.parametrize("shape", DECODE_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode(shape, num_splits):
    hq, hk, d, bs = shape
    # lengths: 1, just under / at / just over a block boundary, several blocks
    seq_lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5]
    _run_attention(seq_lens, [1] * len(seq_lens), hq, hk, d, bs, num_splits=num_splits,
                   naive=shape == DECODE_SHAPES[0])


def test_decode_split_with_empty_partitions_and_idle_request():
    # short requests next to a long one: most of their splits are empty (lse = -inf);
    # one request has no query this step (q_len 0)
    q, kc, vc, meta = make_paged_batch([3, 130, 17, 5], [1, 1, 0, 1], 8, 2, 64, 16,
                                       device=DEV, seed=7)
    out = tri.paged_attention_impl(q, kc, vc, meta, 0.125, num_splits=5)
    _close(out, ref_ops.paged_attention(q, kc, vc, meta, 0.125), ATTN_TOL[torch.float32])


# (seq_lens, q_lens, Hq, Hk, D, BS)
EXTEND_CASES = [
    # fresh prefill, ragged, crossing blocks; GQA 1
    ([33, 16, 7], [33, 16, 7], 2, 2, 64, 16),
    # chunked prefill / prefix hit: new tokens after a cached prefix (at and across a block
    # boundary), GQA 4, D 128, BS 32
    ([64, 45, 70], [32, 13, 6], 8, 2, 128, 32),
    # mixed batch: decodes + extend w/ prefix + fresh prefill + idle request, GQA 8, BS 48
    ([50, 9, 96, 20, 40], [1, 1, 17, 20, 0], 8, 1, 64, 48),
    # non power of two group (3), BS 64
    ([70, 1, 65], [20, 1, 65], 6, 2, 64, 64),
]


@pytest.mark.parametrize("case", EXTEND_CASES)
def test_prefill_extend_mixed(case):
    seq_lens, q_lens, hq, hk, d, bs = case
    _run_attention(seq_lens, q_lens, hq, hk, d, bs, naive=case is EXTEND_CASES[2])


def test_prefill_small_tiles():
    # tiles smaller than a block and several query tiles per request
    _run_attention([40, 21], [40, 5], 4, 2, 64, 32, block_m=16, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_half_precision(dtype):
    _run_attention([40, 9, 31, 64], [8, 1, 31, 1], 8, 2, 64, 16, dtype=dtype)
    _run_attention([40, 9, 31, 64], [1, 1, 1, 1], 8, 2, 64, 16, dtype=dtype, num_splits=2)


def test_padding_rows_are_zero_and_finite():
    # T larger than query_start_loc[-1] (padded batch): extra rows come back as zeros
    q, kc, vc, meta = make_paged_batch([20, 5], [4, 1], 4, 2, 64, 16, device=DEV, seed=3)
    qp = torch.cat([q, torch.randn(3, 4, 64, device=DEV)])
    for m in (meta, AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, 1, meta.max_seq_len)):
        if m.max_query_len == 1:  # decode-only view of the same batch
            m = AttentionMetadata(m.slot_mapping, m.block_tables, m.seq_lens,
                                  torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV), 1,
                                  m.max_seq_len)
        out = tri.paged_attention(qp, kc, vc, m, 0.125)
        ref = ref_ops.paged_attention(qp, kc, vc, m, 0.125)
        assert torch.isfinite(out).all()
        n = int(m.query_start_loc[-1])
        assert torch.equal(out[n:], torch.zeros_like(out[n:]))
        _close(out, ref, ATTN_TOL[torch.float32])


def test_get_ops_dispatch():
    from zeroserve.kernels.dispatch import get_ops

    assert get_ops("triton", "cpu") is tri
    assert get_ops("torch", "cpu") is ref_ops
    for name in ref_ops.__all__:
        assert callable(getattr(tri, name))


# sliding window / soft-cap (Gemma 2/3, Mistral) against the torch twin: decode (split and not),
# prefill, chunked prefill whose chunk straddles the window edge, mixed batches
@pytest.mark.parametrize("window,softcap", [(5, None), (16, None), (37, None), (None, 2.0), (7, 3.0)])
def test_attention_window_and_softcap(window, softcap):
    seq_lens = [1, 15, 16, 17, 53]
    _run_attention(seq_lens, [1] * 5, 8, 2, 64, 16, window=window, softcap=softcap)
    _run_attention(seq_lens, [1] * 5, 8, 2, 64, 16, window=window, softcap=softcap, num_splits=3)
    _run_attention([33, 50, 9, 70], [33, 13, 1, 20], 4, 2, 64, 16, window=window, softcap=softcap)
    _run_attention([40, 21], [40, 5], 4, 2, 64, 32, window=window, softcap=softcap, block_m=16, block_n=16)


def test_window_changes_the_output():
    q, kc, vc, meta = make_paged_batch([40], [40], 4, 2, 64, 16, device=DEV, seed=3)
    full = tri.paged_attention_impl(q, kc, vc, meta, 0.125)
    win = tri.paged_attention_impl(q, kc, vc, meta, 0.125, sliding_window=8)
    assert torch.equal(full[:8], win[:8]) and (full[8:] - win[8:]).abs().max() > 1e-2
