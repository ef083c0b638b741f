"""The bf16 regime of the packed matmul (kernels/csrc/qmatmul_bf16.c, QuantizedWeight.linear_bf16).

x and the dequantized weight are rounded to bf16 and multiplied with fp32 sums: against its twin
(the same rounded operands through an fp32 matmul) only the summation order differs, so the
bound is test_quant's fp32 one over the rounded operands. Row slices, batch composition and
thread counts must not change a row's result. Checked on every build this machine can make:
native VDPBF16PS where the CPU has AVX-512 BF16, the emulated path (rounded values through the
fp32 GEMM) and the portable C build.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from zeroserve.kernels import cpu_native, quant
from tests.kernels.test_quant import check_close, make_weight, native


def _rounded(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _check(got: torch.Tensor, x: torch.Tensor, qw) -> None:
    check_close(got, _rounded(x), _rounded(qw.dequantize()))


def _build(tmp_path, monkeypatch, *defines: str):
    monkeypatch.setenv("ZEROSERVE_CACHE", str(tmp_path))
    flags = [f for f in cpu_native.QUANT_CFLAGS if f != "-O3"] + ["-O1", *defines]  # -O1: builds faster
    return cpu_native.bind_quant(ctypes.CDLL(str(cpu_native._build(cpu_native._find_cc(), cpu_native.QUANT_SOURCE,
                                                                    flags))))


@native
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_bf16_kernel_matches_twin(fmt):
    g = torch.Generator().manual_seed(4)
    for k in (256, 576, 1536):  # 1536: past the kernel's 1024-column panels (sums carried over)
        if fmt == "q4_k" and k % 256:
            continue
        for n in (1, 30, 100):  # short panels and micro-tiles
            qw = make_weight(fmt, n, k, seed=k + n)
            for t in (1, 5, 16, 61):  # 61: past one pass of rows
                x = torch.randn(t, k, generator=g)
                x[:, :8] += 4.0
                got = qw.linear_bf16(x)
                assert got.shape == (t, n) and got.dtype == torch.float32
                _check(got, x, qw)
                _check(qw.linear_bf16_twin(x), x, qw)  # the twin meets the same bound


@native
@pytest.mark.parametrize("fmt,k", [("q4_1", 512), ("q8_0", 512), ("q4_0", 512), ("int4", 512), ("q4_1", 1536)])
def test_bf16_rows_threads_and_batch_invariance(fmt, k):
    """One row of x (the dot-product path for the register-decoded formats, no panel) and every
    larger row count (the panel GEMM) give each row the same bits; K = 1536 carries the GEMM's
    sums across its 1024-column panels."""
    lib = cpu_native.quant_lib()
    qw = make_weight(fmt, 70, k, seed=9)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(6))
    full = qw.linear_bf16(x)
    for t in range(0, 40, 3):
        assert torch.equal(qw.linear_bf16(x[t:t + 1]), full[t:t + 1]), t
    for rows in (slice(3, 11), slice(7, 40)):
        assert torch.equal(qw.linear_bf16(x[rows]), full[rows]), rows
    for threads in (1, 2, 3):
        assert torch.equal(quant.kernel_linear(lib, qw, x, threads=threads, bf16=True), full), threads
    assert torch.equal(qw.rows(20, 50).linear_bf16(x), full[:, 20:50])


@native
def test_bf16_bias_dtypes_and_the_exact_regime_apart():
    qw = make_weight("q4_1", 48, 256, seed=3)
    x = torch.randn(2, 6, 256, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(48)
    y = qw.linear_bf16(x, bias)
    assert y.shape == (2, 6, 48)
    _check(y.reshape(12, 48) - bias, x.reshape(12, 256), qw)
    assert qw.linear_bf16(x.bfloat16()).dtype == torch.bfloat16
    exact = qw.linear(x.reshape(12, 256))
    assert not torch.equal(y.reshape(12, 48) - bias, exact)  # a regime of its own, not the fp32 path
    torch.testing.assert_close(y.reshape(12, 48) - bias, exact, rtol=0, atol=float(exact.abs().max()) * 2e-2)


@native
@pytest.mark.parametrize("define", ["-DZS_QM_NO_BF16", "-DZS_QM_PORTABLE"])
def test_emulated_and_portable_builds_match_twin(tmp_path, monkeypatch, define):
    """Without AVX-512 BF16 (or any vector ISA) the regime is the same values through the fp32
    GEMM: every machine computes it, and agrees with the native build to summation order."""
    lib = _build(tmp_path, monkeypatch, define)
    assert not lib.bf16_native
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(8))
    for fmt in quant.FORMATS:
        qw = make_weight(fmt, 33, 512, seed=1)
        got = quant.kernel_linear(lib, qw, x, bf16=True)
        _check(got, x, qw)
        _check(qw.linear_bf16(x), x, qw)  # this machine's own build


@native
def test_native_and_emulated_bf16_are_different_numeric_modes(tmp_path, monkeypatch):
    """Which holds on this machine, native == emulated bit for bit or not, and the mode names
    agree with it: VDPBF16PS adds two products per lane step, the emulated path one (other
    roundings), so the names must differ wherever the bits do (docs/failure-model.md)."""
    from zeroserve.services.worker import numerics

    lib = cpu_native.quant_lib()
    if not lib.bf16_native:
        pytest.skip("this CPU has no AVX-512 BF16: the native build cannot run here")
    emu = _build(tmp_path, monkeypatch, "-DZS_QM_NO_BF16")
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(3))
    qw = make_weight("q4_1", 64, 1536, seed=2)
    same = torch.equal(quant.kernel_linear(lib, qw, x, bf16=True), quant.kernel_linear(emu, qw, x, bf16=True))
    names = {numerics.mode_name("bfloat16", b, torch.float32, None) for b in (lib, emu)}
    assert not same, "the two bf16 paths now agree bit for bit: give them one mode name (numerics.mode_name)"
    assert len(names) == 2
    # the fp32 regime does not depend on the bf16 path: one build's fp32 equals the other's
    assert torch.equal(quant.kernel_linear(lib, qw, x), quant.kernel_linear(emu, qw, x))
