"""Quantized weights (kernels/quant.py) and their compiled matmul (kernels/csrc/qmatmul.c).

The dequantizers must equal gguf's byte for byte; the kernel must match dequantize-then-matmul
to fp32 rounding: |kernel - exact| <= 2e-5 * (|x| @ |W|.T), the spread of two fp32 summation
orders over K <= 1536 terms (the twin is held to the same bound). Row slices, thread counts and
batch composition must not change the kernel's result at all.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zeroserve.kernels import cpu_native, quant
from zeroserve.kernels.quant import QuantizedWeight, quantize_int4, quantize_int8

ROOT = Path(__file__).resolve().parents[2]
GGUF_TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "q4_k": 12}
native = pytest.mark.skipif(cpu_native.quant_lib() is None,
                            reason=f"compiled qmatmul unavailable: {cpu_native.quant_unavailable_reason()}")


def _f16_bytes(rng, n, lo, hi):
    return np.float16(rng.uniform(lo, hi, n)).view(np.uint8).reshape(n, 2)


def random_gguf(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid random GGUF blocks for an [n, k] tensor: random code bytes, finite fp16 headers."""
    rng = np.random.default_rng(seed)
    _, block, nbytes = quant._FORMATS[fmt]
    nb = n * k // block
    b = rng.integers(0, 256, (nb, nbytes), dtype=np.uint8)
    if fmt == "q4_k":
        b[:, 0:2] = _f16_bytes(rng, nb, 1e-3, 2e-2)
        b[:, 2:4] = _f16_bytes(rng, nb, 1e-3, 2e-2)
    else:
        b[:, 0:2] = _f16_bytes(rng, nb, -0.1, 0.1)
        if fmt == "q4_1":
            b[:, 2:4] = _f16_bytes(rng, nb, -1.0, 1.0)
    return b.reshape(n, -1)


def make_weight(fmt: str, n: int, k: int, seed: int = 0, group: int = 64) -> QuantizedWeight:
    if fmt in GGUF_TYPES:
        return QuantizedWeight.from_gguf(random_gguf(fmt, n, k, seed), GGUF_TYPES[fmt], (n, k))
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if fmt in ("f32", "bf16"):  # plain float weights in the kernel
        return QuantizedWeight.from_float(w, fmt)
    return quantize_int8(w, group) if fmt == "int8" else quantize_int4(w, group)


def check_close(got: torch.Tensor, x: torch.Tensor, wd: torch.Tensor):
    exact = x.double() @ wd.double().T
    bound = 2e-5 * (x.double().abs() @ wd.double().abs().T) + 1e-30
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"


# --- dequantizers against gguf -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_matches_gguf_quantized(name):
    gguf = pytest.importorskip("gguf")
    qt = getattr(gguf.GGMLQuantizationType, name)
    w = np.random.default_rng(1).standard_normal((48, 576)).astype(np.float32)
    raw = gguf.quants.quantize(w, qt)
    qw = QuantizedWeight.from_gguf(raw, qt, (48, 576))
    assert torch.equal(qw.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, qt)))
    # and the quantization is sane: within half a step of the input
    step = np.abs(w).reshape(48, -1, 32).max(-1, keepdims=True) / (127 if name == "Q8_0" else 7)
    err = np.abs(qw.dequantize().numpy() - w).reshape(48, -1, 32)
    assert (err <= step * 1.01 + 1e-3).all()


@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
def test_dequantize_matches_gguf_random_blocks(fmt):
    gguf = pytest.importorskip("gguf")
    raw = random_gguf(fmt, 16, 512, seed=7)
    qt = gguf.GGMLQuantizationType(GGUF_TYPES[fmt])
    qw = QuantizedWeight.from_gguf(raw, qt.name, (16, 512))  # by name
    assert qw.format == fmt and qw.nbytes == raw.size
    assert torch.equal(qw.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, qt)))


def test_from_gguf_inputs_and_errors():
    raw = random_gguf("q4_0", 8, 64)
    a = QuantizedWeight.from_gguf(raw.tobytes(), 2, (8, 64))
    b = QuantizedWeight.from_gguf(torch.from_numpy(raw.reshape(-1)), 2, (8, 64))
    assert torch.equal(a.dequantize(), b.dequantize())
    with pytest.raises(ValueError, match="bytes"):
        QuantizedWeight.from_gguf(raw.tobytes()[:-1], 2, (8, 64))
    with pytest.raises(ValueError, match="multiple"):
        QuantizedWeight.from_gguf(raw, 12, (8, 64))  # Q4_K needs K % 256 == 0
    with pytest.raises(ValueError, match="GGML type"):
        QuantizedWeight.from_gguf(raw, 1, (8, 64))  # F16 is not a quantized type we read


# --- int8 / int4 from float weights --------------------------------------------------------------


@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_int_error_within_half_step(group):
    w = torch.randn(24, 576, generator=torch.Generator().manual_seed(group)) * 0.05
    w[3] = 0.0  # an all-zero row: scale 0, exact zeros
    w[5, :40] = 0.3  # a constant run
    for qw in (quantize_int8(w, group), quantize_int4(w, group)):
        steps = qw.scales.repeat_interleave(group, dim=1)[:, :576]
        err = (qw.dequantize() - w).abs()
        assert (err <= steps / 2 * 1.0001 + 1e-7).all(), qw
        assert torch.count_nonzero(qw.dequantize()[3]) == 0
        assert qw.scales.shape == (24, -(-576 // group))  # 128: the last group is half


def test_quantize_int_rejects_bad_groups():
    with pytest.raises(ValueError):
        quantize_int8(torch.randn(4, 64), 48)
    with pytest.raises(ValueError):
        quantize_int4(torch.randn(4, 40), 32)


# --- the kernel against the twin -----------------------------------------------------------------


@native
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_kernel_matches_twin(fmt):
    g = torch.Generator().manual_seed(3)
    for k in (256, 576, 1536):
        if fmt == "q4_k" and k % 256:
            continue
        for n in (1, 64, 576):
            qw = make_weight(fmt, n, k, seed=k + n)
            wd = qw.dequantize()
            for t in (1, 3, 17):
                x = torch.randn(t, k, generator=g)
                x[:, :8] += 4.0  # a few large channels, like real activations
                got = qw.linear(x)
                assert got.shape == (t, n) and got.dtype == torch.float32
                check_close(got, x, wd)
                check_close(F.linear(x, wd), x, wd)  # the twin meets the same bound


@native
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_rows_cols_threads_and_batch_invariance(fmt):
    n, k = 96, 512
    qw = make_weight(fmt, n, k, seed=11)
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(5))
    full = qw.linear(x)
    # a row shard computes its rows exactly as the full weight does
    part = qw.rows(40, 72)
    assert part.shape == (32, k) and part.data.data_ptr() == qw.data[40].data_ptr()
    assert torch.equal(part.dequantize(), qw.dequantize()[40:72])
    assert torch.equal(part.linear(x), full[:, 40:72])
    # gathered and stacked rows (llama.cpp's q/k unpermute, fused projections)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    assert torch.equal(qw.select_rows(perm).linear(x), full[:, perm])
    fused = QuantizedWeight.cat([qw.rows(0, 10), qw.rows(50, 96)])
    assert torch.equal(fused.linear(x), torch.cat([full[:, :10], full[:, 50:]], 1))
    # a column shard is a view too; the shards' partial sums add up to the whole
    b = qw.block_size
    left, right = qw.cols(0, 2 * b if b < 256 else 256), qw.cols(2 * b if b < 256 else 256, k)
    assert torch.equal(torch.cat([left.dequantize(), right.dequantize()], 1), qw.dequantize())
    split = left.shape[1]
    check_close(left.linear(x[:, :split]), x[:, :split], left.dequantize())
    check_close(left.linear(x[:, :split]) + right.linear(x[:, split:]), x, qw.dequantize())
    # a row gives the same bits in any batch and with any thread count: the packed tile (below
    # lib.gemm_rows rows) and the dequantized panels + GEMM (from there on) compute alike
    lib = cpu_native.quant_lib()
    assert 1 < lib.gemm_rows <= 20
    for rows in (slice(7, 8), slice(2, 5), slice(2, 2 + lib.gemm_rows - 1), slice(3, 3 + lib.gemm_rows)):
        assert torch.equal(qw.linear(x[rows]), full[rows]), rows
    for threads in (1, 2, 3):
        assert torch.equal(quant.kernel_linear(lib, qw, x, threads=threads), full), threads
        assert torch.equal(quant.kernel_linear(lib, qw, x[7:8], threads=threads), full[7:8]), threads
    check_close(full, x, qw.dequantize())


@native
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_compiled_dequantize_is_the_twin_and_many_rows_stay_on_the_kernel(fmt):
    for n, k, group in ((1, 256, 32), (70, 512, 64), (33, 768, 128)):
        qw = make_weight(fmt, n, k, seed=n + k, group=group)
        assert torch.equal(qw.dequantize(), qw.dequantize_twin()), (n, k, group)
        assert torch.equal(qw.dequantize(torch.bfloat16), qw.dequantize_twin(torch.bfloat16))
    # prefill-sized calls stay on the kernel (a float GEMM there would round otherwise)
    x = torch.randn(130, 768, generator=torch.Generator().manual_seed(2))
    y = qw.linear(x)
    check_close(y, x, qw.dequantize())
    assert torch.equal(qw.linear(x[:1]), y[:1])


@native
def test_linear_shapes_dtypes_bias_and_views():
    qw = make_weight("q4_k", 40, 256, seed=2)
    x = torch.randn(2, 3, 300)[..., 10:266]  # a strided view, leading dims
    bias = torch.randn(40)
    y = qw.linear(x, bias)
    assert y.shape == (2, 3, 40)
    check_close(y.reshape(6, 40) - bias, x.reshape(6, 256), qw.dequantize())
    yb = qw.linear(x.bfloat16(), bias.bfloat16())
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y, rtol=2e-2, atol=2e-2 * y.abs().max().item())
    assert qw.linear(torch.randn(0, 256)).shape == (0, 40)
    with pytest.raises(ValueError, match="features"):
        qw.linear(torch.randn(1, 128))


@native
def test_portable_build_matches_twin(tmp_path, monkeypatch):
    """The plain-C path (non-x86 machines) built here and checked against the twin."""
    monkeypatch.setenv("ZEROSERVE_CACHE", str(tmp_path))
    cc = cpu_native._find_cc()
    flags = [f for f in cpu_native.QUANT_CFLAGS if f != "-O3"] + ["-O1", "-DZS_QM_PORTABLE"]  # -O1: builds faster
    path = cpu_native._build(cc, cpu_native.QUANT_SOURCE, flags)
    lib = cpu_native.bind_quant(ctypes.CDLL(str(path)))
    assert lib.isa == "portable"
    x = torch.randn(lib.gemm_rows + 2, 512, generator=torch.Generator().manual_seed(8))
    for fmt in quant.FORMATS:
        qw = make_weight(fmt, 33, 512, seed=1)
        check_close(quant.kernel_linear(lib, qw, x[:9]), x[:9], qw.dequantize())  # packed
        check_close(quant.kernel_linear(lib, qw, x), x, qw.dequantize())  # dequantized panels + GEMM
    assert cpu_native.quant_lib().isa in ("avx2", "avx512", "portable")


def test_turned_off_or_without_compiler_falls_back(tmp_path):
    """ZEROSERVE_CPU_NATIVE=0 or no compiler: linear is the twin exactly, and says why."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "from zeroserve.kernels import cpu_native\n"
        "from zeroserve.kernels.quant import quantize_int4\n"
        "qw = quantize_int4(torch.randn(16, 64), 32)\n"
        "x = torch.randn(3, 64)\n"
        "assert cpu_native.quant_lib() is None\n"
        "assert torch.equal(qw.linear(x), F.linear(x, qw.dequantize()))\n"
        "print(cpu_native.quant_unavailable_reason())\n"
    )
    for env, needle in (({"ZEROSERVE_CPU_NATIVE": "0"}, "ZEROSERVE_CPU_NATIVE"),
                        ({"CC": str(tmp_path / "no-such-cc"), "ZEROSERVE_CACHE": str(tmp_path)}, "no-such-cc")):
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert needle in r.stdout, r.stdout
