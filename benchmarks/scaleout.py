"""Scale-out: cluster throughput with 1 and with 2 worker groups, same seeded workload.

    python benchmarks/scaleout.py                  # ~32M-param model, 48 requests: ~2 min on 2 loaded cores
    python benchmarks/scaleout.py --size default   # ~4M params: overhead-bound, ~40 s
    python benchmarks/scaleout.py --json           # also one BENCH_JSON {...} line
    python benchmarks/scaleout.py --num-requests 96 --max-output 128   # longer, steadier

What it does: starts a real local cluster (tests/cluster.py LocalCluster: scheduler, detokenizer
and tp=1 worker groups as separate processes on loopback, --threads per worker), with prefix
caching off (the same prompts run twice, the second run must not profit from the first). Phase 1:
one group ("g0"); the workload (benchmarks.common.make_workload: seeded token-id prompts, greedy,
ignore_eos, max_tokens per request) is submitted all at once through one AsyncClient and the
wall time until the last request finished is measured. Phase 2: a second group ("g1") joins the
same cluster and the same workload runs again. Each phase starts with a small warm-up wave that
reaches every group. Throughput = generated tokens / wall seconds; the ratio is 2 groups / 1 group.

Correctness: both phases must return exactly the same tokens for every request (greedy), and
every request its max_tokens tokens.

Caveat printed with the figures: one machine runs the scheduler, the detokenizer, the client and
every worker. With fewer cores than busy processes (2 cores here) a second group competes with
the first for the same CPUs, so the ratio measures CPU contention and the scheduler's overhead,
not how the cluster scales across machines. The "cluster cpu s" column (user+sys of all cluster
processes) shows the work done; "tok/cluster-cpu-s" is the steadier figure on a shared box.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import (
    Timer,
    Workload,
    bench_model_dir,
    contention_warning,
    environment,
    json_line,
    log,
    make_workload,
    model_summary,
    print_table,
    token_id_limit,
)

DEFAULTS = {"num_requests": 48, "seed": 0, "min_prompt": 16, "max_prompt": 128, "min_output": 16, "max_output": 64}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=DEFAULTS["num_requests"])
    ap.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    ap.add_argument("--min-prompt", type=int, default=DEFAULTS["min_prompt"])
    ap.add_argument("--max-prompt", type=int, default=DEFAULTS["max_prompt"])
    ap.add_argument("--min-output", type=int, default=DEFAULTS["min_output"])
    ap.add_argument("--max-output", type=int, default=DEFAULTS["max_output"])
    ap.add_argument("--size", default="bench", choices=["tiny", "default", "bench"],
                    help="random-weight model size (zeroserve.services.tiny_model SIZES; bench = ~32M params, default = ~4M)")
    ap.add_argument("--model-dir", default=None, help="an HF model directory instead of the generated one")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--num-kv-blocks", type=int, default=512, help="KV blocks per worker")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--json", action="store_true", help="also print one BENCH_JSON {...} line")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------- running

def cluster_cpu_s(cluster) -> float:
    """user+sys seconds of every live cluster process so far."""
    import psutil

    total = 0.0
    for ch in cluster.children.values():
        if ch.proc is None or ch.proc.poll() is not None:
            continue
        try:
            t = psutil.Process(ch.proc.pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


async def _run_all(address: str, prompts: list[list[int]], params: list, timeout_s: float = 120.0) -> list:
    from zeroserve import AsyncClient

    async with AsyncClient(address, timeout_s=timeout_s) as c:
        return await asyncio.gather(*(c.generate(p, sp) for p, sp in zip(prompts, params)))


def run_phase(cluster, wl: Workload, groups: int) -> dict:
    """Warm up every group, then time the whole workload once."""
    from zeroserve import SamplingParams

    warm = [[5 + i, 6, 7, 8, 9 + i] for i in range(4 * groups)]
    asyncio.run(_run_all(cluster.address, warm, [SamplingParams(max_tokens=4, temperature=0.0,
                                                                ignore_eos=True)] * len(warm)))
    before = {g["name"]: g["tokens"] for g in cluster.stats()["groups"]}
    cpu0 = cluster_cpu_s(cluster)
    with Timer() as t:
        outs = asyncio.run(_run_all(cluster.address, wl.prompts, wl.sampling_params()))
    cpu = cluster_cpu_s(cluster) - cpu0
    stats = cluster.stats()
    per_group = {g["name"]: g["tokens"] - before.get(g["name"], 0) for g in stats["groups"]}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    generated = sum(len(x) for x in tokens)
    return {"groups": groups, "wall": t.wall, "client_cpu": t.cpu, "cluster_cpu": cpu, "generated": generated,
            "tok_s": generated / t.wall, "tok_cluster_cpu_s": generated / max(cpu, 1e-9),
            "computed_per_group": per_group, "tokens": tokens}


def main(argv=None) -> int:
    args = parse_args(argv)
    from tests.cluster import LocalCluster

    with Timer() as t_total:
        env = environment()
        warn = contention_warning(env)
        if warn:
            log(warn)
        model_dir = Path(args.model_dir) if args.model_dir else bench_model_dir(size=args.size)
        summary = model_summary(model_dir)
        wl = make_workload(args.num_requests, args.seed, args.min_prompt, args.max_prompt, args.min_output,
                           args.max_output, vocab_size=token_id_limit(model_dir))
        log(f"model {model_dir} ({summary['params'] / 1e6:.1f}M params); workload: {wl.describe()}")

        cluster = LocalCluster(model_dir, workers=1, num_kv_blocks=args.num_kv_blocks, threads=args.threads,
                               scheduler_args=["--no-prefix-caching"])
        phases = []
        try:
            log("starting the cluster (scheduler, detokenizer, group g0) ...")
            with Timer() as t_up:
                cluster.start()
                cluster.wait_ready(groups=1, timeout=args.ready_timeout)
            log(f"  ready in {t_up.wall:.1f}s; running the workload on 1 group ...")
            phases.append(run_phase(cluster, wl, 1))
            log(f"  1 group: {phases[-1]['wall']:.1f}s, {phases[-1]['tok_s']:.1f} tok/s; starting group g1 ...")
            with Timer() as t_join:
                cluster.start_group("g1")
                cluster.wait_ready(groups=2, timeout=args.ready_timeout)
            log(f"  g1 ready in {t_join.wall:.1f}s; running the workload on 2 groups ...")
            phases.append(run_phase(cluster, wl, 2))
            log(f"  2 groups: {phases[-1]['wall']:.1f}s, {phases[-1]['tok_s']:.1f} tok/s")
        except BaseException:
            log(cluster.logs())
            raise
        finally:
            cluster.stop()

    one, two = phases
    ratio = two["tok_s"] / one["tok_s"]
    cpu_ratio = two["tok_cluster_cpu_s"] / one["tok_cluster_cpu_s"]
    wrong_len = [i for i, n in enumerate(wl.output_lens) if len(one["tokens"][i]) != n or len(two["tokens"][i]) != n]
    differ = [i for i in range(len(wl)) if one["tokens"][i] != two["tokens"][i]]
    cores = os.cpu_count() or 1
    busy = 3 + 2 * args.threads  # scheduler, detokenizer, client + the workers' threads

    print(f"zeroserve scale-out benchmark: {wl.describe()}")
    print(f"model: {summary['arch']} {summary['params'] / 1e6:.1f}M params (hidden {summary['hidden']}, "
          f"{summary['layers']} layers, vocab {summary['vocab']}), fp32 CPU, {args.threads} torch thread(s) per "
          f"worker, prefix caching off; {cores} cores, load avg before run {env.get('loadavg_1m', '?')}")
    rows = [{"groups": p["groups"], "wall s": p["wall"], "tok/s": p["tok_s"], "cluster cpu s": p["cluster_cpu"],
             "tok/cluster-cpu-s": p["tok_cluster_cpu_s"],
             "computed tokens per group": " ".join(f"{k}={v}" for k, v in sorted(p["computed_per_group"].items()))}
            for p in phases]
    print_table(rows)
    print(f"ratio (2 groups / 1 group): {ratio:.2f}x tokens/s (per cluster-CPU-second: {cpu_ratio:.2f}x)")
    if cores < busy:
        print(f"CAVEAT: {cores} CPU cores for >= {busy} busy threads (scheduler, detokenizer, client, 2 workers) "
              "plus whatever else runs on this machine: the second group competes with the first for the same "
              "cores, so this ratio reflects CPU contention and per-request overhead, not scaling. Run the groups "
              "on separate machines (or >= one free core per process) to measure scale-out.")
    else:
        print("note: all groups share one machine; the ratio is an upper bound on contention-free scaling only "
              "if the cores were otherwise idle")
    print(f"correctness: {len(wl) - len(differ)}/{len(wl)} requests identical in both phases; "
          f"{len(wrong_len)} with the wrong length; total benchmark runtime {t_total.wall:.1f}s")
    if args.json:
        json_line({
            "benchmark": "scaleout", "num_requests": len(wl), "seed": args.seed, "spec": wl.spec,
            "model": str(model_dir), "model_params": summary["params"], "threads_per_worker": args.threads,
            "prompt_tokens": wl.total_prompt_tokens, "output_tokens": wl.total_output_tokens,
            "cpu_count": cores, "loadavg_1m": env.get("loadavg_1m"),
            "phases": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in p.items() if k != "tokens"}
                       for p in phases],
            "tok_s_1": round(one["tok_s"], 2), "tok_s_2": round(two["tok_s"], 2), "ratio": round(ratio, 3),
            "cpu_ratio": round(cpu_ratio, 3), "contention_limited": cores < busy,
            "identical": len(differ) == 0, "wrong_length": len(wrong_len), "total_s": round(t_total.wall, 1),
        })
    return 0 if not differ and not wrong_len else 1


if __name__ == "__main__":
    sys.exit(main())
