"""The scheduler's state, free of sockets: requests, routing, failover, timers, stats.

`Cluster` owns the worker groups (`groups.Groups`), the delivery of tokens and text
(`delivery.Delivery`) and every live request. Its handlers take a message, the peer it came
from and the time `now`, and return an `Outbox` of what to send; `tick(now)` runs the timers,
`dispatch(now)` sends groups their next steps and `flush()` hands out what the loop turn
produced: one `DetokTokens` to the detokenizer and one `Outputs` per client, so a busy turn
costs a few messages, not one per token.

Request flow: Submit -> tokenized (by the shell's pool, or token ids given) -> admitted (checks,
n-way fan-out) -> routed to a READY group of its model, or pending until one is -> policy steps
-> delivery. When a group ends its requests are routed again with the tokens they have.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from zeroserve.common import messages as P
from zeroserve.common.codec import check_version
from zeroserve.common.errors import InvalidRequest, ModelLoadError, Overloaded, RequestTimeout, ZeroserveError
from zeroserve.common.log import LogBudget, get_logger
from zeroserve.common.prompts import check_prompt_ids, check_text_size, split_prompt
from zeroserve.common.sampling_params import SamplingParams, with_model_defaults
from zeroserve.services.scheduler import adoption
from zeroserve.services.scheduler.admission import check_params_for_model, fan_out
from zeroserve.services.scheduler.delivery import DETOK_ALIVE_S, Delivery, Live, Seq
from zeroserve.services.scheduler.groups import CHECK_INTERVAL_S, BadStepResult, Groups
from zeroserve.services.scheduler.lora import LoRAAdmin
from zeroserve.services.scheduler.metrics import SchedulerMetrics
from zeroserve.services.scheduler.models import ModelInfo
from zeroserve.services.scheduler.outbox import Outbox
from zeroserve.services.scheduler.pool import Pool
from zeroserve.services.scheduler.request import Request

if TYPE_CHECKING:
    from zeroserve.common.catalog import CatalogEntry
    from zeroserve.common.config import SchedulerConfig

log = get_logger("scheduler")
_PEER_ERROR_LOG = LogBudget("peer error / second detokenizer")  # hostile peers send these by the thousand

Handler = Callable[[bytes, Any, float], Outbox]


class Rate(NamedTuple):
    t: float
    tokens: int


class Cluster:
    def __init__(self, cfg: SchedulerConfig, models: dict[str, ModelInfo], scheduler_id: str, step_addr: str = "",
                 addresses: dict[str, str] | None = None, now: float = 0.0,
                 catalog: dict[str, CatalogEntry] | None = None) -> None:
        self.cfg = cfg
        self.models = models
        self.default_model = next(iter(models), None)
        self.id = scheduler_id
        self.addresses = addresses or {}
        self.started = now
        self.term = 1  # the scheduler's term (common/failover.py): the service sets it when it becomes active
        self.groups = Groups(cfg, models, scheduler_id, step_addr)
        self.pool = Pool(cfg, catalog or {}, self.groups, scheduler_id)  # models loaded on demand
        self.loras = LoRAAdmin(cfg, models)  # LoRA adapters served, by name
        self.delivery = Delivery(scheduler_id)
        self.live: dict[str, Live] = {}  # key -> Live
        self.by_client: dict[tuple[bytes, str], str] = {}  # (client, request_id) -> key
        self.pending: list[Live] = []  # admitted, waiting for a group that serves their model
        self.client_seen: dict[bytes, float] = {}
        self.keys = itertools.count()
        self.rng = random.Random(cfg.seed)
        self.tokens_total = 0
        self.rate_window: list[Rate] = []
        self.last_checks = 0.0
        self.last_stats = 0.0
        # pipelining: a group's next step leaves before this result's outputs are routed, so the
        # scheduler's work overlaps the workers' compute. The in-process engine turns it off: one
        # thread does both, and a stop string then ends its request before the next step is built
        self.overlap = True
        self.metrics = SchedulerMetrics(max((m.cfg.max_position_embeddings for m in models.values()), default=1),
                                        list(models))
        self.delivery.metrics = self.metrics

    def client_handlers(self) -> dict[type, Handler]:
        return {P.Submit: self.on_submit, P.Reattach: self.on_reattach, P.Abort: self.on_abort, P.Ping: self.on_ping,
                P.StatsRequest: self.on_stats_request, P.ModelsRequest: self.on_models_request,
                P.MetricsRequest: self.on_metrics_request, P.ModelsControl: self.on_models_control,
                P.LoadLoRA: self._seen(self.loras.on_load), P.UnloadLoRA: self._seen(self.loras.on_unload)}

    def _seen(self, handler: Handler) -> Handler:
        def run(ident: bytes, m, now: float) -> Outbox:
            self.client_seen[ident] = now
            return handler(ident, m, now)
        return run

    def backend_handlers(self) -> dict[type, Handler]:
        return {P.Hello: self.on_hello, P.Error: self.on_peer_error, P.DetokOutputs: self.on_detok_outputs,
                P.StepResult: self.on_step_result, P.Heartbeat: self.on_heartbeat, P.ProbeAck: self.on_probe_ack,
                P.Drain: self.on_drain, P.Goodbye: self.on_goodbye, P.WorkerError: self.on_worker_error,
                P.LoadStatus: self.on_load_status}

    # ================================================================ clients
    def on_submit(self, ident: bytes, m: P.Submit, now: float, resume: dict | None = None) -> Outbox:
        """A request; `resume`: what a re-attached one's completions already have (adoption.py)."""
        self.client_seen[ident] = now
        if (ident, m.request_id) in self.by_client:
            raise InvalidRequest(f"request id {m.request_id!r} is already running on this client")
        if m.prompt is not None and m.prompt_token_ids is None:
            split_prompt(m.prompt)  # refused the same way on every path (an empty text is no prompt)
        if m.messages is not None:  # bounded before the chat template and the tokenizer see it
            check_text_size(sum(len(x.content.encode("utf-8", "surrogatepass")) for x in m.messages),
                            "the conversation's text")
        params, _ = self.loras.resolve(m.params, m.params.model)  # model = an adapter's name: its parent
        model = params.model or self.default_model
        why = self.pool.refusal(model)
        if why:
            raise ModelLoadError(why)
        if model not in self.models:
            served = sorted(self.models)
            raise InvalidRequest(f"model {model!r} is not served by this cluster; served models: {served}"
                                 if served else "this scheduler serves no model; start it with --model DIR "
                                                "or --models-dir DIR")
        if model in self.pool.catalog and not self.groups.ready(model) and sum(
                live.model == model for live in self.pending) >= self.cfg.max_waiting_per_model:
            raise Overloaded(f"{self.cfg.max_waiting_per_model} requests already wait for model {model!r} to "
                             "load (max_waiting_per_model); retry later")
        if len(self.live) >= self.cfg.max_queue_len:
            self.metrics.refused()
            raise Overloaded(f"the cluster holds {len(self.live)} requests (max_queue_len); retry later "
                             "or add workers")
        params = with_model_defaults(params, m.model_defaults, self.models[model].sampling_defaults)
        self.pool.requested(model, params.keep_alive)
        pooling = None
        if m.kind == "embed":  # a prefill whose answer is a vector: its own params (its adapter kept), the
            # model's pooling
            params, pooling = (SamplingParams(max_tokens=1, model=model, lora=params.lora),
                               m.pooling or self.models[model].pooling)
        key = str(next(self.keys))
        self.live[key] = Live(key, m.request_id, ident, model, params, [], [], created=now,
                              deadline=now + m.timeout_s if m.timeout_s else None, resume=resume, pooling=pooling)
        self.by_client[(ident, m.request_id)] = key
        so = params.structured_outputs  # its grammar compiles in the shell's pool, with the prompt
        if m.prompt_token_ids is not None and so is None:
            return self.on_tokenized(key, m.prompt_token_ids.tolist(), None, now)
        ob = Outbox()
        if m.prompt_token_ids is not None:
            ob.tokenize_prompt(key, model, None, ids=m.prompt_token_ids.tolist(), constraint=so)
        elif m.messages is not None:  # fields a message leaves out stay out (templates test `is defined`)
            conv = [{k: v for k, v in msgspec.structs.asdict(x).items() if v is not None} for x in m.messages]
            ob.tokenize_prompt(key, model, None, conv, constraint=so, tools=m.tools)
        else:
            ob.tokenize_prompt(key, model, m.prompt, constraint=so)
        return ob

    def on_tokenized(self, key: str, ids: list[int] | None, err: Exception | None, now: float,
                     grammar: object = None) -> Outbox:
        """A prompt's token ids (or the tokenizer's or grammar compiler's error) for request `key`;
        `grammar`: its compiled structured-outputs constraint."""
        ob = Outbox()
        live = self.live.get(key)
        if live is None:
            return ob  # aborted meanwhile
        try:
            if isinstance(err, ZeroserveError):  # e.g. a model without a chat template: its own words
                raise err
            if err is not None:
                raise InvalidRequest(f"the prompt could not be tokenized: {err}")
            self._admit(live, ids, grammar)
        except ZeroserveError as e:
            self._fail(live, e, ob)
        return ob

    def on_abort(self, ident: bytes, m: P.Abort, now: float) -> Outbox:
        self.client_seen[ident] = now
        ob = Outbox()
        key = self.by_client.get((ident, m.request_id))
        if key is not None:
            self._abort(self.live[key], "abort", ob)
        return ob

    def on_reattach(self, ident: bytes, m: P.Reattach, now: float) -> Outbox:
        """A request another scheduler instance left open, with what its client received."""
        sub, resume = adoption.as_submit(m)
        return self.on_submit(ident, sub, now, resume)

    def on_ping(self, ident: bytes, m: P.Ping, now: float) -> Outbox:
        self.client_seen[ident] = now
        ob = Outbox()
        unknown = [rid for rid in m.request_ids if (ident, rid) not in self.by_client]
        ob.to_client(ident, P.Pong(nonce=m.nonce, scheduler_id=self.id, unknown=unknown))
        return ob

    def on_stats_request(self, ident: bytes, m: P.StatsRequest, now: float) -> Outbox:
        self.client_seen[ident] = now
        ob = Outbox()
        ob.to_client(ident, P.StatsReply(stats=self.stats(now)))
        return ob

    def on_metrics_request(self, ident: bytes, m: P.MetricsRequest, now: float) -> Outbox:
        self.client_seen[ident] = now
        self.metrics.refresh(self, now)
        ob = Outbox()
        ob.to_client(ident, P.MetricsReply(text=self.metrics.text()))
        return ob

    def on_models_request(self, ident: bytes, m: P.ModelsRequest, now: float) -> Outbox:
        self.client_seen[ident] = now
        ob = Outbox()
        ob.to_client(ident, self._models_reply())
        return ob

    def on_models_control(self, ident: bytes, m: P.ModelsControl, now: float) -> Outbox:
        self.client_seen[ident] = now
        ob = Outbox()
        self._requeue(self.pool.control(m, now, ob), ob)
        self._requeue(self.pool.plan(now, [live.model for live in self.pending], ob), ob)
        ob.to_client(ident, self._models_reply())
        return ob

    def _models_reply(self) -> P.ModelsReply:
        """Every model: those given with --model, then the catalog's (with the pool's state), then
        the LoRA adapters (each a copy of its base model's card with `parent`)."""
        waiting = Counter(live.model for live in self.pending)
        cards = []
        for name in dict.fromkeys([*self.models, *self.pool.catalog]):
            info, entry = self.models.get(name), self.pool.catalog.get(name)
            groups = len(self.groups.ready(name))
            state, reason = self.pool.state(name) if entry else ("loaded" if groups else "available", "")
            cards.append(P.ModelCard(
                id=name, max_model_len=self.groups.max_model_len(name) if info else 0, groups=groups,
                tool_call_parser=info.tool_call_parser if info else "", state=state, reason=reason[:4096],
                pinned=bool(entry and entry.pinned), waiting=waiting.get(name, 0)))
        by_id = {c.id: c for c in cards}
        adapters = [msgspec.structs.replace(by_id[parent], id=name, parent=parent)  # served where its base is
                    for name, parent in self.loras.registry.cards() if parent in by_id]
        return P.ModelsReply(models=[*cards, *adapters])

    # ================================================================ requests
    def _admit(self, live: Live, ids: list[int], grammar: object = None) -> None:
        vocab = self.models[live.model].cfg.vocab_size
        max_len = self.groups.max_model_len(live.model)
        check_prompt_ids(ids, vocab, max_len)
        check_params_for_model(live.params, vocab)
        live.prompt_ids = ids
        _, lora_path = self.loras.resolve(live.params, live.model)  # still served (not unloaded meanwhile)?
        live.seqs = [Seq(r) for r in fan_out(live.key, ids, live.params, self.rng, max_len, grammar)]
        for s in live.seqs:
            s.req.lora_path = lora_path
            s.req.pooling = live.pooling
        if live.resume is not None:
            adoption.resume(live, live.resume, vocab)
            if all(s.done for s in live.seqs):  # every completion had ended: nothing left to run
                self._forget(live)
                return
        self.delivery.add(live)
        self.metrics.admitted(live)
        self._route(live)

    def _route(self, live: Live) -> None:
        """Pick the group for a request: prefix-cache hits first, then the least loaded."""
        best, best_key = None, None
        lora_path = live.seqs[0].req.lora_path if live.seqs else None
        for g in self.groups.ready(live.model):
            if lora_path is not None and not g.policy.max_loras_per_batch:
                continue  # its workers serve no adapters (no --enable-lora)
            hit = g.policy.bm.num_cached_prefix_tokens(live.prompt_ids, lora_path) if live.prompt_ids else 0
            crowded = g.load() >= g.policy.max_num_seqs  # a hit is worth little behind a full batch
            key = (not crowded and hit > 0, hit if not crowded else 0, -g.load(), g.policy.bm.num_free_blocks)
            if best_key is None or key > best_key:
                best, best_key = g, key
        if best is None:
            live.group = None
            self.pending.append(live)
            return
        live.group = best.name
        for s in live.seqs:
            if not s.req.finished:
                best.policy.add_request(s.req)

    def _route_pending(self) -> None:
        pending, self.pending = self.pending, []
        for live in pending:
            self._route(live)

    def _requeue(self, reqs: list[Request], ob: Outbox) -> None:
        """Route again the requests of groups that ended; they keep the tokens they have. One
        whose groups died under it more than max_failovers times ends with an error instead
        (it may be what kills them)."""
        lives: dict[str, Live] = {}
        for r in reqs:
            ref = self.delivery.get(r.req_id)
            if ref is not None:
                lives[ref.live.key] = ref.live
        for live in lives.values():
            n = self.groups.failovers.get(live.key, 0)
            if n > self.cfg.max_failovers:
                log.warning("request failed over too often; ending it", request=live.request_id, failovers=n)
                self._fail(live, ZeroserveError(
                    f"request {live.request_id!r} lost its worker group {n} times (more than --max-failovers "
                    f"{self.cfg.max_failovers}); it is not run again: it may be what makes the workers fail"), ob)
                continue
            self.metrics.requeued(live.model)
            self._route(live)

    def _fail(self, live: Live, err: ZeroserveError, ob: Outbox) -> None:
        ob.to_client(live.client, P.Error.from_exception(err, live.request_id))
        self._forget(live)

    def _abort(self, live: Live, reason: str, ob: Outbox) -> None:
        g = self.groups.get(live.group)
        if g is not None and g.policy is not None:
            for s in live.seqs:
                g.policy.finish_request(s.req.req_id, reason)
        self.delivery.abort(live, reason, ob)
        self.metrics.finished(live, time.monotonic(), "abort")
        self._forget(live)

    def _forget(self, live: Live) -> None:
        self.metrics.forget(live.key)
        self.groups.failovers.pop(live.key, None)
        self.live.pop(live.key, None)
        self.by_client.pop((live.client, live.request_id), None)
        self.delivery.remove(live)
        if live in self.pending:
            self.pending.remove(live)

    # ================================================================ workers
    def on_hello(self, ident: bytes, h: P.Hello, now: float) -> Outbox:
        ob = Outbox()
        reason = check_version(h)
        if reason:
            self.groups.refuse(ident, reason, ob)
        elif h.role == "detokenizer" and self.delivery.held(ident, now, self._detok_alive_s()):
            if ident not in self.delivery.waiting and _PEER_ERROR_LOG.allow(now):
                log.warning("a second detokenizer said HELLO while one is alive; it waits",
                            worker=h.worker_id, live=self.delivery.detok.worker_id)
            self.delivery.wait(ident, h)
        elif h.role == "detokenizer":
            self.delivery.joined(ident, h, now, list(self.live.values()), ob)
        else:
            handled, orphans = self.pool.on_hello(ident, h, now, ob) if h.pool else (False, [])
            self._requeue(orphans if handled else orphans + self.groups.hello(ident, h, now, ob), ob)
            self._fail_unloadable(ob)  # a member's model in another numeric mode failed its load
        return ob

    def on_load_status(self, ident: bytes, m: P.LoadStatus, now: float) -> Outbox:
        ob = Outbox()
        self.pool.on_load_status(ident, m, now)
        self._fail_unloadable(ob)
        return ob

    def _fail_unloadable(self, ob: Outbox) -> None:
        """Waiting requests for a model the pool marked failed end; every other model's go on."""
        for live in [x for x in self.pending if self.pool.refusal(x.model)]:
            self._fail(live, ModelLoadError(self.pool.refusal(live.model)), ob)

    def on_peer_error(self, ident: bytes, m: P.Error, now: float) -> Outbox:
        if _PEER_ERROR_LOG.allow(now):
            log.warning("peer reported an error", code=m.code, message=m.message)
        return Outbox()

    def _from_worker(self, ident: bytes, msg, now: float, ob: Outbox):
        """(group, shard) of a worker message; None to ignore it (the detokenizer's are its own)."""
        if self.delivery.own(ident, msg, now):
            return None
        return self.groups.sender(ident, msg, now, ob)

    def on_step_result(self, ident: bytes, m: P.StepResult, now: float) -> Outbox:
        ob = Outbox()
        src = self._from_worker(ident, m, now, ob)
        if src is not None:
            g = src[0]
            inflight = g.in_flight
            try:
                events = self.groups.step_result(g, m)
            except BadStepResult as e:  # a group that answers nonsense is not trusted again
                log.error("bad step result; ending the group", group=g.name, worker=m.worker_id, reason=str(e))
                self._requeue(self.groups.gone(g, f"bad step result from {m.worker_id}: {e}", ob), ob)
                return ob
            if events is not None:
                self.metrics.step(g, inflight.step, inflight.sent_at, self.delivery)
                if self.overlap:  # the next step goes first in the outbox, so the group
                    self.groups.dispatch(g, now, ob)  # computes it while the shell routes outputs
                self._accept(events, now)
        return ob

    def on_heartbeat(self, ident: bytes, m: P.Heartbeat, now: float) -> Outbox:
        ob = Outbox()
        if m.term:  # a peer that knows several schedulers: the answer tells it this one is alive and active
            ob.to_backend(ident, P.Pong(nonce=0, scheduler_id=self.id))
        if self.pool.on_heartbeat(ident, m, now):  # a pool member outside any group
            return ob
        src = self._from_worker(ident, m, now, ob)
        if src is not None:
            src[1].stats = m.stats
        return ob

    def on_probe_ack(self, ident: bytes, m: P.ProbeAck, now: float) -> Outbox:
        ob = Outbox()
        src = self._from_worker(ident, m, now, ob)
        if src is not None and self.groups.probe_ack(src[0], src[1], m):
            self._route_pending()
        return ob

    def on_drain(self, ident: bytes, m: P.Drain, now: float) -> Outbox:
        ob = Outbox()
        src = self._from_worker(ident, m, now, ob)
        if src is not None:
            self.groups.drain(src[0], m.worker_id, now)
        return ob

    def on_goodbye(self, ident: bytes, m: P.Goodbye, now: float) -> Outbox:
        ob = Outbox()
        if self.pool.on_goodbye(ident, m.worker_id):
            return ob
        src = self._from_worker(ident, m, now, ob)
        if src is not None:
            self._requeue(self.groups.gone(src[0], f"worker {m.worker_id} left: {m.reason}", ob), ob)
        return ob

    def on_worker_error(self, ident: bytes, m: P.WorkerError, now: float) -> Outbox:
        ob = Outbox()
        src = self._from_worker(ident, m, now, ob)
        if src is not None:
            log.error("worker error", worker=m.worker_id, seq=m.seq, message=m.message)
            self._requeue(self.groups.gone(src[0], f"worker {m.worker_id} failed: {m.message}", ob), ob)
        return ob

    def on_detok_outputs(self, ident: bytes, m: P.DetokOutputs, now: float) -> Outbox:
        for live in self.delivery.on_outputs(ident, m, now, self._stop_string):
            self.metrics.finished(live, now)
            self._forget(live)
        return Outbox()

    def _stop_string(self, live: Live, s: Seq, stop: str) -> None:
        g = self.groups.get(live.group)
        if g is not None and g.policy is not None and not s.req.finished:
            g.policy.finish_request(s.req.req_id, "stop", stop)

    def _accept(self, events, now: float) -> None:
        if any(ev.embedding is not None for ev in events):
            for live in self.delivery.embedded(events, now):  # their one Output goes to the client now
                self.metrics.finished(live, now)
                self._forget(live)
            events = [ev for ev in events if ev.embedding is None]
        n = self.delivery.accept(events)
        self.tokens_total += n
        self.rate_window.append(Rate(now, n))

    def flush(self) -> Outbox:
        """What this loop turn produced: tokens for the detokenizer, one Outputs per client."""
        ob = Outbox()
        self.delivery.flush(ob)
        return ob

    # ================================================================ steps and timers
    def dispatch(self, now: float) -> Outbox:
        ob = Outbox()
        self.groups.dispatch_all(now, ob)
        return ob

    def tick(self, now: float) -> Outbox:
        ob = Outbox()
        self.groups.probe(now, ob)
        if now - self.last_checks < CHECK_INTERVAL_S:
            return ob
        self.last_checks = now
        self._requeue(self.groups.check(now, ob), ob)
        self._requeue(self.pool.check(now, ob), ob)
        self._requeue(self.pool.plan(now, [live.model for live in self.pending], ob), ob)
        self._fail_unloadable(ob)
        self.metrics.refresh(self, now)
        self.delivery.check(now, self.cfg.heartbeat_timeout_s)
        for ident, h in reversed(list(self.delivery.waiting.items())):  # the live one went silent: the newest takes over
            if not self.delivery.held(ident, now, self._detok_alive_s()):
                self.delivery.joined(ident, h, now, list(self.live.values()), ob)
                break
        for live in list(self.live.values()):
            if live.deadline is not None and now > live.deadline:
                ob.to_client(live.client, P.Error(
                    request_id=live.request_id, code="timeout",
                    message=f"request {live.request_id!r} did not finish within its timeout"))
                self._abort(live, "abort", ob)
            elif now - self.client_seen.get(live.client, now) > self.cfg.client_timeout_s:
                log.info("client silent; aborting its request", request=live.request_id)
                self._abort(live, "abort", ob)
            elif live.group is None and now - live.created > self.cfg.no_worker_timeout_s:
                self._fail(live, RequestTimeout(
                    f"no worker serving model {live.model!r} became available within "
                    f"{self.cfg.no_worker_timeout_s:.0f}s; start a worker for it"), ob)
        for c in [c for c, t in self.client_seen.items() if now - t > 3 * self.cfg.client_timeout_s]:
            del self.client_seen[c]
        if now - self.last_stats >= self.cfg.stats_interval_s:
            self.last_stats = now
            ob.event(b"stats", P.Event(kind="stats", ts=time.time(), data=self.stats(now)))
        return ob

    def _detok_alive_s(self) -> float:
        return min(DETOK_ALIVE_S, self.cfg.heartbeat_timeout_s / 2)

    def close(self) -> Outbox:
        ob = Outbox()
        self.groups.close(ob)
        return ob

    # ================================================================ introspection
    def tokens_per_s(self, now: float) -> float:
        self.rate_window = [r for r in self.rate_window if now - r.t <= 10.0]
        if not self.rate_window:
            return 0.0
        span = max(now - self.rate_window[0].t, 1.0)
        return sum(r.tokens for r in self.rate_window) / span

    def stats(self, now: float) -> dict:
        return {
            "scheduler_id": self.id, "role": "active", "term": self.term, "uptime_s": round(now - self.started, 3),
            "addresses": self.addresses,
            "models": list(self.models), "groups": self.groups.stats(now), "requests": len(self.live),
            "numeric_modes": dict(self.groups.model_modes), "refused": list(self.groups.refusals),
            "queue": len(self.pending), "tokens_total": self.tokens_total,
            "tokens_per_s": round(self.tokens_per_s(now), 2),
            "detokenizer": {"connected": self.delivery.detok is not None,
                            "worker_id": self.delivery.detok.worker_id if self.delivery.detok else None},
            "metrics": self.metrics.summary(),  # key figures of services/scheduler/metrics.py
            "pool": self.pool.stats(now, Counter(live.model for live in self.pending)),
        }


__all__ = ["Cluster", "Live", "ModelInfo", "Seq"]
