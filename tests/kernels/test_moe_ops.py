"""The MoE ops: routing, the torch twin against a naive every-expert reference, and the Triton
grouped GEMM (TRITON_INTERPRET=1 on CPU, tests/conftest.py) against the twin."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from zeroserve.kernels.dispatch import get_ops
from zeroserve.kernels import moe as M

DEV = "cuda" if os.environ.get("ZEROSERVE_TEST_GPU") else "cpu"


def _naive(x, w13, w2, weights, ids, start=0):
    """Every token through every one of its experts, one at a time (fp64)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - start
            if not 0 <= e < w13.shape[0]:
                continue
            g, u = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(g) * u))
    return out


def _case(t=13, h=32, inter=48, e=6, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    logits = torch.randn(t, e, generator=g)
    return x, w13, w2, logits


@pytest.mark.parametrize("renorm", [True, False])
def test_route_matches_softmax_topk(renorm):
    _, _, _, logits = _case()
    w, ids = M.route(logits, 2, renorm)
    probs = torch.softmax(logits, -1)
    ref_w, ref_ids = probs.topk(2, -1)
    if renorm:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert torch.equal(ids, ref_ids) and torch.allclose(w, ref_w)


@pytest.mark.parametrize("t", [1, 13])  # 1: the batch-1 path without gather / scatter
@pytest.mark.parametrize("start,local", [(0, 6), (2, 3)])
def test_twin_matches_naive(start, local, t):
    x, w13, w2, logits = _case(t=t)
    w, ids = M.route(logits, 2, True)
    got = M.fused_moe(x, w13[start:start + local], w2[start:start + local], w, ids, expert_start=start)
    ref = _naive(x, w13[start:start + local], w2[start:start + local], w, ids, start)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_twin_touches_only_active_experts():
    x, w13, w2, logits = _case(t=3, e=64)
    w, ids = M.route(logits, 2, True)
    groups = M.expert_groups(ids, 64)
    assert len(groups) == len(set(ids.flatten().tolist())) <= 6
    assert sorted(int(s) for _, slots, _ in groups for s in slots) == list(range(6))


def test_align_block_size_layout():
    ids = torch.tensor([[3, 1], [1, 0], [3, 5]])
    slots, tile_expert = M.align_block_size(ids, 4, 4, expert_start=0)  # expert 5 is not local
    n = ids.numel()
    tiles = slots.view(-1, 4).tolist()
    used = [(int(te), [s for s in tile if s < n]) for te, tile in zip(tile_expert, tiles) if te >= 0]
    assert used == [(0, [3]), (1, [1, 2]), (3, [0, 4])]
    assert all(all(s == n for s in tile) for te, tile in zip(tile_expert, tiles) if te < 0)


def test_ops_namespaces_expose_fused_moe():
    for backend in ("torch", "cpu"):
        assert get_ops(backend).fused_moe is M.fused_moe


@pytest.mark.parametrize("t,e,k,start,local", [(1, 4, 2, 0, 4), (13, 8, 2, 0, 8), (40, 6, 3, 3, 3)])
def test_triton_fused_moe_matches_twin(t, e, k, start, local):
    pytest.importorskip("triton")
    from zeroserve.kernels import triton_ops

    x, w13, w2, logits = _case(t=t, e=e)
    w, ids = M.route(logits, k, False)
    w13l, w2l = w13[start:start + local].contiguous(), w2[start:start + local].contiguous()
    ref = M.fused_moe(x, w13l, w2l, w, ids, expert_start=start)
    got = triton_ops.fused_moe(x.to(DEV), w13l.to(DEV), w2l.to(DEV), w.to(DEV), ids.to(DEV), expert_start=start)
    torch.testing.assert_close(got.cpu(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_fused_moe_half_precision(dtype):
    pytest.importorskip("triton")
    from zeroserve.kernels import triton_ops

    x, w13, w2, logits = _case(t=9, e=4)
    w, ids = M.route(logits, 2, True)
    ref = M.fused_moe(x, w13, w2, w, ids)  # fp32 twin
    got = triton_ops.fused_moe(x.to(dtype).to(DEV), w13.to(dtype).to(DEV), w2.to(dtype).to(DEV), w.to(DEV), ids.to(DEV))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), ref, atol=5e-2, rtol=5e-2)
