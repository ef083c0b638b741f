"""Shared helpers for kernel tests: random paged batches and naive per-request references."""

from __future__ import annotations

import math

import torch

from zeroserve.kernels.metadata import AttentionMetadata


def make_cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def make_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
    extra_blocks: int = 3,
):
    """Random cache with shuffled physical blocks; returns q, k_cache, v_cache, meta.

    The cache holds every token of every request (as if write_kv already ran)."""
    g = torch.Generator().manual_seed(seed)
    nreq = len(seq_lens)
    blocks_per = [max(1, math.ceil(s / block_size)) for s in seq_lens]
    nb = sum(blocks_per) + extra_blocks
    perm = torch.randperm(nb, generator=g).tolist()
    max_blocks = max(blocks_per) + 1
    bt = torch.full((nreq, max_blocks), -1, dtype=torch.int32)
    p = 0
    for b, n in enumerate(blocks_per):
        bt[b, :n] = torch.tensor(perm[p:p + n], dtype=torch.int32)
        p += n
    k_cache = torch.randn(nb, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(nb, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    t = sum(q_lens)
    q = torch.randn(t, num_q_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(nreq + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    slots = []
    for b in range(nreq):
        for pos in range(seq_lens[b] - q_lens[b], seq_lens[b]):
            slots.append(int(bt[b, pos // block_size]) * block_size + pos % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=bt,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        max_query_len=max(q_lens) if q_lens else 0,
        max_seq_len=max(seq_lens) if seq_lens else 0,
    )
    mv = lambda x: x.to(device)
    meta = AttentionMetadata(mv(meta.slot_mapping), mv(meta.block_tables), mv(meta.seq_lens),
                             mv(meta.query_start_loc), meta.max_query_len, meta.max_seq_len)
    return mv(q), mv(k_cache), mv(v_cache), meta


def naive_paged_attention(q, k_cache, v_cache, meta, scale):
    """Per-request, per-head loop in fp64: the slow but obvious reference."""
    t, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    grp = hq // hk
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    qsl = meta.query_start_loc.tolist()
    for b in range(len(qsl) - 1):
        s = int(meta.seq_lens[b])
        ql = qsl[b + 1] - qsl[b]
        if ql == 0:
            continue
        pos = torch.arange(s)
        blocks = meta.block_tables[b].long()[pos // bs]
        kk = k_cache[blocks, pos % bs].double()  # [s, Hk, D]
        vv = v_cache[blocks, pos % bs].double()
        for i in range(ql):
            qp = s - ql + i
            row = qsl[b] + i
            for h in range(hq):
                sc = (kk[: qp + 1, h // grp] @ q[row, h].double()) * scale
                p = torch.softmax(sc, 0)
                out[row, h] = p @ vv[: qp + 1, h // grp]
    return out
