"""Worker groups: the registry and each group's lifecycle, free of sockets.

JOINING (waiting for every shard's HELLO: tp_size x pp_size of them) -> PROBING (a PUB drops what a SUB that has not
subscribed yet misses, so steps wait until every shard acknowledged a probe on its topic) ->
READY -> DRAINING (finishes what it runs, takes nothing new) -> GONE. A group has its own
policy (block manager and running set) and one step in flight, or, with several pipeline stages,
up to one per stage, each over requests no other in-flight step holds (`Group.max_in_flight`:
stage 0 computes step n+1 while stage 1 computes step n). Methods take the time
`now` and put what must be sent into an `Outbox`; those that end groups return the requests
the groups held, for the cluster to route again.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from zeroserve.common import messages as P
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.log import LogBudget, get_logger
from zeroserve.services.scheduler.adoption import seed_prefix_cache
from zeroserve.services.scheduler.block_manager import BlockManager
from zeroserve.services.scheduler.outbox import Outbox
from zeroserve.services.scheduler.policy import Scheduler as Policy
from zeroserve.services.scheduler.policy import TokenEvent
from zeroserve.services.scheduler.step_check import BadStepResult, check_result
from zeroserve.services.scheduler.request import Request

if TYPE_CHECKING:
    from zeroserve.common.config import SchedulerConfig
    from zeroserve.services.scheduler.models import ModelInfo

log = get_logger("scheduler")
_REFUSED_LOG = LogBudget("refused a peer")  # hostile peers can send these by the thousand

CHECK_INTERVAL_S = 0.25  # liveness checks need not run on every loop turn
# what a HELLO may announce (anything else is refused with the reason): block sizes the
# workers support (common/config.py CacheArgs), a KV cache of at most 64 TiB per shard at one
# byte per value, and at most this many groups waiting for their TP shards at once
ALLOWED_BLOCK_SIZES = (16, 32, 48, 64, 80, 96, 112, 128, 256)
MAX_KV_BYTES = 64 << 40
MAX_JOINING_GROUPS = 64
MAX_GONE_GROUPS = 64  # gone groups kept for a look (tests, logs); older ones are forgotten
# workers whose group we gave up, remembered so a worker back from a partition hears "we dropped
# you (why)" rather than guessing at a restart; bounded: a peer churning ids costs a fixed size
MAX_GIVEN_UP = 1024
MAX_REFUSALS_SHOWN = 16  # the latest refusals `status` lists


class GroupState(enum.Enum):
    JOINING = "joining"  # waiting for all TP shards to say HELLO
    PROBING = "probing"  # every shard connected; waiting for each SUB to see the topic
    READY = "ready"
    DRAINING = "draining"  # finishing what it runs, takes nothing new
    GONE = "gone"


@dataclass
class Shard:
    hello: P.Hello
    identity: bytes
    last_seen: float
    stats: dict = field(default_factory=dict)
    probe_acked: bool = False
    welcomed: bool = False


class InFlight(NamedTuple):
    """A step a group is computing."""

    seq: int
    step: P.Step
    sent_at: float


class ShardRef(NamedTuple):
    group: str
    rank: int


@dataclass
class Group:
    name: str
    model: str
    tp_size: int
    pp_size: int = 1  # pipeline stages (services/worker/pipeline.py)
    shards: dict[int, Shard] = field(default_factory=dict)  # by group rank (pp_rank * tp_size + tp_rank)
    state: GroupState = GroupState.JOINING
    policy: Policy | None = None  # made when the group is READY (it needs every shard's capacity)
    seq: int = 0  # of the last step sent; restarts at each READY
    # the steps sent and not yet answered, oldest first (a group answers in order); at most
    # max_in_flight: pp_size (or --pp-steps-in-flight), set when READY; 1 for one stage
    flights: deque[InFlight] = field(default_factory=deque)
    max_in_flight: int = 1
    peak_in_flight: int = 0  # the most steps it has had in flight at once (stats)
    probe_id: str = ""
    last_probe: float = 0.0
    dist_init_addr: str | None = None  # rank 0's torch.distributed address, for the other ranks
    drain_started: float = 0.0
    steps: int = 0
    tokens: int = 0

    def load(self) -> int:
        return self.policy.num_unfinished if self.policy else 0

    @property
    def in_flight(self) -> InFlight | None:
        """The oldest step in flight (the one the next result answers), or None: idle."""
        return self.flights[0] if self.flights else None

    @property
    def size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def answer_rank(self) -> int:
        """The shard whose StepResults count: the last stage's tp rank 0 (the sampler is there)."""
        return P.answering_rank(self.tp_size, self.pp_size)


class Groups:
    """Every worker group this scheduler knows, by name, and which shard each worker id is."""

    def __init__(self, cfg: SchedulerConfig, models: dict[str, ModelInfo], scheduler_id: str, step_addr: str) -> None:
        self.cfg = cfg
        self.models = models
        self.scheduler_id = scheduler_id
        self.step_addr = step_addr  # the steps PUB address workers dial (advertised host)
        self.groups: dict[str, Group] = {}
        self.shard_of: dict[str, ShardRef] = {}  # worker_id -> where it sits
        self.failovers: dict[str, int] = {}  # live request key -> groups that died under it
        self.given_up: OrderedDict[str, str] = OrderedDict()  # worker_id -> why its group was given up
        # model -> the numeric mode its first shard reported, fixed for this scheduler's life: a
        # request that fails over (or waits through a restart of every group) is computed alike
        self.model_modes: dict[str, str] = {}
        self.refusals: deque[dict] = deque(maxlen=MAX_REFUSALS_SHOWN)  # for `status`

    # ================================================================ lookups
    def get(self, name: str | None) -> Group | None:
        return self.groups.get(name) if name else None

    def values(self) -> list[Group]:
        return list(self.groups.values())

    def shard(self, worker_id: str) -> Shard | None:
        ref = self.shard_of.get(worker_id)
        g = self.groups.get(ref.group) if ref else None
        return g.shards.get(ref.rank) if g else None

    def group_of(self, worker_id: str) -> Group | None:
        ref = self.shard_of.get(worker_id)
        return self.groups.get(ref.group) if ref else None

    def ready(self, model: str) -> list[Group]:
        return [g for g in self.groups.values() if g.state == GroupState.READY and g.model == model]

    def probing(self) -> bool:
        return any(g.state == GroupState.PROBING for g in self.groups.values())

    def max_model_len(self, model: str) -> int:
        m = self.models[model].cfg.max_position_embeddings
        if self.cfg.max_model_len:
            m = min(m, self.cfg.max_model_len)
        for g in self.groups.values():
            if g.model == model and g.policy is not None:
                m = min(m, g.policy.max_model_len)
        return m

    # ================================================================ joining
    def refuse(self, ident: bytes, reason: str, ob: Outbox, worker_id: str = "") -> None:
        if _REFUSED_LOG.allow(time.monotonic()):
            log.warning("refused a peer", reason=reason, worker=worker_id)
        self.refusals.append({"worker_id": worker_id, "reason": reason, "at": time.time()})
        ob.to_backend(ident, P.Welcome(status="refused", detail=reason, scheduler_id=self.scheduler_id))

    def hello(self, ident: bytes, h: P.Hello, now: float, ob: Outbox) -> list[Request]:
        """A worker shard's HELLO (version already checked). Returns the requests of a group
        this shard's reconnect ended."""
        if h.model not in self.models:
            self.refuse(ident, f"this scheduler has no tokenizer for model {h.model!r} (serves "
                               f"{sorted(self.models)}); start the scheduler with --model for it", ob)
            return []
        if h.block_size <= 0 or h.num_kv_blocks <= 0:
            self.refuse(ident, "a worker must report its KV capacity (num_kv_blocks, block_size)", ob)
            return []
        reason = self._implausible(h)
        if reason:
            self.refuse(ident, reason, ob, h.worker_id)
            return []
        orphans: list[Request] = []
        if h.worker_id in self.shard_of:
            old, shard = self.group_of(h.worker_id), self.shard(h.worker_id)
            if shard is not None and shard.identity != ident and old.state != GroupState.GONE:
                self.refuse(ident, f"worker id {h.worker_id!r} is already connected from another "
                                   "connection; give each worker a unique --worker-id", ob)
                return []
            if old is not None and old.state in (GroupState.JOINING, GroupState.PROBING) and shard is not None:
                shard.identity, shard.last_seen, shard.welcomed = ident, now, False  # a repeated HELLO
                self._welcome(old, ob)
                return []
            if old is not None and old.state != GroupState.GONE:
                orphans = self.gone(old, f"worker {h.worker_id} reconnected", ob)
        name = h.group or f"g-{h.worker_id}"
        g = self.groups.get(name)
        # the mode after the checks that name a more specific mistake (a taken rank), but before
        # a new group exists: a refused shard leaves nothing behind
        other_mode = self.other_mode(h)
        if other_mode and (g is None or g.state == GroupState.GONE):
            self.refuse(ident, other_mode, ob, h.worker_id)
            return orphans
        if g is None or g.state == GroupState.GONE:
            joining = sum(1 for x in self.groups.values() if x.state == GroupState.JOINING)
            if joining >= MAX_JOINING_GROUPS:
                self.refuse(ident, f"{joining} groups are waiting for their tensor-parallel shards already; "
                                   "start the missing shards (or wait until they time out) and retry", ob)
                return orphans
            g = self.groups[name] = Group(name, h.model, h.tp_size, h.pp_size)
        first = next(iter(g.shards.values()), None)
        if g.model != h.model or g.tp_size != h.tp_size or g.pp_size != h.pp_size:
            self.refuse(ident, f"group {name!r} serves {g.model!r} with tp_size {g.tp_size} x pp_size {g.pp_size}; "
                               f"this shard says {h.model!r} / {h.tp_size} x {h.pp_size}", ob)
        elif g.state != GroupState.JOINING or h.group_rank in g.shards:
            self.refuse(ident, f"rank {h.group_rank} (tp rank {h.tp_rank}, stage {h.pp_rank}) of group {name!r} is "
                               "already connected", ob)
        elif first is not None and first.hello.block_size != h.block_size:
            self.refuse(ident, f"block_size {h.block_size} differs from the group's {first.hello.block_size}", ob)
        elif other_mode:
            self.refuse(ident, other_mode, ob, h.worker_id)
        else:
            self._join(g, ident, h, now, ob)
        return orphans

    def _implausible(self, h: P.Hello) -> str | None:
        """Why the capacity a HELLO announces cannot be true (None: plausible)."""
        mc = self.models[h.model].cfg
        if h.block_size not in ALLOWED_BLOCK_SIZES:
            return f"block_size {h.block_size} is not one of {list(ALLOWED_BLOCK_SIZES)}"
        if h.max_model_len > mc.max_position_embeddings:
            return (f"max_model_len {h.max_model_len} exceeds model {h.model!r}'s max_position_embeddings "
                    f"{mc.max_position_embeddings}")
        if h.num_kv_blocks > self.cfg.max_kv_blocks:
            return (f"num_kv_blocks {h.num_kv_blocks} is more than this scheduler's --max-kv-blocks "
                    f"{self.cfg.max_kv_blocks}; start the worker with a smaller --num-kv-blocks (or the "
                    "scheduler with a larger --max-kv-blocks)")
        block_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * h.block_size // h.tp_size
        if h.num_kv_blocks * max(block_bytes, 1) > MAX_KV_BYTES:
            return (f"num_kv_blocks {h.num_kv_blocks} x {max(block_bytes, 1)} bytes per block is more than "
                    f"{MAX_KV_BYTES >> 40} TiB of KV cache; report the real capacity")
        return None

    def other_mode(self, h: P.Hello) -> str | None:
        """Why a shard's numeric mode may not serve its model here (None: it may)."""
        have = self.model_modes.get(h.model)
        if have is None or have == h.numeric_mode:
            return None
        return (f"numeric mode {h.numeric_mode or '(none reported)'!r} differs from {have!r}, which serves model "
                f"{h.model!r} here: a request moving between them would change tokens; start this worker with "
                "the same --dtype / --matmul-dtype / --kv-cache-dtype / --quantization on a CPU of the same "
                "kernel build (or restart the scheduler to change the model's mode)")

    def _join(self, g: Group, ident: bytes, h: P.Hello, now: float, ob: Outbox) -> None:
        self.given_up.pop(h.worker_id, None)
        if h.model not in self.model_modes:
            self.model_modes[h.model] = h.numeric_mode
            log.info("model numeric mode fixed", model=h.model, mode=h.numeric_mode, by=h.worker_id)
        rank = h.group_rank
        g.shards[rank] = Shard(h, ident, now)
        self.shard_of[h.worker_id] = ShardRef(g.name, rank)
        log.info("worker joined", group=g.name, worker=h.worker_id, rank=h.tp_rank, tp=h.tp_size, stage=h.pp_rank,
                 pp=h.pp_size, device=h.device, kv_blocks=h.num_kv_blocks, pid=h.pid)
        if rank == 0:
            g.dist_init_addr = h.dist_init_addr
        self._welcome(g, ob)
        if len(g.shards) == g.size:
            g.state = GroupState.PROBING
            g.probe_id = uuid.uuid4().hex[:8]
            g.last_probe = 0.0

    def _welcome(self, g: Group, ob: Outbox) -> None:
        """Answer shards; ranks > 0 need rank 0's torch.distributed address first."""
        if 0 not in g.shards:
            return
        for s in g.shards.values():
            if not s.welcomed:
                ob.to_backend(s.identity, P.Welcome(status="accepted", group=g.name, dist_init_addr=g.dist_init_addr,
                                                    scheduler_id=self.scheduler_id, step_addr=self.step_addr))
                s.welcomed = True

    # ================================================================ messages from shards
    def sender(self, ident: bytes, msg, now: float, ob: Outbox) -> tuple[Group, Shard] | None:
        """The group and shard a worker message comes from; None to ignore it. A message that
        names a worker counts only from that worker's own connection (or its heartbeat one)."""
        shard = self.shard(msg.worker_id)
        if shard is None:
            if isinstance(msg, P.Heartbeat):  # we restarted, or gave its group up: it must join again
                why = self.given_up.get(msg.worker_id)
                detail = (f"this scheduler gave your group up ({why}); say HELLO again" if why is not None
                          else "unknown worker: say HELLO again")
                ob.to_backend(ident, P.Welcome(status="rejoin", scheduler_id=self.scheduler_id, detail=detail))
            return None  # a late message from a worker we already let go
        own = ident == shard.identity or (isinstance(msg, P.Heartbeat) and ident == f"{msg.worker_id}-hb".encode())
        if not own:
            raise InvalidRequest(f"{type(msg).__name__} names worker {msg.worker_id!r} but comes from another connection")
        shard.last_seen = now
        return self.group_of(msg.worker_id), shard

    def probe_ack(self, g: Group, shard: Shard, m: P.ProbeAck) -> bool:
        """True when this ack made the group READY."""
        if m.probe_id != g.probe_id:
            return False
        shard.probe_acked = True
        if g.state == GroupState.PROBING and all(s.probe_acked for s in g.shards.values()):
            self._ready(g)
            return True
        return False

    def _ready(self, g: Group) -> None:
        blocks = min(s.hello.num_kv_blocks for s in g.shards.values())
        bs = g.shards[0].hello.block_size
        max_len = min(s.hello.max_model_len or 1 << 30 for s in g.shards.values())
        mc = self.models[g.model].cfg
        max_len = min(max_len, mc.max_position_embeddings)
        if self.cfg.max_model_len:
            max_len = min(max_len, self.cfg.max_model_len)
        g.policy = Policy(BlockManager(blocks, bs, self.cfg.enable_prefix_caching), self.cfg.max_num_seqs,
                          self.cfg.max_num_batched_tokens, max_len, mc.eos_token_ids, mc.vocab_size,
                          mc.kv_window, min(s.hello.num_lookahead_tokens for s in g.shards.values()),
                          max_num_prefill_tokens=self.cfg.max_num_prefill_tokens)
        # LoRA: adapters at once, within every shard's slots (0: the group serves none)
        g.policy.max_loras_per_batch = min([self.cfg.loras_per_batch] + [s.hello.max_loras for s in g.shards.values()])
        g.state = GroupState.READY
        g.seq = 0
        # pipelining: one step per stage in flight, each over its own requests (policy.py)
        n = self.cfg.pp_steps_in_flight
        g.max_in_flight = g.pp_size if n is None else max(1, min(n, g.pp_size))
        log.info("group ready", group=g.name, model=g.model, tp=g.tp_size, kv_blocks=blocks)
        kept, g.shards[0].hello.kept = g.shards[0].hello.kept, []  # read once: its memory goes
        if kept and g.tp_size == 1 and mc.kv_window is None and not g.policy.num_lookahead_tokens:
            n = seed_prefix_cache(g.policy.bm, kept, mc.vocab_size)
            log.info("KV kept through a scheduler restart is in the prefix cache", group=g.name, seqs=len(kept),
                     blocks=n)

    def drain(self, g: Group, worker_id: str, now: float) -> None:
        if g.state in (GroupState.READY, GroupState.PROBING, GroupState.JOINING):
            log.info("group draining", group=g.name, worker=worker_id)
            g.state = GroupState.DRAINING
            g.drain_started = now

    def step_result(self, g: Group, m: P.StepResult) -> list[TokenEvent] | None:
        """Accept the answer to the oldest step in flight (a group answers its steps in order);
        None for a late answer to one we gave up on. Raises BadStepResult for one that does not
        answer the step (the caller ends the group)."""
        if g.in_flight is None or g.in_flight.seq != m.seq or g.policy is None:
            return None
        if self.shard_of[m.worker_id].rank != g.answer_rank:
            raise InvalidRequest(f"only rank {g.answer_rank} of group {g.name!r} (tp rank 0 of its last stage) "
                                 "answers steps")
        step = g.in_flight.step
        reason = check_result(step, m, self.models[g.model].cfg, g.policy.requests)
        if reason:
            raise BadStepResult(f"the answer to step {m.seq} of group {g.name!r} {reason}")
        g.flights.popleft()
        events = g.policy.update(step, m)
        g.steps += 1
        g.tokens += step.total_tokens
        return events

    def gone(self, g: Group, reason: str, ob: Outbox) -> list[Request]:
        """A group died or left; returns its unfinished requests, which keep their tokens."""
        if g.state == GroupState.GONE:
            return []
        if reason.startswith(P.UNLOAD_SHUTDOWN):  # the model pool let its model go (idle: nothing to requeue)
            log.info("group unloaded", group=g.name, model=g.model, reason=reason)
        else:
            log.warning("group gone; requeueing its requests", group=g.name, reason=reason)
        prev = g.state
        g.state = GroupState.GONE
        reqs = g.policy.drain_all() if g.policy is not None else []
        g.policy = None  # its block tables: a gone group stays listed a while, its memory must not
        g.flights.clear()  # every step in flight: their requests are in `reqs`, once each
        if reason != "drained":  # a failure: count it against each request it hit
            for key in {r.client_id for r in reqs}:
                self.failovers[key] = self.failovers.get(key, 0) + 1
        if prev != GroupState.JOINING:
            ob.publish(g.name, P.Shutdown(reason=reason))
        for s in g.shards.values():
            wid = s.hello.worker_id
            self.shard_of.pop(wid, None)
            if reason != "drained":
                self.given_up[wid] = reason
                self.given_up.move_to_end(wid)
        while len(self.given_up) > MAX_GIVEN_UP:
            self.given_up.popitem(last=False)
        return reqs

    # ================================================================ steps
    def dispatch(self, g: Group, now: float, ob: Outbox) -> None:
        """Send the group its next steps while it has room in flight and work to do. With room for
        k more, a step takes about 1/k of the requests it could run (policy.schedule(parts=k)):
        a pipeline's micro-batches stay even instead of the first taking everyone."""
        while len(g.flights) < g.max_in_flight and g.policy is not None and \
                g.state in (GroupState.READY, GroupState.DRAINING) and g.policy.needs_step():
            step = g.policy.schedule(parts=g.max_in_flight - len(g.flights))
            if step.empty and not step.finished_req_ids:  # every runnable request is in flight
                return
            g.seq += 1
            step.seq, step.group = g.seq, g.name
            ob.publish(g.name, step)
            g.flights.append(InFlight(g.seq, step, now))
            g.peak_in_flight = max(g.peak_in_flight, len(g.flights))

    def dispatch_all(self, now: float, ob: Outbox) -> None:
        for g in self.groups.values():
            self.dispatch(g, now, ob)

    # ================================================================ timers
    def probe(self, now: float, ob: Outbox) -> None:
        for g in self.groups.values():
            if g.state == GroupState.PROBING and now - g.last_probe >= self.cfg.probe_interval_s:
                g.last_probe = now
                ob.publish(g.name, P.Probe(probe_id=g.probe_id))

    def check(self, now: float, ob: Outbox) -> list[Request]:
        """Missed heartbeats, hung steps, finished (or overdue) drains: returns the requests of
        the groups that ended."""
        orphans: list[Request] = []
        cfg = self.cfg
        for g in list(self.groups.values()):
            if g.state == GroupState.GONE:
                continue
            stale = [s for s in g.shards.values() if now - s.last_seen > cfg.heartbeat_timeout_s]
            if stale:
                orphans += self.gone(g, f"no heartbeat from {stale[0].hello.worker_id} for "
                                        f"{now - stale[0].last_seen:.1f}s", ob)
            elif g.in_flight is not None and now - g.in_flight.sent_at > cfg.step_timeout_s:
                orphans += self.gone(g, f"step {g.in_flight.seq} made no progress in {cfg.step_timeout_s}s", ob)
            elif g.state == GroupState.DRAINING:
                overdue = now - g.drain_started > cfg.drain_timeout_s
                idle = g.policy is None or not g.policy.has_work()
                if overdue or (idle and not g.flights):
                    for s in g.shards.values():
                        ob.to_backend(s.identity, P.Welcome(status="drained", group=g.name,
                                                            scheduler_id=self.scheduler_id))
                    orphans += self.gone(g, "drained", ob)
        gone = [n for n, g in self.groups.items() if g.state == GroupState.GONE]
        for name in gone[:max(0, len(gone) - MAX_GONE_GROUPS)]:  # the oldest: the registry stays bounded
            del self.groups[name]
        return orphans

    def close(self, ob: Outbox) -> None:
        for g in self.groups.values():
            if g.state != GroupState.GONE:
                ob.publish(g.name, P.Shutdown(reason="scheduler stopping"))

    def stats(self, now: float) -> list[dict]:
        out = []
        for g in self.groups.values():
            if g.state == GroupState.GONE:
                continue
            ps = g.policy.stats() if g.policy else {}
            out.append({
                "name": g.name, "model": g.model, "state": g.state.value, "tp_size": g.tp_size, "pp_size": g.pp_size,
                "numeric_mode": next(iter(g.shards.values())).hello.numeric_mode if g.shards else "",
                "steps": g.steps, "tokens": g.tokens, "steps_in_flight": len(g.flights),
                "peak_steps_in_flight": g.peak_in_flight, **ps,
                "workers": [{
                    "worker_id": s.hello.worker_id, "rank": r, "tp_rank": s.hello.tp_rank, "stage": s.hello.pp_rank,
                    "pid": s.hello.pid, "host": s.hello.host,
                    "device": s.hello.device, "kv_blocks": s.hello.num_kv_blocks,
                    "rss_bytes": s.hello.memory.rss_bytes, "param_bytes": s.hello.memory.param_bytes,
                    "kv_bytes": s.hello.memory.kv_bytes,
                    "heartbeat_age_s": round(now - s.last_seen, 3), **{f"w_{k}": v for k, v in s.stats.items()},
                } for r, s in sorted(g.shards.items())],
            })
        return out
