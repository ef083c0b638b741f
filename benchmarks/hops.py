"""What the scheduler-as-hub path costs: worker -> scheduler -> detokenizer -> scheduler -> client.

Two measurements, one run:

1. The detokenizer hop alone, per step: the scheduler's `DetokTokens` for B sequences (one new
   token each) over a real loopback socket and codec to a detokenizer in another process, its
   `DetokOutputs` back; against the same detokenizer state called inline (what moving the
   detokenizing into the scheduler would cost instead). Median microseconds per step.
2. The whole path through a real cluster (`zeroserve up` processes on loopback): time per step
   as the client sees it (stream deltas at batch 1; wall / worker steps at 16 concurrent) against
   the worker's own compute per step (its heartbeat counters); the difference is everything
   between two steps of one group: scheduler, both detokenizer messages, the client hop.

    .venv/bin/python benchmarks/hops.py            # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/hops.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_model_dir, environment, json_line, log  # noqa: E402


def _detok_peer(addr: str, model_dir: str) -> None:
    """The detokenizer side: a DEALER that answers every message with the state's reply."""
    import zmq

    from zeroserve.common import messages as P
    from zeroserve.common.model_config import ModelConfig
    from zeroserve.common.tokenizer import load_tokenizer
    from zeroserve.common.transport import Channel, make_socket
    from zeroserve.services.detokenizer.state import Detokenizer

    state = Detokenizer({ModelConfig.from_dir(model_dir).name: load_tokenizer(model_dir)})
    ch = Channel(make_socket(zmq.Context.instance(), zmq.DEALER, connect=addr, identity=b"detok"))
    ch.send(P.Ping(nonce=0))  # says where it is
    while True:
        _, msg = ch.recv()
        if isinstance(msg, P.Shutdown):
            return
        reply = state.handle(msg)
        if reply is not None:
            ch.send(reply)


def detok_hop(model_dir: Path, batch: int, steps: int) -> dict:
    import numpy as np
    import zmq

    from zeroserve.common import messages as P
    from zeroserve.common.model_config import ModelConfig
    from zeroserve.common.sampling_params import SamplingParams
    from zeroserve.common.tokenizer import load_tokenizer
    from zeroserve.common.transport import Channel, free_port, make_socket
    from zeroserve.services.detokenizer.state import Detokenizer

    name = ModelConfig.from_dir(model_dir).name
    rng = np.random.default_rng(batch)
    toks = rng.integers(3, 2000, size=(steps, batch)).astype(np.int32)
    ids = [f"{i}#0" for i in range(batch)]
    new = P.DetokNew(items=[P.DetokRequest(req_id=r, prompt_token_ids=rng.integers(3, 2000, 16).astype(np.int32),
                                           params=SamplingParams(model=name)) for r in ids])

    def step_msg(k: int) -> P.DetokTokens:
        return P.DetokTokens.build(k + 1, ids, [[int(t)] for t in toks[k]])

    # inline: the state called directly
    state = Detokenizer({name: load_tokenizer(str(model_dir))})
    state.handle(new)
    inline = []
    for k in range(steps):
        t = time.perf_counter()
        state.handle(step_msg(k))
        inline.append(time.perf_counter() - t)
    # over the socket, the detokenizer in another process
    addr = f"tcp://127.0.0.1:{free_port()}"
    ch = Channel(make_socket(zmq.Context.instance(), zmq.ROUTER, bind=addr))
    peer = mp.get_context("spawn").Process(target=_detok_peer, args=(addr, str(model_dir)), daemon=True)
    peer.start()
    ident, _ = ch.recv(timeout=120)
    ch.send(new, ident)
    hop = []
    for k in range(steps):
        t = time.perf_counter()
        ch.send(step_msg(k), ident)
        ch.recv(timeout=30)
        hop.append(time.perf_counter() - t)
    ch.send(P.Shutdown(reason="done"), ident)
    peer.join(10)
    med = lambda xs: statistics.median(xs[steps // 10:]) * 1e6  # noqa: E731 - skip the warm-up tenth
    return {"batch": batch, "inline_us": round(med(inline), 1), "socket_us": round(med(hop), 1),
            "hop_us": round(med(hop) - med(inline), 1)}


def cluster_path(model_dir: Path, threads: int, max_tokens: int, concurrency: int) -> dict:
    from benchmarks.common import ensure_repo_on_path
    from zeroserve import AsyncClient, Client, SamplingParams
    from zeroserve.common.transport import free_port_block
    from zeroserve.services.cli import build_parser
    from zeroserve.services.launcher import plan_children, stop_children, wait_ready

    ensure_repo_on_path()
    port = free_port_block(4)
    up = build_parser().parse_args(["up", "--model", str(model_dir), "--port", str(port), "--workers", "1",
                                    "--threads", str(threads)])
    children = plan_children(up, str(model_dir))
    address = f"tcp://127.0.0.1:{port}"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def worker_counters(c) -> tuple[int, float]:
        steps = busy = 0
        for g in c.stats()["groups"]:
            for w in g["workers"]:
                if w["rank"] == 0:
                    steps, busy = steps + w.get("w_steps", 0), busy + w.get("w_busy_s", 0.0)
        return steps, busy

    async def batch1() -> list[float]:
        gaps, last = [], None
        async with AsyncClient(address) as c:
            async for d in c.stream([5, 6, 7, 8] * 8, params):
                now = time.perf_counter()
                if last is not None and d.token_ids:
                    gaps.append((now - last) / len(d.token_ids))
                last = now
        return gaps

    async def loaded() -> None:
        async with AsyncClient(address) as c:
            await asyncio.gather(*(c.generate([5 + i, 6, 7, 8] * 8, params) for i in range(concurrency)))

    out = {}
    try:
        for ch in children:
            ch.start()
        wait_ready(address, 1, children, timeout_s=300)
        for label, run in (("batch 1", batch1), (f"{concurrency} concurrent", loaded)):
            with Client(address) as c:
                c.generate([1, 2, 3], params)  # warm
                time.sleep(1.2)  # a heartbeat carries the worker's counters
                s0, b0 = worker_counters(c)
            t = time.perf_counter()
            gaps = asyncio.run(run())
            wall = time.perf_counter() - t
            time.sleep(1.5)
            with Client(address) as c:
                s1, b1 = worker_counters(c)
            steps, busy = s1 - s0, b1 - b0
            per_step = statistics.median(gaps) if gaps else wall / max(steps, 1)
            out[label] = {"steps": steps, "client_ms_per_step": round(per_step * 1e3, 2),
                          "worker_ms_per_step": round(busy / max(steps, 1) * 1e3, 2),
                          "path_ms_per_step": round((per_step - busy / max(steps, 1)) * 1e3, 2)}
    finally:
        stop_children(children)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="detokenizer round trips per batch size")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-cluster", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    model = bench_model_dir()
    res = {"benchmark": "hops", "env": environment(), "detok_hop": [], "cluster": {}}
    for b in map(int, a.batches.split(",")):
        r = detok_hop(model, b, a.steps)
        res["detok_hop"].append(r)
        log(f"detokenizer hop, {b:>3} sequences/step: inline {r['inline_us']:8.1f} us, over the socket "
            f"{r['socket_us']:8.1f} us -> the hop adds {r['hop_us']:8.1f} us per step")
    if not a.skip_cluster:
        res["cluster"] = cluster_path(model, a.threads, a.max_tokens, a.concurrency)
        for label, r in res["cluster"].items():
            log(f"cluster, {label}: {r['client_ms_per_step']} ms per step at the client, worker compute "
                f"{r['worker_ms_per_step']} ms -> the path adds {r['path_ms_per_step']} ms per step ({r['steps']} steps)")
    if a.json:
        json_line(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
