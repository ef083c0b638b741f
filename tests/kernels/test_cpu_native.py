"""The compiled CPU decode kernel (kernels/csrc/paged_decode.c) against its torch twin.

Tolerance: fp32 only (the kernel takes no other dtype); rtol 1e-5 / atol 2e-6, the spread of
two fp32 summation orders over a few hundred keys.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroserve.kernels.dispatch import get_ops
from zeroserve.kernels import cpu_native, cpu_ops, torch_ops
from tests.kernels._ref import make_paged_batch, naive_paged_attention

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason=f"compiled CPU kernels unavailable: {cpu_native.unavailable_reason()}")

TOL = dict(rtol=1e-5, atol=2e-6)


def _decode_case(seq_lens, hq, hk, d, bs, seed=0):
    q, kc, vc, meta = make_paged_batch(seq_lens, [1] * len(seq_lens), hq, hk, d, bs, seed=seed)
    return q, kc, vc, meta


@pytest.mark.parametrize("grp", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bs", [8, 16, 32])
def test_decode_matches_twin(grp, d, bs):
    hk = 2
    # ragged: 1 token, at and across block boundaries, several blocks, a long one
    seq_lens = [1, bs - 1, bs, bs + 1, 2 * bs, 3 * bs + 5, 200]
    q, kc, vc, meta = _decode_case(seq_lens, hk * grp, hk, d, bs, seed=grp * 1000 + d + bs)
    scale = d ** -0.5
    got = cpu_native.paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, scale)
    twin = torch_ops.paged_attention(q, kc, vc, meta, scale)
    torch.testing.assert_close(got, twin, **TOL)


def test_decode_matches_naive_reference():
    q, kc, vc, meta = _decode_case([3, 17, 64, 129], 8, 2, 64, 16, seed=3)
    got = cpu_native.paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(got.double(), naive_paged_attention(q, kc, vc, meta, 0.125), rtol=1e-5, atol=1e-6)


def test_large_scores_do_not_overflow():
    # scores in the hundreds: the online softmax must rescale, not overflow exp()
    q, kc, vc, meta = _decode_case([40, 90], 4, 2, 64, 16, seed=9)
    q = q * 60.0
    got = cpu_native.paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch_ops.paged_attention(q, kc, vc, meta, 0.125), rtol=1e-4, atol=1e-5)


def test_empty_request_gives_zeros_and_threads_agree():
    q, kc, vc, meta = _decode_case([5, 33, 70], 8, 4, 64, 16, seed=4)
    sl = meta.seq_lens.clone()
    sl[1] = 0
    got = cpu_native.paged_decode(q, kc, vc, meta.block_tables, sl, 0.125)
    assert torch.count_nonzero(got[1]) == 0
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_native.paged_decode(q, kc, vc, meta.block_tables, sl, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, got), "the result depends on the thread count"


def test_cpu_op_set_mixed_batch_matches_twin():
    # decodes next to an extend with a cached prefix, a prefill, a request with no queries,
    # and q as a strided view (a slice of the fused qkv projection)
    seq_lens, q_lens = [40, 9, 31, 64, 12, 200], [8, 1, 31, 1, 0, 1]
    q, kc, vc, meta = make_paged_batch(seq_lens, q_lens, 8, 2, 64, 16, seed=11)
    wide = torch.cat([q, torch.randn(q.shape[0], 4, 64)], dim=1)[:, :8]
    scale = 0.125
    got = cpu_ops.paged_attention(wide, kc, vc, meta, scale)
    torch.testing.assert_close(got, torch_ops.paged_attention(q, kc, vc, meta, scale), **TOL)
    # all-decode batches take the direct path
    q, kc, vc, meta = _decode_case([7, 16, 90], 8, 2, 64, 16, seed=12)
    torch.testing.assert_close(cpu_ops.paged_attention(q, kc, vc, meta, scale),
                               torch_ops.paged_attention(q, kc, vc, meta, scale), **TOL)


def test_other_dtypes_use_the_twin():
    q, kc, vc, meta = make_paged_batch([30, 9], [1, 1], 4, 2, 32, 16, dtype=torch.bfloat16)
    assert not cpu_native.supports(q, kc)
    out = cpu_ops.paged_attention(q, kc, vc, meta, 32 ** -0.5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch_ops.paged_attention(q, kc, vc, meta, 32 ** -0.5))


def test_backend_dispatch():
    assert get_ops("auto", "cpu") is cpu_ops
    assert get_ops("cpu", "cpu") is cpu_ops
    assert get_ops("torch", "cpu") is torch_ops
    with pytest.raises(ValueError, match="cpu"):
        get_ops("cpu", "cuda")


def test_turned_off_or_without_compiler_falls_back(tmp_path):
    """ZEROSERVE_CPU_NATIVE=0 or no compiler: the op set serves through the twin and says why."""
    code = (
        "import torch; from zeroserve.kernels import cpu_native, cpu_ops, torch_ops\n"
        "from tests.kernels._ref import make_paged_batch\n"
        "q, kc, vc, m = make_paged_batch([5, 20], [1, 1], 4, 2, 16, 16)\n"
        "assert not cpu_native.available()\n"
        "assert torch.equal(cpu_ops.paged_attention(q, kc, vc, m, 0.25), torch_ops.paged_attention(q, kc, vc, m, 0.25))\n"
        "print(cpu_native.unavailable_reason())\n"
    )
    for env, needle in (({"ZEROSERVE_CPU_NATIVE": "0"}, "ZEROSERVE_CPU_NATIVE"),
                        ({"CC": str(tmp_path / "no-such-cc"), "ZEROSERVE_CACHE": str(tmp_path)}, "no-such-cc")):
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert needle in r.stdout, r.stdout


# ---------------------------------------------------------------- csrc/cpu_ops.c: the small ops
ops_native = pytest.mark.skipif(cpu_native.ops_lib() is None, reason=f"{cpu_native.ops_unavailable_reason()}")


@ops_native
@pytest.mark.parametrize("t,h", [(1, 576), (3, 64), (7, 100), (300, 256)])
def test_norms_match_twin(t, h):
    g = torch.Generator().manual_seed(t * h)
    base = torch.randn(t, h + 8, generator=g)
    x = base[:, 4:4 + h]  # strided rows, as a view of a wider buffer
    r, w = torch.randn(t, h, generator=g), torch.randn(h, generator=g)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), torch_ops.rms_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    out, res = cpu_ops.fused_add_rms_norm(x, r, w, 1e-5)
    out2, res2 = torch_ops.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(res, res2)  # the add is exact
    torch.testing.assert_close(out, out2, rtol=2e-6, atol=1e-6)  # the sum of squares: another order


@ops_native
@pytest.mark.parametrize("rot", [64, 32])
def test_rotary_is_the_twin_bit_for_bit(rot):
    from zeroserve.services.worker.model.layers import build_cos_sin_cache

    g = torch.Generator().manual_seed(rot)
    qkv = torch.randn(5, 9 * 64 + 2 * 3 * 64, generator=g)  # q, k as strided views of one qkv row
    q, k = qkv[:, :576].reshape(5, 9, 64), qkv[:, 576:768].reshape(5, 3, 64)
    cs = build_cos_sin_cache(64, rot, 10000.0, None, "cpu")
    pos = torch.tensor([0, 1, 7, 30, 63])
    for a, b in zip(cpu_ops.rotary_embedding(pos, q, k, cs), torch_ops.rotary_embedding(pos, q, k, cs)):
        assert torch.equal(a, b)
    with pytest.raises(IndexError):
        cpu_ops.rotary_embedding(torch.tensor([0, 1, 2, 3, 64]), q, k, cs)


@ops_native
def test_silu_and_mul_and_write_kv_match_twin():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2 * 96, generator=g) * 4
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), torch_ops.silu_and_mul(x), rtol=2e-6, atol=1e-6)
    kv = torch.randn(4, 2, 3, 16, generator=g)
    k, v = kv[:, 0], kv[:, 1]  # non-contiguous rows
    slots = torch.tensor([5, -1, 0, 17])  # -1: a padding row, skipped
    caches = [torch.zeros(5, 4, 3, 16) for _ in range(4)]
    cpu_ops.write_kv(k, v, caches[0], caches[1], slots)
    torch_ops.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]) and caches[0].abs().sum() > 0
    with pytest.raises(IndexError):
        cpu_ops.write_kv(k, v, caches[0], caches[1], torch.tensor([5, 1, 0, 20]))
