"""Torch twins vs naive / HF-style references (fast, CPU only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zeroserve.kernels import torch_ops as ops
from tests.kernels._ref import make_cos_sin_cache, make_paged_batch, naive_paged_attention


def _hf_rms(x, w, eps):
    dt = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def _hf_rope(q, k, cos, sin):
    def rot(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    x = torch.randn(7, 64).to(dtype)
    w = (torch.rand(64) + 0.5).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), _hf_rms(x, w, 1e-6), rtol=0, atol=0)
    r = torch.randn(7, 64).to(dtype)
    out, res = ops.fused_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(res, x + r, rtol=0, atol=0)
    torch.testing.assert_close(out, _hf_rms(x + r, w, 1e-5), rtol=0, atol=0)


def test_silu_and_mul():
    x = torch.randn(5, 2 * 48)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[:, :48]) * x[:, 48:])


@pytest.mark.parametrize("rot_dim", [64, 32])
def test_rotary_matches_hf(rot_dim):
    d, t = 64, 9
    cache = make_cos_sin_cache(100, rot_dim)
    pos = torch.tensor([0, 1, 2, 50, 51, 99, 7, 3, 3])
    q, k = torch.randn(t, 4, d), torch.randn(t, 2, d)
    q2, k2 = ops.rotary_embedding(pos, q, k, cache)
    cos = torch.cat([cache[pos, : rot_dim // 2]] * 2, -1).unsqueeze(1)
    sin = torch.cat([cache[pos, rot_dim // 2:]] * 2, -1).unsqueeze(1)
    qr, kr = _hf_rope(q[..., :rot_dim], k[..., :rot_dim], cos, sin)
    torch.testing.assert_close(q2[..., :rot_dim], qr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k2[..., :rot_dim], kr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q2[..., rot_dim:], q[..., rot_dim:], rtol=0, atol=0)
    torch.testing.assert_close(k2[..., rot_dim:], k[..., rot_dim:], rtol=0, atol=0)


def test_rotary_matches_transformers_module():
    tr = pytest.importorskip("transformers.models.llama.modeling_llama")
    d, t = 64, 6
    cache = make_cos_sin_cache(64, d, base=500000.0)
    pos = torch.tensor([0, 5, 6, 7, 40, 63])
    q, k = torch.randn(t, 4, d), torch.randn(t, 2, d)
    cos = torch.cat([cache[pos, : d // 2]] * 2, -1)
    sin = torch.cat([cache[pos, d // 2:]] * 2, -1)
    # HF layout [B, H, T, D] with cos/sin [B, T, D]
    qh, kh = tr.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     cos[None], sin[None])
    q2, k2 = ops.rotary_embedding(pos, q, k, cache)
    torch.testing.assert_close(q2, qh[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k2, kh[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_write_kv_skips_negative():
    nb, bs, hk, d = 4, 16, 2, 8
    kc, vc = torch.zeros(nb, bs, hk, d), torch.zeros(nb, bs, hk, d)
    k, v = torch.randn(5, hk, d), torch.randn(5, hk, d)
    slots = torch.tensor([3, -1, 17, 63, -1])
    ops.write_kv(k, v, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, hk, d), vc.view(-1, hk, d)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], k[i]) and torch.equal(flat_v[s], v[i])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 3
    ops.write_kv(k[:1], v[:1], kc, vc, torch.tensor([0]))
    assert torch.equal(flat_k[0], k[0])


CASES = [
    # (seq_lens, q_lens, Hq, Hk, D, BS)
    ([5, 16, 17, 33], [1, 1, 1, 1], 8, 2, 32, 16),  # decode, block boundaries
    ([20, 7], [20, 7], 4, 4, 16, 16),  # pure prefill
    ([37], [37], 8, 2, 32, 16),  # one whole prompt, GQA: SDPA's own causal mask (fresh)
    ([12, 12], [12, 12], 4, 4, 16, 16),  # two whole prompts of one length (fresh, padded batch)
    ([40, 9, 31, 64], [8, 1, 31, 1], 8, 1, 32, 32),  # mixed: extend w/ prefix + decode + prefill
    ([48, 3, 17], [16, 1, 2], 6, 3, 16, 16),  # extend at block boundary, GQA 2
    ([5, 12], [0, 3], 4, 2, 16, 16),  # a request with no queries this step
    # lengths spread enough to split decodes and extends into several padded groups
    ([200, 5, 150, 6, 3, 90], [100, 5, 1, 2, 1, 1], 4, 2, 16, 16),
]


@pytest.mark.parametrize("case", CASES)
def test_paged_attention_vs_naive(case):
    seq_lens, q_lens, hq, hk, d, bs = case
    q, kc, vc, meta = make_paged_batch(seq_lens, q_lens, hq, hk, d, bs, seed=len(seq_lens))
    scale = d ** -0.5
    out = ops.paged_attention(q, kc, vc, meta, scale)
    ref = naive_paged_attention(q, kc, vc, meta, scale)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_grouping_bounds_padding():
    assert ops._group_by_padding([100, 5, 2], [2000, 5, 6]) == [[0], [2, 1]]
    assert ops._group_by_padding([1] * 3, [8000, 10, 5]) == [[0], [1, 2]]
    assert ops._group_by_padding([1] * 4, [64, 60, 58, 50]) == [[0, 1, 2, 3]]


def test_paged_attention_bf16():
    q, kc, vc, meta = make_paged_batch([30, 9], [6, 1], 4, 2, 32, 16, dtype=torch.bfloat16)
    out = ops.paged_attention(q, kc, vc, meta, 32 ** -0.5)
    assert out.dtype == torch.bfloat16
    ref = naive_paged_attention(q, kc, vc, meta, 32 ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_paged_attention_strided_q():
    # q as a view of a fused qkv projection (non-contiguous rows)
    q, kc, vc, meta = make_paged_batch([9, 20], [1, 1], 4, 2, 16, 16, seed=5)
    wide = torch.cat([q, torch.randn(2, 4, 16)], dim=1)[:, :4]
    assert not wide.is_contiguous()
    torch.testing.assert_close(ops.paged_attention(wide, kc, vc, meta, 0.25),
                               ops.paged_attention(q, kc, vc, meta, 0.25))
