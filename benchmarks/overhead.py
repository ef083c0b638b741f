"""What the cluster costs over the in-process engine, measured side by side in one run.

The same seeded workload runs (1) through `zeroserve.LLM` in this process and (2) through a
local cluster started the way `zeroserve up` starts one (client -> scheduler -> worker ->
detokenizer -> client, all real processes and sockets), with the same torch thread count for
the model. Prints both throughputs, their ratio, and the per-step time the scheduler and
messaging add (cluster wall time not spent computing steps in the worker, per step).

The cluster run starts cold: the workload goes out as soon as `up` reports ready, as a user's
first requests do, so whatever the processes still do at start (loading tokenizers) counts.
--warm-up first sends one text request and waits for it (the scheduler's tokenizer loaded).

    .venv/bin/python benchmarks/overhead.py            # defaults fit ~2-3 minutes on 2 cores
    .venv/bin/python benchmarks/overhead.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (Timer, bench_model_dir, environment, json_line, log, make_workload,  # noqa: E402
                               set_threads, token_id_limit)


def run_in_process(model_dir: Path, wl, args) -> dict:
    from zeroserve import LLM, SamplingParams

    llm = LLM(str(model_dir), num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    with Timer() as t:
        outs = llm.generate(wl.prompts, wl.sampling_params())
    steps = llm.engine.runner.num_steps - 1
    return {"wall": t.wall, "steps": steps, "tokens": [list(o.outputs[0].token_ids) for o in outs]}


async def _submit_all(address: str, wl) -> list[list[int]]:
    from zeroserve import AsyncClient

    async with AsyncClient(address, timeout_s=60.0) as c:
        outs = await asyncio.gather(*(c.generate(p, sp) for p, sp in zip(wl.prompts, wl.sampling_params())))
    return [list(o.outputs[0].token_ids) for o in outs]


def _worker_stats(stats: dict) -> tuple[int, float]:
    steps, busy = 0, 0.0
    for g in stats["groups"]:
        for w in g["workers"]:
            if w["rank"] == 0:
                steps += w.get("w_steps", 0)
                busy += w.get("w_busy_s", 0.0)
    return steps, busy


def run_cluster(model_dir: Path, wl, args, threads: int) -> dict:
    from benchmarks.common import ensure_repo_on_path
    from zeroserve.services.cli import build_parser
    from zeroserve.services.launcher import plan_children, stop_children, wait_ready
    from zeroserve.common.transport import free_port_block
    from zeroserve import Client, SamplingParams

    ensure_repo_on_path()
    port = free_port_block(4)
    up = build_parser().parse_args([
        "up", "--model", str(model_dir), "--port", str(port), "--workers", "1", "--threads", str(threads),
        "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-batched-tokens", str(args.max_num_batched_tokens)])
    children = plan_children(up, str(model_dir))
    address = f"tcp://127.0.0.1:{port}"
    try:
        for c in children:
            c.start()
        wait_ready(address, 1, children, timeout_s=300)
        with Client(address) as c:
            if args.warm_up:  # a text prompt waits for the scheduler's tokenizer
                c.generate("warm up", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            steps0, busy0 = _worker_stats(c.stats())
        with Timer() as t:
            tokens = asyncio.run(_submit_all(address, wl))
        time.sleep(1.5)  # one heartbeat carries the worker's final counters
        with Client(address) as c:
            steps1, busy1 = _worker_stats(c.stats())
        return {"wall": t.wall, "steps": steps1 - steps0, "busy": busy1 - busy0, "tokens": tokens}
    finally:
        stop_children(children)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--size", default="bench", help="tiny-model size (bench = ~30M params)")
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0, help="torch threads for the model (0 = all cores)")
    ap.add_argument("--warm-up", action="store_true", help="one text request through the cluster before the "
                                                           "timed run (default: cold, right after ready)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    threads = set_threads(args.threads or None)
    model_dir = bench_model_dir(size=args.size)
    wl = make_workload(args.num_requests, args.seed, max_prompt=args.max_prompt, min_output=16,
                       max_output=args.max_output, vocab_size=token_id_limit(model_dir))
    log(f"workload: {wl.describe()}; model {model_dir.name}; {threads} torch thread(s)")
    log("in-process LLM ...")
    ours = run_in_process(model_dir, wl, args)
    log("cluster (scheduler + detokenizer + 1 worker, real processes) ...")
    clu = run_cluster(model_dir, wl, args, threads)
    n = wl.total_output_tokens
    tput_llm, tput_clu = n / ours["wall"], n / clu["wall"]
    same = sum(a == b for a, b in zip(ours["tokens"], clu["tokens"]))
    overhead_ms = 1000 * (clu["wall"] - clu["busy"]) / max(clu["steps"], 1)
    rec = {
        "benchmark": "overhead", "requests": len(wl), "output_tokens": n, "threads": threads,
        "in_process_tok_s": round(tput_llm, 1), "cluster_tok_s": round(tput_clu, 1),
        "ratio": round(tput_clu / tput_llm, 3), "in_process_steps": ours["steps"], "cluster_steps": clu["steps"],
        "in_process_ms_per_step": round(1000 * ours["wall"] / max(ours["steps"], 1), 2),
        "cluster_ms_per_step": round(1000 * clu["wall"] / max(clu["steps"], 1), 2),
        "worker_compute_ms_per_step": round(1000 * clu["busy"] / max(clu["steps"], 1), 2),
        "scheduler_and_messaging_ms_per_step": round(overhead_ms, 2),
        "identical_outputs": f"{same}/{len(wl)}", "cluster_start": "warm" if args.warm_up else "cold",
        **environment(),
    }
    if args.json:
        json_line(rec)
    else:
        print(f"in-process LLM : {tput_llm:8.1f} tok/s  ({ours['wall']:.1f}s, {ours['steps']} steps, "
              f"{rec['in_process_ms_per_step']} ms/step)")
        print(f"cluster        : {tput_clu:8.1f} tok/s  ({clu['wall']:.1f}s, {clu['steps']} steps, "
              f"{rec['cluster_ms_per_step']} ms/step, of which worker compute {rec['worker_compute_ms_per_step']} ms)")
        print(f"ratio cluster / in-process: {rec['ratio']:.3f}")
        print(f"scheduler + messaging per step: {overhead_ms:.2f} ms")
        print(f"identical greedy outputs: {same}/{len(wl)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
