"""The model pool: which pool member holds which catalog model, free of sockets.

A pool member is a worker started with ``--pool``: it says HELLO with no model ("" ) and a
memory budget, and loads what the scheduler asks. Its life here:

  IDLE --Load--> LOADING --(LoadStatus loaded, then its HELLO for the model)--> SERVING
  SERVING --Unload--> UNLOADING --(LoadStatus unloaded, then its empty HELLO)--> IDLE
  LOADING --(LoadStatus failed)--> IDLE, the model marked failed (its waiting requests get
  ModelLoadError; nothing else changes)
  LOADING --(its HELLO for the model in another numeric mode than the model's here: groups.py)-->
  UNLOADING, the model marked failed likewise (the member's flags or kernel build differ)

While SERVING the member is an ordinary one-shard worker group (groups.py runs its life cycle and
steps); the pool only decides what it loads and when it lets a model go. A member that misses its
heartbeats while IDLE / LOADING / UNLOADING is dropped; its load, if any, goes to another member on
the next plan, and the requests waiting for it keep waiting (nothing was given to it yet).

Policy (docs/architecture.md, "Model pool"), run by `plan` on the scheduler's timer:

1. a model with waiting requests and no member loading or serving it gets an IDLE member; if none
   is idle, one member is unloaded for it: never one with requests or a step in flight, never a
   pinned model, never a model that itself has requests waiting; a model's second (third, ...)
   member first, then the least recently used;
2. a loaded model whose groups hold queued requests gets another IDLE member, up to max_groups
   (only idle ones: a queue behind a running group is no reason to evict a model);
3. pinned models, and those asked for with POST /v1/models/load, get IDLE members;
4. a member idle longer than its model's keep_alive is unloaded (pinned ones never).
"""

from __future__ import annotations

import enum
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zeroserve.common import messages as P
from zeroserve.common.catalog import FOREVER, CatalogEntry
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.log import get_logger
from zeroserve.services.scheduler.groups import GroupState
from zeroserve.services.scheduler.outbox import Outbox

if TYPE_CHECKING:
    from zeroserve.common.config import SchedulerConfig
    from zeroserve.services.scheduler.groups import Group, Groups
    from zeroserve.services.scheduler.request import Request

log = get_logger("scheduler")

MAX_FAILED = 256  # failed models remembered (a catalog is finite; this bounds a config reloaded often)


class MemberState(enum.Enum):
    IDLE = "idle"
    LOADING = "loading"
    SERVING = "serving"
    UNLOADING = "unloading"


@dataclass
class Member:
    worker_id: str
    identity: bytes
    budget: int
    last_seen: float
    state: MemberState = MemberState.IDLE
    model: str = ""  # what it holds, loads or unloads
    load_id: str = ""
    since: float = 0.0  # when the state began
    last_busy: float = 0.0  # the last time its group had requests (keep_alive and LRU count from it)
    unload_when_idle: bool = False  # POST /v1/models/unload while it ran requests
    progress: str = ""
    rss_bytes: int = 0  # as its last HELLO or LoadStatus said (an empty member's: its baseline)


class Pool:
    def __init__(self, cfg: SchedulerConfig, catalog: dict[str, CatalogEntry], groups: Groups,
                 scheduler_id: str) -> None:
        self.cfg = cfg
        self.catalog = catalog
        self.groups = groups
        self.scheduler_id = scheduler_id
        self.members: dict[str, Member] = {}
        self.failed: dict[str, str] = {e.name: e.error for e in catalog.values() if e.error}
        self.wanted: set[str] = set()  # asked for by POST /v1/models/load
        self.keep_alive: dict[str, float] = {}  # a request's keep_alive, for its model (Ollama's meaning)
        # per model, for stats and Prometheus (metrics.py exports them on refresh)
        self.loads = Counter()  # loads finished
        self.load_seconds = Counter()  # their seconds, summed
        self.load_failures = Counter()
        self.evictions = Counter()  # unloaded to make room for another model
        self.unloads = Counter()  # (model, why): evicted | keep_alive | asked | timeout

    # ================================================================ lookups
    def holders(self, model: str, *states: MemberState) -> list[Member]:
        return [m for m in self.members.values() if m.model == model and (not states or m.state in states)]

    def group(self, m: Member) -> Group | None:
        g = self.groups.group_of(m.worker_id)
        return g if g is not None and g.state != GroupState.GONE else None

    def state(self, model: str) -> tuple[str, str]:
        """(catalog state, reason) of a model, for /v1/models."""
        if model in self.failed:
            return "failed", self.failed[model]
        if self.groups.ready(model):
            return "loaded", ""
        if self.holders(model, MemberState.LOADING, MemberState.SERVING):
            return "loading", ""
        if self.holders(model, MemberState.UNLOADING):
            return "unloading", ""
        return "available", ""

    def keep_alive_s(self, model: str) -> float:
        """How long the model stays loaded once idle: the latest request's keep_alive, else its own."""
        e = self.catalog.get(model)
        return self.keep_alive.get(model, e.keep_alive_s if e is not None else FOREVER)

    def requested(self, model: str, keep_alive: float | None) -> None:
        """A request for `model` came in; its keep_alive (None: none given) holds from now on."""
        if keep_alive is not None and model in self.catalog:
            self.keep_alive[model] = FOREVER if keep_alive < 0 else keep_alive

    def refusal(self, model: str) -> str | None:
        """Why a request for a catalog model fails at once (None: it may wait for a load)."""
        if model in self.failed:
            return (f"model {model!r} failed to load: {self.failed[model]} (fix it, then POST /v1/models/load "
                    "to try again)")
        return None

    # ================================================================ members' messages
    def on_hello(self, ident: bytes, h: P.Hello, now: float, ob: Outbox) -> tuple[bool, list[Request]]:
        """A pool member's HELLO: (handled here, requests of a group it ended). An empty member is
        registered IDLE and welcomed here; one holding a model goes on to groups.hello."""
        m = self.members.get(h.worker_id)
        if m is not None and m.identity != ident and now - m.last_seen < self.cfg.heartbeat_timeout_s:
            self.groups.refuse(ident, f"worker id {h.worker_id!r} is already a pool member on another connection; "
                                      "give each worker a unique --worker-id", ob)
            return True, []
        orphans: list[Request] = []
        old, shard = self.groups.group_of(h.worker_id), self.groups.shard(h.worker_id)
        if old is not None and old.state != GroupState.GONE and shard is not None and shard.identity != ident:
            self.groups.refuse(ident, f"worker id {h.worker_id!r} is already connected from another connection; "
                                      "give each worker a unique --worker-id", ob)
            return True, []
        if not h.model:
            if old is not None and old.state != GroupState.GONE:  # it lost its model (restarted)
                orphans = self.groups.gone(old, f"pool member {h.worker_id} came back without its model", ob)
            if m is None or m.state != MemberState.IDLE:
                log.info("pool member idle", worker=h.worker_id, budget=h.memory_budget_bytes,
                         rss=h.memory.rss_bytes, was=m.state.value if m else None, model=m.model if m else None)
            self.members[h.worker_id] = Member(h.worker_id, ident, h.memory_budget_bytes, now, since=now,
                                               rss_bytes=h.memory.rss_bytes)
            ob.to_backend(ident, P.Welcome(status="accepted", scheduler_id=self.scheduler_id))
            return True, orphans
        if m is not None and m.state == MemberState.UNLOADING:  # a late HELLO: it still has to unload
            ob.to_backend(ident, P.Unload(load_id=m.load_id, reason="unloading"))
            return True, orphans
        if m is None or m.model != h.model or m.state != MemberState.SERVING:
            self.members[h.worker_id] = m = Member(h.worker_id, ident, h.memory_budget_bytes, now, since=now)
            m.state, m.model = MemberState.SERVING, h.model
        m.identity, m.last_seen, m.last_busy = ident, now, now
        why = self.groups.other_mode(h)
        if why is not None:  # loaded, but computes the model otherwise than it is served here: a failed load
            log.error("model failed to load", model=h.model, worker=h.worker_id, reason=why)
            self._set_failed(h.model, why)
            self.load_failures[h.model] += 1
            return True, orphans + self._unload(m, "numeric_mode", why, now, ob)
        self.wanted.discard(h.model)
        return False, orphans

    def on_heartbeat(self, ident: bytes, hb: P.Heartbeat, now: float) -> bool:
        """True when the heartbeat is a member's outside any group (groups.py would not know it)."""
        m = self.members.get(hb.worker_id)
        if m is None or ident not in (m.identity, f"{hb.worker_id}-hb".encode()):
            return False
        m.last_seen = now
        return m.state != MemberState.SERVING or self.group(m) is None

    def on_goodbye(self, ident: bytes, worker_id: str) -> bool:
        """A member leaves (SIGTERM): it is no pool member from now on, so its model is planned
        elsewhere at once. True when nothing else need look at it (it had no group)."""
        m = self.members.get(worker_id)
        if m is None or ident != m.identity:
            return False
        log.info("pool member left", worker=worker_id, state=m.state.value, model=m.model)
        del self.members[worker_id]
        return m.state != MemberState.SERVING  # a serving one's group ends in groups.py

    def on_load_status(self, ident: bytes, s: P.LoadStatus, now: float) -> None:
        """A member's load progress; a failed load marks its model failed (the caller then fails
        that model's waiting requests: refusal())."""
        m = self.members.get(s.worker_id)
        if m is None or ident != m.identity:
            raise InvalidRequest(f"LoadStatus from {s.worker_id!r}, which is not a pool member on this connection")
        m.last_seen, m.rss_bytes = now, s.memory.rss_bytes or m.rss_bytes
        if s.load_id != m.load_id:
            return  # about a load we already gave up
        m.progress = s.phase
        if s.phase == "loaded":
            self.loads[m.model] += 1
            self.load_seconds[m.model] += s.elapsed_s
            log.info("model loaded", model=m.model, worker=m.worker_id, seconds=round(s.elapsed_s, 2),
                     rss=s.memory.rss_bytes, param_bytes=s.memory.param_bytes, kv_bytes=s.memory.kv_bytes)
        elif s.phase == "failed":
            model = m.model
            log.error("model failed to load", model=model, worker=m.worker_id, reason=s.error)
            self._set_failed(model, s.error)
            self.load_failures[model] += 1
            m.state, m.model, m.since = MemberState.IDLE, "", now
        elif s.phase == "unloaded":
            log.info("model unloaded", model=m.model, worker=m.worker_id, rss=s.memory.rss_bytes)
            m.state, m.model, m.since = MemberState.IDLE, "", now

    def _set_failed(self, model: str, reason: str) -> None:
        self.failed[model] = reason
        self.wanted.discard(model)
        while len(self.failed) > MAX_FAILED:
            self.failed.pop(next(iter(self.failed)))

    # ================================================================ operators
    def control(self, c: P.ModelsControl, now: float, ob: Outbox) -> list[Request]:
        """POST /v1/models/load or /unload; returns the requests of groups it ended (none: it
        unloads only idle copies, the others once their requests finish)."""
        if c.model not in self.catalog:
            raise InvalidRequest(f"model {c.model!r} is not in the catalog (catalog: {sorted(self.catalog)[:20]})")
        e = self.catalog[c.model]
        if c.action == "load":
            if e.config is None:
                raise InvalidRequest(f"model {c.model!r} cannot be loaded: {e.error}")
            self.failed.pop(c.model, None)
            self.wanted.add(c.model)
            return []
        self.wanted.discard(c.model)
        for m in self.holders(c.model, MemberState.SERVING):
            m.unload_when_idle = True
        return self._unload_idle(now, ob)

    # ================================================================ the timer
    def check(self, now: float, ob: Outbox) -> list[Request]:
        """Members gone silent, loads taking too long, idle models past keep_alive. Returns the
        requests of groups it ended (none: it only ends idle ones)."""
        for m in list(self.members.values()):
            g = self.group(m)
            if m.state == MemberState.SERVING:
                if g is None:
                    if now - m.last_seen > self.cfg.heartbeat_timeout_s:  # its group died with it
                        log.warning("pool member gone", worker=m.worker_id, model=m.model)
                        del self.members[m.worker_id]
                    continue
                if g.load() > 0 or g.in_flight is not None:
                    m.last_busy = now
            elif now - m.last_seen > self.cfg.heartbeat_timeout_s:
                log.warning("pool member gone; its load goes to another member" if m.state == MemberState.LOADING
                            else "pool member gone", worker=m.worker_id, state=m.state.value, model=m.model,
                            silent_s=round(now - m.last_seen, 1))
                del self.members[m.worker_id]
            elif m.state == MemberState.LOADING and now - m.since > self.cfg.model_load_timeout_s:
                reason = f"loading took more than {self.cfg.model_load_timeout_s:.0f}s (model_load_timeout_s)"
                log.error("model load timed out; the member unloads", model=m.model, worker=m.worker_id)
                self._unload(m, "timeout", reason, now, ob)
        for m in self.members.values():
            e = self.catalog.get(m.model)
            if (m.state == MemberState.SERVING and e is not None and not e.pinned
                    and now - m.last_busy > self.keep_alive_s(m.model)):
                m.unload_when_idle = True
        return self._unload_idle(now, ob)

    def _unload_idle(self, now: float, ob: Outbox) -> list[Request]:
        out: list[Request] = []
        for m in list(self.members.values()):
            g = self.group(m)
            if m.unload_when_idle and m.state == MemberState.SERVING and g is not None and self._idle(g):
                ka = self.keep_alive_s(m.model)
                if now - m.last_busy <= ka:
                    out += self._unload(m, "asked", "asked to", now, ob)
                else:
                    out += self._unload(m, "keep_alive", f"idle for {now - m.last_busy:.0f}s (keep_alive {ka:g}s)",
                                        now, ob)
        return out

    @staticmethod
    def _idle(g: Group) -> bool:
        return g.state == GroupState.READY and g.load() == 0 and g.in_flight is None

    def plan(self, now: float, waiting_models: list[str], ob: Outbox) -> list[Request]:
        """Loads and evictions for the requests waiting (their models, oldest first)."""
        out: list[Request] = []
        waiting = Counter(x for x in waiting_models if x in self.catalog and x not in self.failed)
        for model in dict.fromkeys(x for x in waiting_models if x in waiting):  # oldest request first
            if self.holders(model, MemberState.LOADING, MemberState.SERVING):
                continue
            if self.members and not any(self._fits(m, model) for m in self.members.values()):
                need, most = self.catalog[model].weight_bytes, max(m.budget for m in self.members.values())
                self._set_failed(model, f"its weights take {need} bytes; no pool member's --memory-budget holds them "
                                        f"(the largest: {most} bytes); start a member with a larger budget")
                continue
            free = self._free(model)
            if free is not None:
                self._load(free, model, now, ob)
                continue
            if any(m.state == MemberState.UNLOADING for m in self.members.values()):
                continue  # a member is being freed already: wait for it before evicting another
            victim = self._victim(set(waiting), model)
            if victim is not None:
                self.evictions[victim.model] += 1
                out += self._unload(victim, "evicted", f"evicted for {model!r} (least recently used)", now, ob)
        # 2: a queue behind a loaded model's groups; 3: pinned and asked-for models
        for name, e in self.catalog.items():
            if name in self.failed or e.config is None:
                continue
            held = self.holders(name, MemberState.LOADING, MemberState.SERVING)
            queued = sum(len(g.policy.waiting) for g in self.groups.ready(name) if g.policy is not None)
            if (queued and len(held) < e.max_groups) or ((e.pinned or name in self.wanted) and not held):
                free = self._free(name)
                if free is not None:
                    self._load(free, name, now, ob)
        return out

    def _fits(self, m: Member, model: str) -> bool:
        """A member with a budget holds a model whose weights take less (its KV cache gets the rest)."""
        return not m.budget or self.catalog[model].weight_bytes < m.budget

    def _free(self, model: str) -> Member | None:
        """The idle member to load `model` on: one it fits in, the largest budget first (0: unbounded)."""
        idle = [m for m in self.members.values() if m.state == MemberState.IDLE and self._fits(m, model)]
        return max(idle, key=lambda m: (not m.budget, m.budget, m.worker_id)) if idle else None

    def _victim(self, waiting: set[str], model: str) -> Member | None:
        """The member to unload for a waiting `model`: one it fits in, idle, not pinned, not wanted
        itself; a model's extra copies first, then the least recently used."""
        copies = Counter(m.model for m in self.members.values() if m.state == MemberState.SERVING)
        best, best_key = None, None
        for m in self.members.values():
            g = self.group(m)
            e = self.catalog.get(m.model)
            if (m.state != MemberState.SERVING or g is None or not self._idle(g) or m.model in waiting
                    or not self._fits(m, model)):
                continue
            if e is None or e.pinned:  # a model given with --model is not the pool's to evict
                continue
            key = (copies[m.model] > 1, -m.last_busy)
            if best_key is None or key > best_key:
                best, best_key = m, key
        return best

    def _load(self, m: Member, model: str, now: float, ob: Outbox) -> None:
        m.state, m.model, m.since, m.load_id, m.progress = MemberState.LOADING, model, now, uuid.uuid4().hex[:12], ""
        m.unload_when_idle = False
        log.info("loading model on a pool member", model=model, worker=m.worker_id)
        ob.to_backend(m.identity, P.Load(load_id=m.load_id, model=model, path=self.catalog[model].path))

    def _unload(self, m: Member, why: str, reason: str, now: float, ob: Outbox) -> list[Request]:
        self.unloads[(m.model, why)] += 1
        log.info("unloading model", model=m.model, worker=m.worker_id, reason=reason)
        m.state, m.since, m.unload_when_idle = MemberState.UNLOADING, now, False
        m.load_id = uuid.uuid4().hex[:12]
        ob.to_backend(m.identity, P.Unload(load_id=m.load_id, reason=reason))
        g = self.groups.group_of(m.worker_id)
        reqs: list[Request] = []
        if g is not None and g.state != GroupState.GONE:  # no new work; its Shutdown ends the model too
            reqs = self.groups.gone(g, f"{P.UNLOAD_SHUTDOWN}: {reason}", ob)
            self.groups.given_up.pop(m.worker_id, None)  # planned: not a failure to tell it about
        return reqs

    # ================================================================ introspection
    def stats(self, now: float, waiting: Counter) -> dict:
        return {
            "members": [{"worker_id": m.worker_id, "state": m.state.value, "model": m.model,
                         "for_s": round(now - m.since, 3), "budget_bytes": m.budget, "rss_bytes": m.rss_bytes,
                         "idle_s": round(now - m.last_busy, 3) if m.state == MemberState.SERVING else None}
                        for m in self.members.values()],
            "models": {name: {"state": self.state(name)[0], "waiting": waiting.get(name, 0),
                              "loads": self.loads[name], "load_seconds": round(self.load_seconds[name], 3),
                              "evictions": self.evictions[name],
                              "keep_alive_s": None if self.keep_alive_s(name) == FOREVER else self.keep_alive_s(name)}
                       for name in self.catalog},
        }


__all__ = ["Member", "MemberState", "Pool"]
