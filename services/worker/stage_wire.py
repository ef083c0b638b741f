"""How a pipeline stage's tensors travel to another shard of its group (services/worker/pipeline.py).

Two wires with one interface, `send(tensor, dst)` and `recv(buf, src)` (into a buffer of the
size the receiver expects: the step tells every stage how many tokens it has), peers named by
group rank:

- `DistWire`: torch.distributed send/recv on the group's world: NCCL on GPU (device memory
  moves without host copies), gloo on CPU.
- `ZmqWire` (CPU groups, the default there): one ZeroMQ PUSH -> PULL pair per direction
  between the shards that talk, on the address the shard advertises; the addresses are
  exchanged once over the group's world. benchmarks/pp_transport.py measured a decode-sized
  hop (one token, hidden 4096: 32 KiB) at ~0.07 ms over ZeroMQ and at 0.1-2 ms over gloo on a
  busy CPU (docs/architecture.md has the figures).

A receive waits at most RECV_TIMEOUT_S (as long as the world's own collectives do); a peer
that is gone fails the step instead of hanging the stage.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

RECV_TIMEOUT_S = 120.0
WIRES = ("dist", "zmq")


class DistWire:
    def send(self, t: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        dist.send(t, dst=dst)

    def recv(self, buf: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        dist.recv(buf, src=src)

    def close(self) -> None:
        pass


class ZmqWire:
    """PUSH to each peer this shard sends to, PULL from each peer it receives from (one socket
    per peer: a message's kind follows from its sender, and each pair keeps its order)."""

    def __init__(self, host: str, sends_to: list[int], recvs_from: list[int]) -> None:
        import torch.distributed as dist
        import zmq

        self.ctx = zmq.Context()
        self.pull: dict[int, zmq.Socket] = {}
        mine: dict[int, str] = {}
        for src in recvs_from:
            s = self.ctx.socket(zmq.PULL)
            s.setsockopt(zmq.LINGER, 0)
            port = s.bind_to_random_port(f"tcp://{host}")
            self.pull[src] = s
            mine[src] = f"tcp://{host}:{port}"
        # every shard's {sender: address}, gathered over the world the group already has
        everyone: list[dict[int, str]] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(everyone, mine)
        me = dist.get_rank()
        self.push: dict[int, zmq.Socket] = {}
        for dst in sends_to:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(everyone[dst][me])
            self.push[dst] = s
        # a wire nobody closed closes its sockets before its context terms when collected: a
        # context collected with sockets open hangs the process in term()
        self._finalizer = weakref.finalize(self, _close, self.ctx, [*self.pull.values(), *self.push.values()])

    def send(self, t: torch.Tensor, dst: int) -> None:
        a = t.contiguous().view(torch.uint8).numpy()  # as bytes: numpy has no bfloat16
        self.push[dst].send(a, copy=a.nbytes < (64 << 10))  # zero-copy for big ones (the array stays referenced)

    def recv(self, buf: torch.Tensor, src: int) -> None:
        import zmq

        s = self.pull[src]
        if not s.poll(int(RECV_TIMEOUT_S * 1000), zmq.POLLIN):
            raise TimeoutError(f"pipeline peer rank {src} sent nothing for {RECV_TIMEOUT_S:.0f}s")
        frame = s.recv(copy=False)
        want = buf.numel() * buf.element_size()
        if len(frame) != want:  # the stages disagree about the step: never compute on it
            raise ValueError(f"pipeline peer rank {src} sent {len(frame)} bytes, this step expects {want}")
        np.copyto(buf.view(torch.uint8).numpy().reshape(-1), np.frombuffer(frame.buffer, np.uint8))

    def ready(self, src: int) -> bool:
        """Whether a message from `src` is waiting (a pipelined stage's owed tokens)."""
        import zmq

        return bool(self.pull[src].poll(0, zmq.POLLIN))

    def close(self) -> None:
        self._finalizer()


def _close(ctx, sockets) -> None:
    for s in sockets:
        s.close(0)
    ctx.term()


def make_wire(kind: str | None, device: torch.device, host: str, sends_to: list[int], recvs_from: list[int]):
    """`kind` None: ZeroMQ on CPU, torch.distributed (NCCL) on GPU."""
    kind = kind or ("dist" if device.type == "cuda" else "zmq")
    if kind not in WIRES:
        raise ValueError(f"pipeline wire must be one of {WIRES}, got {kind!r}")
    if kind == "zmq" and device.type != "cpu":
        raise ValueError("the ZeroMQ pipeline wire carries CPU tensors only")
    return DistWire() if kind == "dist" else ZmqWire(host, sends_to, recvs_from)


__all__ = ["RECV_TIMEOUT_S", "WIRES", "DistWire", "ZmqWire", "make_wire"]
