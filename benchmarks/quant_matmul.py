"""Quantized CPU matmul (kernels/csrc/qmatmul.c via kernels/quant.py) vs fp32 torch linear.

SmolLM2-135M's linear shapes (hidden 576, intermediate 1536, vocab 49152), T = 1 (decode) and
T = 32 (batched decode / prefill chunk): fp32 ``F.linear`` against each packed format, all run
interleaved in one process on the same x. Prints ms per call (median), the weight bytes read
per call and the bandwidth that implies, next to the machine's measured memory bandwidth (the
roofline for T = 1), plus a whole decode step's linears (30 layers + lm_head) per format.

Each weight is replicated until its copies exceed --working-set-mb and calls cycle through
them, so T = 1 measures weights streamed from DRAM rather than from the L3 cache (--working-set-mb
0: one copy, cache-hot).

    .venv/bin/python benchmarks/quant_matmul.py [--iters 15] [--threads 0] [--working-set-mb 128]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import (  # noqa: E402
    apply_omp_wait_policy, json_line, memory_bandwidth, print_table, set_threads)

SHAPES = {  # name -> (N_out, K_in, uses per decode step of SmolLM2-135M: 30 layers)
    "q/o 576x576": (576, 576, 60),
    "k/v 192x576": (192, 576, 60),
    "gate/up 1536x576": (1536, 576, 60),
    "down 576x1536": (576, 1536, 30),
    "lm_head 49152x576": (49152, 576, 1),
}
FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "int8", "int4")


def make_weights(torch, quant, fmt: str, n: int, k: int, copies: int, seed: int):
    """`copies` independent random weights in `fmt` (GGUF formats: random valid blocks)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(copies):
        if fmt == "fp32":
            out.append(torch.randn(n, k, generator=g) * 0.05)
        elif fmt in ("int8", "int4"):
            w = torch.randn(n, k, generator=g) * 0.05
            out.append(quant.quantize_int8(w, 128) if fmt == "int8" else quant.quantize_int4(w, 32))
        else:
            _, block, nbytes = quant._FORMATS[fmt]
            raw = torch.randint(0, 256, (n * k // block, nbytes), generator=g, dtype=torch.uint8)
            hdr = (torch.rand(raw.shape[0], 2, generator=g) * 0.02 + 1e-3).half()
            raw[:, 0:4] = hdr.view(torch.uint8)  # finite fp16 d (and m / dmin)
            code = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "q4_k": 12}[fmt]
            out.append(quant.QuantizedWeight.from_gguf(raw, code, (n, k)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--working-set-mb", type=int, default=128)
    ap.add_argument("--tokens", default="1,32", help="comma-separated T values")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    wait = apply_omp_wait_policy("auto")
    threads = set_threads(args.threads)

    import torch
    import torch.nn.functional as F

    from zeroserve.kernels import cpu_native, quant

    lib = cpu_native.quant_lib()
    if lib is None:
        print(f"compiled qmatmul unavailable: {cpu_native.quant_unavailable_reason()}")
        return 1
    formats = [f for f in args.formats.split(",") if f]
    rd, cp = memory_bandwidth()
    print(f"quantized matmul, SmolLM2-135M shapes; kernel ISA {lib.isa}, torch threads {threads}, "
          f"OMP_WAIT_POLICY {wait}, working set {args.working_set_mb} MB")
    print(f"memory bandwidth: read (sum of 512 MB) {rd:.1f} GB/s, copy (read + write) {cp:.1f} GB/s")
    results, step = [], {}
    worst = 0.0
    with torch.inference_mode():
        for t in (int(v) for v in args.tokens.split(",")):
            rows = []
            for si, (name, (n, k, uses)) in enumerate(SHAPES.items()):
                x = torch.randn(t, k, generator=torch.Generator().manual_seed(si))
                runs = {}
                for fmt in ["fp32", *formats]:
                    if fmt == "q4_k" and k % 256:
                        continue  # llama.cpp stores such tensors in another type
                    one = make_weights(torch, quant, fmt, n, k, 1, args.seed + si)[0]
                    nbytes = n * k * 4 if fmt == "fp32" else one.nbytes
                    copies = max(1, -(-args.working_set_mb * 2**20 // nbytes)) if args.working_set_mb else 1
                    ws = [one] + make_weights(torch, quant, fmt, n, k, copies - 1, args.seed + 100 + si)
                    runs[fmt] = (ws, nbytes)
                    if fmt != "fp32":  # correctness next to the timing
                        ref = F.linear(x, one.dequantize())
                        worst = max(worst, ((one.linear(x) - ref).abs().max() / ref.abs().max()).item())
                times = {fmt: [] for fmt in runs}
                calls = {fmt: 0 for fmt in runs}
                for _ in range(args.iters + 2):  # interleaved: every format sees the same machine
                    for fmt, (ws, _) in runs.items():
                        w = ws[calls[fmt] % len(ws)]
                        calls[fmt] += 1
                        f = (lambda: F.linear(x, w)) if fmt == "fp32" else (lambda: w.linear(x))
                        t0 = time.perf_counter()
                        f()
                        times[fmt].append(time.perf_counter() - t0)
                row = {"T": t, "shape": name}
                for fmt, ts in times.items():
                    med = sorted(ts[2:])[len(ts[2:]) // 2]
                    gbs = runs[fmt][1] / med / 1e9
                    row[fmt] = f"{med * 1e3:.3f} ({gbs:.1f})"
                    step[(t, fmt)] = step.get((t, fmt), 0.0) + med * uses
                    results.append({"T": t, "shape": name, "format": fmt, "ms": med * 1e3, "weight_gbs": gbs,
                                    "weight_mb": runs[fmt][1] / 1e6})
                rows.append(row)
            print(f"\nT = {t}: ms per call, median of {args.iters} (implied weight GB/s)")
            print_table(rows, ["shape", "fp32", *formats])
    print("\ndecode-step linears, ms per step (30 layers x q,k,v,o,gate,up,down + lm_head; no q4_k: "
          "SmolLM2's K=576 is not a multiple of 256)")
    srow = []
    for t in sorted({k[0] for k in step}):
        r = {"T": t}
        for fmt in ["fp32", *formats]:
            if fmt == "q4_k":
                continue
            r[fmt] = step[(t, fmt)] * 1e3
        r["tok/s fp32"] = t / step[(t, "fp32")]
        best = min((f for f in formats if f != "q4_k"), key=lambda f: step[(t, f)], default=None)
        if best:
            r["tok/s best"] = f"{t / step[(t, best)]:.0f} ({best})"
        srow.append(r)
    print_table(srow)
    print(f"max |kernel - twin| / max |twin| over all cases: {worst:.2e}")
    json_line({"bench": "quant_matmul", "isa": lib.isa, "threads": threads, "read_gbs": rd, "copy_gbs": cp,
               "working_set_mb": args.working_set_mb, "results": results})
    return 0 if worst < 1e-4 else 2


if __name__ == "__main__":
    sys.exit(main())
