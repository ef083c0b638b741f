"""Mixture-of-experts ops: top-k routing, the torch twin of the fused MoE, the Triton tile layout.

    weights, ids = route(router_logits, top_k, renormalize)          # [T, k] fp32, [T, k] int64
    out = fused_moe(x, w13, w2, weights, ids, expert_start=0)        # [T, H]

`w13[e]` is expert e's gate and up projections stacked ([E, 2*I, H], gate rows first), `w2[e]`
its down projection ([E, H, I]); `out[t] = sum_j weights[t, j] * w2[e_j] @ (silu(g) * u)` over
the k experts `e_j = ids[t, j]` token t was routed to. `expert_start` is the global id of
`w13[0]`: with expert parallelism a shard holds experts [start, start + E) and skips the routes
that land elsewhere (their shard adds them in the all-reduce).

Both implementations do work only for the experts some token chose, so a step's cost grows with
the experts a batch uses, not with how many the model has:
- `fused_moe` (the twin; CPU): tokens sorted by expert, then one [n_e, H] x [H, 2I] and one
  [n_e, I] x [I, H] matmul per *active* expert (index_select in, index_add out);
- the Triton launch (GPU; triton_ops.fused_moe, which imports this module): vLLM's fused_moe scheme. `align_block_size` lays the sorted
  (token, slot) pairs out in BLOCK_M-row tiles that each belong to one expert (padded with a
  sentinel), entirely on the device (no host sync, a fixed grid); one grouped-GEMM launch
  computes every tile's gate/up rows, a second the down projection scaled by the routing
  weight. Tiles past the used ones have expert -1 and return at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["align_block_size", "expert_groups", "fused_moe", "route", "single_token_routes"]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, then the top k (Mixtral, Qwen3-MoE, OLMoE alike);
    `renormalize` divides the k weights by their sum (Mixtral always, the others by
    `norm_topk_prob`). -> (weights [T, k] fp32, expert ids [T, k] int64)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_groups(ids: torch.Tensor, num_local: int, expert_start: int = 0):
    """The (local expert, flat slot indices, token indices) of every expert that has routes,
    in expert order. A flat slot is `t * k + j`; the token is `slot // k`. One sort of the T*k
    routes and a run-length count, so the host work is O(active experts), not O(E)."""
    k = ids.shape[1]
    flat = ids.reshape(-1) - expert_start
    key = torch.where((flat >= 0) & (flat < num_local), flat, torch.full_like(flat, num_local))
    skey, order = torch.sort(key, stable=True)  # stable: tokens stay in order within an expert
    experts, counts = torch.unique_consecutive(skey, return_counts=True)
    out = []
    for e, slots in zip(experts.tolist(), order.split(counts.tolist())):
        if e < num_local:  # the last run may be the other shards' routes
            out.append((e, slots, slots // k))
    return out


def single_token_routes(ids: torch.Tensor, weights: torch.Tensor, num_local: int,
                        expert_start: int = 0) -> list[tuple[int, float]]:
    """(local expert, weight) of a one-token batch's routes, in expert order (as the grouped
    path adds them). Batch-1 decode on CPU: host lists instead of a sort, an index_select and
    an index_add per expert, which cost more than the expert's matmuls at this size."""
    pairs = sorted(zip(ids[0].tolist(), weights[0].tolist()))
    return [(e - expert_start, w) for e, w in pairs if 0 <= e - expert_start < num_local]


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """The torch twin (and the CPU path): one gate/up and one down matmul per active expert."""
    if x.shape[0] == 1 and x.device.type == "cpu":
        out = torch.zeros_like(x)
        for e, w in single_token_routes(ids, weights, w13.shape[0], expert_start):
            gate, up = F.linear(x, w13[e]).chunk(2, dim=-1)
            out += F.linear(F.silu(gate) * up, w2[e]) * w
        return out
    out = torch.zeros_like(x)
    flat_w = weights.reshape(-1)
    for e, slots, tok in expert_groups(ids, w13.shape[0], expert_start):
        h = F.linear(x.index_select(0, tok), w13[e])
        gate, up = h.chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tok, y * flat_w[slots].unsqueeze(1).to(y.dtype))
    return out


def align_block_size(ids: torch.Tensor, num_local: int, block_m: int, expert_start: int = 0):
    """Device-side layout of the routes for the grouped GEMM.

    -> (sorted_slots [EM] int32: flat slots grouped by expert, each expert's run padded to a
    multiple of block_m with the sentinel T*k; tile_expert [EM / block_m] int32: the local expert
    of each tile, -1 for unused tiles). EM = T*k + num_local*(block_m-1) rounded up to a tile:
    the most any routing can need, so the grid never depends on the data."""
    n = ids.numel()
    dev = ids.device
    flat = ids.reshape(-1) - expert_start
    key = torch.where((flat >= 0) & (flat < num_local), flat, torch.full_like(flat, num_local))
    order = torch.argsort(key, stable=True)
    skey = key[order]
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    first = torch.cumsum(counts, 0) - counts  # each expert's first index in `order`
    em = -(-(n + num_local * (block_m - 1)) // block_m) * block_m
    sorted_slots = torch.full((em,), n, dtype=torch.int32, device=dev)
    local = skey < num_local
    e = skey[local]
    pos = torch.arange(n, device=dev)[local]
    sorted_slots[pad_start[e] + pos - first[e]] = order[local].to(torch.int32)
    tile_starts = torch.arange(0, em, block_m, device=dev)
    tile_expert = torch.searchsorted(pad_end, tile_starts, right=True)
    tile_expert = torch.where(tile_expert < num_local, tile_expert, torch.full_like(tile_expert, -1))
    return sorted_slots, tile_expert.to(torch.int32)
