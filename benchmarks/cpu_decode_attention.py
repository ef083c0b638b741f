"""CPU decode attention: the compiled kernel (kernels/csrc/paged_decode.c) vs its torch twin.

One decode step's attention for one layer of the throughput benchmark's model shape (8 query /
4 kv heads, head_dim 64, block size 16), over a batch of requests with ragged context lengths
scattered across a shuffled paged cache. Both run in this process, interleaved, on the same
inputs; the script prints ms per call, the ratio, the bytes of K/V read and the bandwidth that
implies, and checks the two outputs agree.

    .venv/bin/python benchmarks/cpu_decode_attention.py [--batch 64] [--min-len 16] [--max-len 768]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import apply_omp_wait_policy, print_table, set_threads  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    apply_omp_wait_policy("passive")
    threads = set_threads(args.threads)

    import torch

    from zeroserve.kernels.metadata import AttentionMetadata
    from zeroserve.kernels import cpu_native, torch_ops

    if not cpu_native.available():
        print(f"compiled CPU kernels unavailable: {cpu_native.unavailable_reason()}")
        return 1
    g = torch.Generator().manual_seed(args.seed)
    b, hq, hk, d, bs = args.batch, args.q_heads, args.kv_heads, args.head_dim, args.block_size
    seq = torch.randint(args.min_len, args.max_len + 1, (b,), generator=g, dtype=torch.int32)
    nblk = (seq + bs - 1) // bs
    width = int(nblk.max())
    total_blocks = int(nblk.sum()) + 8
    perm = torch.randperm(total_blocks, generator=g).to(torch.int32)
    bt = torch.full((b, width), -1, dtype=torch.int32)
    p = 0
    for i, n in enumerate(nblk.tolist()):
        bt[i, :n] = perm[p:p + n]
        p += n
    kc = torch.randn(total_blocks, bs, hk, d, generator=g)
    vc = torch.randn(total_blocks, bs, hk, d, generator=g)
    q = torch.randn(b, hq, d, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.zeros(b, dtype=torch.int64), block_tables=bt, seq_lens=seq,
                             query_start_loc=torch.arange(b + 1, dtype=torch.int32), max_query_len=1,
                             max_seq_len=int(seq.max()))
    scale = d ** -0.5
    runs = {
        "torch twin (gather + SDPA)": lambda: torch_ops.paged_attention(q, kc, vc, meta, scale),
        "compiled kernel (in place)": lambda: cpu_native.paged_decode(q, kc, vc, bt, seq, scale),
    }
    with torch.inference_mode():
        outs = {name: f() for name, f in runs.items()}
        times = {name: [] for name in runs}
        for _ in range(args.iters):  # interleaved, so both see the same machine
            for name, f in runs.items():
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
    diff = (outs["torch twin (gather + SDPA)"] - outs["compiled kernel (in place)"]).abs().max().item()
    kv_bytes = 2 * int(seq.sum()) * hk * d * 4
    rows = []
    for name, ts in times.items():
        med = sorted(ts)[len(ts) // 2]
        rows.append({"attention": name, "ms/call (median)": med * 1e3, "K/V GB/s": kv_bytes / med / 1e9})
    print(f"decode attention: {b} requests, context {args.min_len}-{args.max_len} (total {int(seq.sum())} tokens), "
          f"{hq}q/{hk}kv heads, head_dim {d}, block {bs}, fp32, torch threads {threads}; "
          f"K/V read per call {kv_bytes / 1e6:.1f} MB")
    print_table(rows)
    r = rows[0]["ms/call (median)"] / rows[1]["ms/call (median)"]
    print(f"ratio (twin / compiled): {r:.2f}x; max |difference| {diff:.2e}")
    return 0 if diff < 1e-4 else 2


if __name__ == "__main__":
    sys.exit(main())
