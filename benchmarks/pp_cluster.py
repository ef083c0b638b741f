"""Pipeline parallelism through the real cluster: pp=2 with one and with two steps in flight, against pp=1.

    python benchmarks/pp_cluster.py                         # 32 requests x (64 prompt + 64 output), 2 rounds
    python benchmarks/pp_cluster.py --rounds 3 --json       # also one BENCH_JSON {...} line

What it does: for each configuration a fresh local cluster (tests/cluster.py LocalCluster:
scheduler, detokenizer and the workers as separate processes on loopback), a warm-up wave, then
the seeded greedy workload (benchmarks.common.make_workload, ignore_eos) submitted at once
through one AsyncClient; the wall time until the last request finished gives output tokens/s.

- `pp1`: one worker process holding the whole model, `--threads-pp1` torch threads (default 2);
- `pp2-one`: two stage processes (layers split in half), `--threads` each (default 1), the
  scheduler sending one step at a time (`--pp-steps-in-flight 1`, how pp ran before);
- `pp2-two`: the same two stages with two steps in flight, each over its own requests (the default
  for a group of two stages): stage 0 computes step n+1 while stage 1 computes step n.

The configurations alternate (pp1, pp2-one, pp2-two, pp1, ...) for `--rounds` rounds, so a
change in the machine's load hits all of them. On a 2-core machine pp1 with 2 threads against two
stages with 1 thread each is the fair comparison: the same cores, the same threads in all. Also
reported: each worker's resident memory after the run (RSS, psutil), each worker's CPU seconds
per wall second during the run (two stages above 0.5 each at once: they overlap) and, for the
stages, the share of the run they spent blocked receiving from the other stage (`pp_wait_s` in
their heartbeats), the cluster's
CPU seconds (scheduler, detokenizer and workers),
the most steps the group had in flight, and the load average before each run. Every run's tokens
must equal pp1's (exit status 1 otherwise). OpenMP threads wait passively by default
(`--omp-wait-policy`): spinning ones slow the 2-thread pp1 worker several-fold on shared cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import (  # noqa: E402
    apply_omp_wait_policy,
    bench_model_dir,
    environment,
    json_line,
    loadavg,
    log,
    make_workload,
    print_table,
    token_id_limit,
)

CONFIGS = ("pp1", "pp2-one", "pp2-two")


async def _run_all(address: str, prompts, params, timeout_s: float = 600.0) -> list:
    from zeroserve import AsyncClient

    async with AsyncClient(address, timeout_s=timeout_s) as c:
        return await asyncio.gather(*(c.generate(p, sp) for p, sp in zip(prompts, params)))


def _proc_stats(cluster) -> dict[str, tuple[float, float]]:
    """name -> (user+sys CPU seconds, RSS MiB) of each live process of the cluster."""
    import psutil

    out = {}
    for name, ch in cluster.children.items():
        if ch.proc is None or ch.proc.poll() is not None:
            continue
        try:
            p = psutil.Process(ch.proc.pid)
            t = p.cpu_times()
            out[name] = (t.user + t.system, p.memory_info().rss / 2**20)
        except psutil.Error:
            pass
    return out


def run_config(name: str, model_dir: Path, wl, a) -> dict:
    from tests.cluster import LocalCluster
    from zeroserve import SamplingParams

    pp = 1 if name == "pp1" else 2
    sched = ["--no-prefix-caching"] + (["--pp-steps-in-flight", "1"] if name == "pp2-one" else [])
    cluster = LocalCluster(model_dir, workers=1, pp=pp, num_kv_blocks=a.num_kv_blocks,
                           threads=a.threads_pp1 if pp == 1 else a.threads, scheduler_args=sched)
    try:
        cluster.start()
        cluster.wait_ready(groups=1, timeout=300)
        warm = [[5 + i, 6, 7, 8, 9 + i] for i in range(4)]
        asyncio.run(_run_all(cluster.address, warm, [SamplingParams(max_tokens=4, temperature=0.0,
                                                                    ignore_eos=True)] * len(warm)))
        load = loadavg()
        wait0 = _waits(cluster)
        before = _proc_stats(cluster)
        t0 = time.perf_counter()
        outs = asyncio.run(_run_all(cluster.address, wl.prompts, wl.sampling_params()))
        wall = time.perf_counter() - t0
        after = _proc_stats(cluster)
        waits = {k: (v - wait0.get(k, 0.0)) / wall for k, v in _waits(cluster).items()}
        g = next(x for x in cluster.stats()["groups"] if x["name"] == "g0")
    except BaseException:
        log(cluster.logs())
        raise
    finally:
        cluster.stop()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(len(t) for t in tokens)
    cpu = {k: after[k][0] - before[k][0] for k in after if k in before}
    workers = sorted(k for k in after if cluster.children[k].role == "worker")
    return {"config": name, "wall_s": wall, "tok_s": n / wall, "cluster_cpu_s": sum(cpu.values()), "load_1m": load,
            "peak_in_flight": g.get("peak_steps_in_flight"), "rss_mib": {k: after[k][1] for k in workers},
            "cpu_share": {k: cpu[k] / wall for k in workers}, "wait_share": waits, "tokens": tokens}


def _waits(cluster) -> dict[str, float]:
    """Each stage's seconds blocked receiving from its peers so far (its heartbeats' pp_wait_s;
    they come once a second: wait for a fresh one)."""
    time.sleep(1.5)
    g = next(x for x in cluster.stats()["groups"] if x["name"] == "g0")
    return {w["worker_id"]: w["w_pp_wait_s"] for w in g["workers"] if "w_pp_wait_s" in w}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=64, help="output tokens per request")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per pp=2 stage")
    ap.add_argument("--threads-pp1", type=int, default=2, help="torch threads of the pp=1 worker")
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=0, help="a wider bench model (hidden size; 0: the bench "
                                                          "model's 512): more compute per step, less overhead")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"a comma list of {CONFIGS}")
    ap.add_argument("--omp-wait-policy", default="passive", choices=("auto", "passive", "active", "env"),
                    help="OMP_WAIT_POLICY for the workers (benchmarks.common.apply_omp_wait_policy): spinning "
                         "OpenMP threads slow pp1's 2 threads several-fold on a shared 2-core machine")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    omp = apply_omp_wait_policy(a.omp_wait_policy)  # the workers inherit the environment
    model = bench_model_dir() if not a.hidden else bench_model_dir(
        hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4, num_attention_heads=a.hidden // 64)
    wl = make_workload(a.requests, seed=0, min_prompt=a.prompt, max_prompt=a.prompt, min_output=a.output,
                       max_output=a.output, vocab_size=token_id_limit(model))
    env = environment()
    log(f"workload: {wl.describe()}; {os.cpu_count()} cores, load {env.get('loadavg_1m')}, OMP_WAIT_POLICY {omp}")
    runs = []
    for r in range(a.rounds):
        for name in a.configs.split(","):
            runs.append(run_config(name, model, wl, a) | {"round": r})
            x = runs[-1]
            log(f"round {r} {name}: {x['tok_s']:.1f} tok/s ({x['wall_s']:.1f}s, load {x['load_1m']})")
    ref = next((x["tokens"] for x in runs if x["config"] == "pp1"), runs[0]["tokens"])
    same = all(x["tokens"] == ref for x in runs)
    rows = [{"round": x["round"], "config": x["config"], "tok/s": round(x["tok_s"], 1), "wall_s": round(x["wall_s"], 2),
             "cluster_cpu_s": round(x["cluster_cpu_s"], 1), "peak_in_flight": x["peak_in_flight"],
             "load_1m": x["load_1m"], "worker RSS MiB": " ".join(f"{k}={v:.0f}" for k, v in sorted(x["rss_mib"].items())),
             "worker CPU s / wall s": " ".join(f"{v:.2f}" for _, v in sorted(x["cpu_share"].items())),
             "stage wait s / wall s": " ".join(f"{v:.2f}" for _, v in sorted(x["wait_share"].items()))}
            for x in runs]
    print_table(rows)
    print(f"tokens equal pp1's in every run: {same}")
    if a.json:
        json_line({"benchmark": "pp_cluster", "args": vars(a), "env": env, "omp_wait_policy": omp, "tokens_equal": same,
                   "runs": [{k: v for k, v in x.items() if k != "tokens"} for x in runs]})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
