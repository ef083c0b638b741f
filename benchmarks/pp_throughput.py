"""Pipeline parallelism on CPU: pp=2 across two processes (gloo) against pp=1 in one process.

Both run the same seeded greedy workload through the in-process engine (`LLMEngine`: the
scheduler's policy and a model runner; each pp=2 stage runs its own engine and gets the same
steps, as from the scheduler, services/worker/pipeline.py), with the same threads per process.
Reported per run: output tokens/s over the whole workload, and per process the steps it ran,
the seconds a stage spent blocked receiving from its peers (`recv_wait_s`), the memory that
loading the model and allocating the KV cache added to its resident set (RSS after - RSS
before, in the same process after torch is imported: the runtime's own ~300 MB is not the
model's), the weight bytes and the KV-cache bytes it holds. The runs' tokens must be equal.

    python benchmarks/pp_throughput.py --requests 16 --output 64 --threads 1 [--wire zmq|dist] [--json]

Stages run one after the other within a step (one step in flight: each stage's in-process
engine needs the step's tokens as its result), so the ideal here is pp=2 at pp=1's throughput
with half the memory per process; what pp=2 loses is the transfer of hidden states and of the
sampled tokens, and the wake-ups, per step. Several steps in flight (stage 0 computing step n+1
while stage 1 computes step n) run only in worker processes: benchmarks/pp_cluster.py measures
them through the cluster.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import (  # noqa: E402
    bench_model_dir,
    environment,
    make_workload,
    print_table,
    spawn_ranks,
    token_id_limit,
)


def _shard(rank: int, world: int, port: int, a: dict, q) -> None:
    """One process: pp=1 (world 1) or stage `rank` of a pp=2 group."""
    import psutil
    import torch

    torch.set_num_threads(a["threads"])
    from zeroserve.common.config import EngineArgs
    from zeroserve.services.engine import LLMEngine, stage_runner

    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
    rss0 = psutil.Process().memory_info().rss
    args = EngineArgs(model=a["model"], pp_size=world, num_kv_blocks=a["kv_blocks"], max_num_seqs=a["requests"])
    eng = LLMEngine(args, make_runner=stage_runner(0, 1, rank, a["wire"]))
    rss1 = psutil.Process().memory_info().rss
    wl = make_workload(a["requests"], seed=0, min_prompt=a["prompt"], max_prompt=a["prompt"], min_output=a["output"],
                       max_output=a["output"], vocab_size=a["vocab"])
    from zeroserve import SamplingParams

    warm = eng.add_request(wl.prompts[0][:8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    ids = [eng.add_request(p, sp) for p, sp in zip(wl.prompts, wl.sampling_params())]
    outs = {}
    t0 = time.perf_counter()
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = list(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    r = eng.runner
    q.put({"rank": rank, "wall_s": wall, "tokens": [outs[i] for i in ids], "warm": warm,
           "rss_added_mib": (max(rss1, psutil.Process().memory_info().rss) - rss0) / 2**20,
           "param_mib": r.param_bytes() / 2**20, "kv_mib": r.kv_bytes_per_block() * r.num_blocks / 2**20,
           "layers": f"{r.model.stage.layers.start}-{r.model.stage.layers.stop - 1}",
           "wait_s": r.link.wait_s if r.link is not None else 0.0, "steps": r.num_steps,
           "output_tokens": wl.total_output_tokens})
    if world > 1:
        torch.distributed.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=64, help="output tokens per request")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--kv-blocks", type=int, default=256)
    ap.add_argument("--wire", choices=("zmq", "dist"), default=None,
                    help="how the stages talk (services/worker/stage_wire.py; default: ZeroMQ on CPU)")
    ap.add_argument("--json", action="store_true")
    cli = ap.parse_args()
    model = bench_model_dir()
    a = {"model": str(model), "requests": cli.requests, "prompt": cli.prompt, "output": cli.output,
         "threads": cli.threads, "kv_blocks": cli.kv_blocks, "vocab": token_id_limit(model), "wire": cli.wire}
    results = {pp: spawn_ranks(_shard, pp, a) for pp in (1, 2)}
    same = results[1][0]["tokens"] == results[2][0]["tokens"] == results[2][1]["tokens"]
    rows = []
    for pp, shards in results.items():
        wall = max(s["wall_s"] for s in shards)
        for s in shards:
            rows.append({"pp": pp, "stage": s["rank"], "layers": s["layers"],
                         "tok/s": round(s["output_tokens"] / wall, 1), "wall_s": round(wall, 2),
                         "rss_added_MiB": round(s["rss_added_mib"], 1), "weights_MiB": round(s["param_mib"], 1),
                         "kv_MiB": round(s["kv_mib"], 1), "steps": s["steps"],
                         "recv_wait_s": round(s["wait_s"], 2)})
    if cli.json:
        print(json.dumps({"rows": rows, "tokens_equal": same, "args": a, "env": environment()}))
    else:
        print_table(rows)
        print(f"pp=2 tokens equal pp=1's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
