"""Stage-to-stage transfer of hidden states: torch.distributed send/recv (gloo) against a ZeroMQ
PAIR socket, between two processes over TCP on this host.

What a pipeline stage sends per step is [2, T, hidden] (hidden states and residual stream, one
message; services/worker/pipeline.py). Each transport bounces that buffer between two
processes; the figure is half a round trip (one hop), the median of `--reps` after a warm-up.
ZeroMQ sends the tensor's memory without a copy and the receiver wraps the frame without one
(`torch.frombuffer`), so both sides do what a stage would do.

    python benchmarks/pp_transport.py --hidden 4096 --tokens 1 8 32 256 --reps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import spawn_ranks  # noqa: E402

WARMUP = 10


def _bounce(rank: int, shapes, reps: int, send, recv) -> dict:
    """Rank 0 sends a [2, T, H] buffer and waits for it back, rank 1 returns it: the median of
    half a round trip per T."""
    res = {}
    for shape in shapes:
        buf = torch.randn(shape)
        times = []
        for i in range(reps + WARMUP):
            t0 = time.perf_counter()
            if rank == 0:
                send(buf)
                buf = recv(buf)
            else:
                buf = recv(buf)
                send(buf)
            if i >= WARMUP:
                times.append((time.perf_counter() - t0) / 2)
        res[shape[1]] = statistics.median(times)
    return res


def _gloo(rank: int, world: int, port: int, shapes, reps: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    peer = 1 - rank

    def recv(buf):
        dist.recv(buf, src=peer)
        return buf

    out.put({"rank": rank, "us": _bounce(rank, shapes, reps, lambda b: dist.send(b, dst=peer), recv)})
    dist.destroy_process_group()


def _zmq(rank: int, world: int, port: int, shapes, reps: int, out) -> None:
    import zmq

    torch.set_num_threads(1)
    ctx = zmq.Context()
    s = ctx.socket(zmq.PAIR)
    if rank == 0:
        s.bind(f"tcp://127.0.0.1:{port}")
    else:
        s.connect(f"tcp://127.0.0.1:{port}")

    def recv(buf):  # into a tensor of its own (a stage's layers write to what it receives)
        return torch.frombuffer(bytearray(s.recv(copy=False).buffer), dtype=torch.float32).view(buf.shape)

    out.put({"rank": rank, "us": _bounce(rank, shapes, reps, lambda b: s.send(b.numpy(), copy=False), recv)})
    s.close(linger=0)
    ctx.term()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 256])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    shapes = [(2, t, a.hidden) for t in a.tokens]
    gloo = spawn_ranks(_gloo, 2, shapes, a.reps)[0]["us"]
    zmq_ = spawn_ranks(_zmq, 2, shapes, a.reps)[0]["us"]
    rows = [{"tokens": t, "bytes": 2 * t * a.hidden * 4, "gloo_us": round(gloo[t] * 1e6, 1),
             "zmq_us": round(zmq_[t] * 1e6, 1)} for t in a.tokens]
    if a.json:
        print(json.dumps(rows))
        return 0
    print(f"one hop of [2, T, {a.hidden}] fp32 between two processes (median of {a.reps})")
    print(f"{'T':>5} {'bytes':>10} {'gloo us':>9} {'zmq us':>9}")
    for r in rows:
        print(f"{r['tokens']:>5} {r['bytes']:>10} {r['gloo_us']:>9} {r['zmq_us']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
