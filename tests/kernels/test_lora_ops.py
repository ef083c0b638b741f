"""add_lora: the C kernel (csrc/lora.c) and the Triton kernels vs the torch twin (kernels/lora.py),
and the twin against a plain per-row formula; the C kernel's rows are batch-invariant (bit for bit).

The Triton tests run under TRITON_INTERPRET=1 on CPU (tests/conftest.py), compiled with
ZEROSERVE_TEST_GPU=1.
"""

from __future__ import annotations

import os

import pytest
import torch

from zeroserve.kernels import cpu_native
from zeroserve.kernels.lora import LoRABatch, add_lora_cpu, add_lora_triton, add_lora_twin

DEV = "cuda" if os.environ.get("ZEROSERVE_TEST_GPU") else "cpu"


def _case(t=7, k=40, parts=(24, 8, 8), r=4, s=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(parts)
    p = len(parts)
    bounds = (0, *torch.tensor(parts).cumsum(0).tolist())
    x = torch.randn(t, k, generator=g).to(dtype)
    y = torch.randn(t, n, generator=g).to(dtype)
    a = (torch.randn(s, k, p * r, generator=g) * 0.3).to(dtype)  # A^T of every part, stacked
    b = (torch.randn(s, r, n, generator=g) * 0.3).to(dtype)  # B^T
    scale = torch.rand(s, generator=g) + 0.5
    return y, x, a, b, scale, bounds


def _naive(y, x, a, b, scale, bounds, slots):
    """fp64, row by row, part by part: y[t] += B_p @ (A_p @ x[t]) * scale."""
    out = y.double().clone()
    r = b.shape[1]
    for t, s in enumerate(slots):
        if s < 0:
            continue
        for p in range(len(bounds) - 1):
            lo, hi = bounds[p], bounds[p + 1]
            a_p = a[s, :, p * r:(p + 1) * r].t().double()  # [r, K]
            b_p = b[s, :, lo:hi].t().double()  # [N_p, r]
            out[t, lo:hi] += (b_p @ (a_p @ x[t].double())) * float(scale[s])
    return out


SLOTS = [2, -1, 0, 2, 2, -1, 1]  # three adapters and the base model, interleaved


def test_twin_matches_naive_formula():
    y, x, a, b, scale, bounds = _case()
    want = _naive(y, x, a, b, scale, bounds, SLOTS)
    got = add_lora_twin(y.clone(), x, a, b, scale, bounds, LoRABatch.from_rows(SLOTS, "cpu"))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], y[1]) and torch.equal(got[5], y[5])  # base rows untouched


def test_no_adapter_rows_is_no_batch():
    assert LoRABatch.from_rows([-1, -1], "cpu") is None
    assert LoRABatch.from_rows([], "cpu") is None


@pytest.mark.parametrize("parts,r", [((24, 8, 8), 4), ((33,), 16), ((20, 20), 3)])
def test_cpu_kernel_matches_twin(parts, r):
    if cpu_native.lora_lib() is None:
        pytest.skip(f"no compiled kernels: {cpu_native._LORA.reason}")
    y, x, a, b, scale, bounds = _case(parts=parts, r=r, k=67)
    batch = LoRABatch.from_rows(SLOTS, "cpu")
    want = add_lora_twin(y.clone(), x, a, b, scale, bounds, batch)
    got = add_lora_cpu(y.clone(), x, a, b, scale, bounds, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], y[1])


def test_cpu_kernel_rows_are_batch_invariant():
    """A row's bits do not depend on the other rows, their adapters or the thread count."""
    if cpu_native.lora_lib() is None:
        pytest.skip("no compiled kernels")
    y, x, a, b, scale, bounds = _case(t=64, k=576, parts=(576, 192, 192), r=16, s=4)
    slots = [i % 5 - 1 for i in range(64)]
    full = add_lora_cpu(y.clone(), x, a, b, scale, bounds, LoRABatch.from_rows(slots, "cpu"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for t in (1, 3, 17, 62):  # rows with an adapter (slot >= 0)
            alone = add_lora_cpu(y[t:t + 1].clone(), x[t:t + 1], a, b, scale, bounds,
                                 LoRABatch.from_rows([slots[t]], "cpu"))
            assert torch.equal(alone[0], full[t]), t
    finally:
        torch.set_num_threads(threads)


def test_cpu_kernel_strided_rows_and_fallback():
    """y as a view of a wider buffer (a row stride): the kernel writes only its columns; a bf16
    call takes the twin."""
    y, x, a, b, scale, bounds = _case()
    wide = torch.zeros(y.shape[0], y.shape[1] + 5)
    wide[:, :y.shape[1]] = y
    batch = LoRABatch.from_rows(SLOTS, "cpu")
    add_lora_cpu(wide[:, :y.shape[1]], x, a, b, scale, bounds, batch)
    torch.testing.assert_close(wide[:, :y.shape[1]], add_lora_twin(y.clone(), x, a, b, scale, bounds, batch),
                               rtol=1e-5, atol=1e-5)
    assert not wide[:, y.shape[1]:].any()
    yb, xb, ab, bb = (t.to(torch.bfloat16) for t in (y, x, a, b))
    got = add_lora_cpu(yb.clone(), xb, ab, bb, scale, bounds, batch)
    assert torch.equal(got, add_lora_twin(yb.clone(), xb, ab, bb, scale, bounds, batch))


def test_bad_shapes_are_named():
    y, x, a, b, scale, bounds = _case()
    with pytest.raises(ValueError, match="shapes do not fit"):
        add_lora_twin(y, x[:, :-1], a, b, scale, bounds, LoRABatch.from_rows(SLOTS, "cpu"))


@pytest.mark.parametrize("parts,r,dtype", [((24, 8, 8), 4, torch.float32), ((33,), 16, torch.float32),
                                           ((40, 40), 8, torch.float16)])
def test_triton_kernels_match_twin(parts, r, dtype):
    pytest.importorskip("triton")
    if DEV == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    y, x, a, b, scale, bounds = _case(parts=parts, r=r, k=50, dtype=dtype)
    y, x, a, b, scale = (t.to(DEV) for t in (y, x, a, b, scale))
    batch = LoRABatch.from_rows(SLOTS, DEV)
    want = add_lora_twin(y.clone(), x, a, b, scale, bounds, batch)
    got = add_lora_triton(y.clone(), x, a, b, scale, bounds, batch)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(got[1], y[1])
