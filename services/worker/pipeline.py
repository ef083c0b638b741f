"""Pipeline parallelism: a group's model split by layers into stages, hidden states passed on.

A worker group is `pp_size` stages of `tp_size` tensor-parallel shards each. A shard's rank in
the group's torch.distributed world is

    group_rank = pp_rank * tp_size + tp_rank

so stage s holds ranks [s*T, (s+1)*T): the tensor-parallel shards of one stage are neighbours
(rank 0 of the group, which proposes the rendezvous address, is stage 0's tp rank 0).

Each stage holds a contiguous range of decoder layers (`stage_layers`; the earlier stages take
the one extra layer a split that does not come out even leaves, since the last stage also
runs the LM head and the sampler), and only those layers' KV cache. The first stage holds the
embedding, the last the final norm and the LM head (and, for tied embeddings, the embedding as
the head's weight).

Every shard of every stage gets the same step from the scheduler and keeps the same
per-request state. In a step, stage s > 0 receives the previous stage's hidden states (and the
residual stream, for pre-norm layers) from the shard with its own tp rank in stage s-1,
computes its layers and passes them on; the last stage samples, and its tp rank 0 answers the
scheduler (`answering_rank`). The sampled tokens go back from the last stage to every earlier
one (same tp rank), which appends them to its own copy of each sequence: the first stage
needs them as the next step's input, every stage to know which rows sample.

Several steps in flight (the scheduler sends up to pp_size, each over requests no other
in-flight step holds: services/scheduler/policy.py): a stage before the last does not wait for
step n's tokens before it takes step n+1 (`StageLink.pipelined`); it notes which requests they
belong to and appends them when they arrive, at the latest before a step that names one of
those requests (`settle`). So stage 0 computes step n+1 while stage 1 computes step n. Only
over the ZeroMQ wire: its sends are queued, so stage 1's token send and stage 0's next hidden
send never wait on each other; over torch.distributed each blocking send/recv pair between the
same two ranks would need its peer's matching call in the same order (there a stage still waits
for the tokens, and the scheduler's second step only overlaps its own work).

The transfer (services/worker/stage_wire.py) is a ZeroMQ PUSH/PULL pair per direction on CPU
and torch.distributed send/recv (NCCL: tensors stay on the device) on GPU; measured in
benchmarks/pp_transport.py, docs/architecture.md says why.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.messages import answering_rank, group_rank  # the numbering is the protocol's

__all__ = ["StageInfo", "StageLink", "answering_rank", "bind_tp_group", "connect", "group_rank", "stage_layers",
           "stage_tp_groups"]


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The decoder layers stage `pp_rank` of `pp_size` holds: contiguous, sizes differing by at
    most one, the extra layers on the earliest stages."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} out of range for pp_size {pp_size}")
    if num_layers < pp_size:
        raise ModelLoadError(f"the model has {num_layers} layers: too few for {pp_size} pipeline stages "
                             "(each stage needs at least one)")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


@dataclass(frozen=True)
class StageInfo:
    """Which stage a model holds, and its layers (global indices)."""

    rank: int = 0
    size: int = 1
    layers: range = range(0)

    @classmethod
    def of(cls, num_layers: int, pp_rank: int = 0, pp_size: int = 1) -> StageInfo:
        return cls(pp_rank, pp_size, stage_layers(num_layers, pp_size, pp_rank))

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


class StageLink:
    """The links of one shard to the other stages of its group (same tp rank), over a wire
    (services/worker/stage_wire.py: ZeroMQ on CPU, torch.distributed on GPU) set up once the
    group's torch.distributed world exists (`group_rank` numbering)."""

    def __init__(self, stage: StageInfo, tp_rank: int, tp_size: int, device, host: str = "127.0.0.1",
                 wire: str | None = None, pipelined: bool = False) -> None:
        from zeroserve.services.worker.stage_wire import ZmqWire, make_wire

        self.stage = stage
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = torch.device(device)
        rank_of = lambda s: group_rank(tp_rank, tp_size, s)  # noqa: E731
        self.prev = rank_of(stage.rank - 1) if not stage.first else None
        self.next = rank_of(stage.rank + 1) if not stage.last else None
        self.last = rank_of(stage.size - 1)
        self.earlier = [rank_of(s) for s in range(stage.size - 1)]  # where the last stage sends its tokens
        sends = self.earlier if stage.last else [self.next]
        recvs = [r for r in (self.prev, None if stage.last else self.last) if r is not None]
        self.wire = make_wire(wire, self.device, host, sends, recvs)
        # an earlier stage takes its next step before this one's tokens are back (module doc);
        # off in the in-process engine (tests, benchmarks), which needs the tokens as its result
        self.pipelined = pipelined and not stage.last and isinstance(self.wire, ZmqWire)
        # steps whose tokens are still to come, oldest first: (their requests, the sampling
        # rows' states, in the order the last stage sends their tokens)
        self.owed: deque[tuple[frozenset[str], list]] = deque()
        self.sent_bytes = 0
        # seconds spent in recv: a stage waiting for its peers (benchmarks/pp_throughput.py reports it)
        self.wait_s = 0.0

    def _recv(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        t0 = time.perf_counter()
        self.wire.recv(buf, src)
        self.wait_s += time.perf_counter() - t0
        return buf

    def recv_hidden(self, tokens: int, hidden_size: int, dtype: torch.dtype, with_residual: bool):
        """The previous stage's (hidden, residual) for `tokens` rows (residual None for layers
        that carry none); both in one message: one round trip instead of two."""
        buf = torch.empty((2 if with_residual else 1, tokens, hidden_size), dtype=dtype, device=self.device)
        self._recv(buf, self.prev)
        return buf[0], (buf[1] if with_residual else None)

    def send_hidden(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        buf = hidden.unsqueeze(0) if residual is None else torch.stack((hidden, residual))
        buf = buf.contiguous()
        self.sent_bytes += buf.numel() * buf.element_size()
        self.wire.send(buf, self.next)

    def send_tokens(self, toks: np.ndarray) -> None:
        """The last stage: the tokens it sampled, to every earlier stage."""
        t = torch.from_numpy(np.ascontiguousarray(toks, np.int32)).to(self.device)
        for dst in self.earlier:
            self.wire.send(t, dst)

    def recv_tokens(self, n: int) -> np.ndarray:
        """An earlier stage: the `n` tokens the last stage sampled in this step."""
        t = self._recv(torch.empty(n, dtype=torch.int32, device=self.device), self.last)
        return t.cpu().numpy()

    def follow(self, req_ids: list[str], states: list) -> None:
        """An earlier stage: append the tokens the last stage sampled for this step's sampling
        rows (`states`, in row order) to their requests, now or, pipelined, when they arrive."""
        self.owed.append((frozenset(req_ids), states))
        if not self.pipelined:
            self._take_one()

    def settle(self, req_ids) -> None:
        """Before a step: take every owed step's tokens up to the last one that holds a request
        the step names (in order: the tokens come in step order), so its state is complete."""
        ids = set(req_ids)
        upto = max((k for k, (held, _) in enumerate(self.owed) if not held.isdisjoint(ids)), default=-1)
        for _ in range(upto + 1):
            self._take_one()

    def settle_ready(self) -> None:
        """Between steps: take the tokens that have arrived (never waits)."""
        while self.owed and self.wire.ready(self.last):
            self._take_one()

    def _take_one(self) -> None:
        _, states = self.owed.popleft()
        for st, t in zip(states, self.recv_tokens(len(states)).tolist()):
            st.token_ids.append(t)


def stage_tp_groups(tp_size: int, pp_size: int, pp_rank: int):
    """Every stage's tensor-parallel process group, made by every rank in the same order (as
    torch.distributed.new_group requires); returns this stage's. None when tp_size is 1."""
    import torch.distributed as dist

    if tp_size == 1:
        return None
    mine = None
    for s in range(pp_size):
        g = dist.new_group([group_rank(r, tp_size, s) for r in range(tp_size)])
        if s == pp_rank:
            mine = g
    return mine


def bind_tp_group(model, pg) -> None:
    """Point every module of `model` that holds the model's TPInfo at process group `pg` (the
    stage's tensor-parallel group, made after the model was built: the world exists only once
    the scheduler has welcomed the group)."""
    from dataclasses import replace

    old = model.tp
    new = replace(old, group=pg)
    for m in model.modules():
        if getattr(m, "tp", None) is old:
            m.tp = new


def connect(runner, tp_rank: int, tp_size: int, host: str = "127.0.0.1", wire: str | None = None,
            pipelined: bool = False) -> None:
    """Once the group's world exists: this stage's tensor-parallel group into the model, and the
    links to the other stages into the runner (`host`: the address this shard's links listen on,
    its advertised one; `wire`: services/worker/stage_wire.py, None = by device; `pipelined`: a
    worker process, whose scheduler may send several steps at once: StageLink.pipelined)."""
    model = runner.model
    pg = stage_tp_groups(tp_size, model.stage.size, model.stage.rank)
    if pg is not None:
        bind_tp_group(model, pg)
    runner.link = StageLink(model.stage, tp_rank, tp_size, runner.device, host, wire, pipelined)
