"""Delivery of generated tokens, free of sockets: to the detokenizer, then as text to clients.

Per sequence the scheduler counts tokens accepted from the policy, sent to the detokenizer
and delivered to the client (with the text characters delivered), so a (re)joining
detokenizer can be handed every live sequence's state: `DetokNew` with the tokens the client
already has and its text offset (fed without emitting text), then the rest as usual. Streams
go on without loss or repeats. One `DetokTokens` per loop turn carries every sequence's new
tokens; its `DetokOutputs` becomes one `Output` per sequence, batched per client.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import numpy as np

from zeroserve.common import messages as P
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.log import get_logger
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.services.scheduler.outbox import Outbox
from zeroserve.services.scheduler.policy import TokenEvent
from zeroserve.services.scheduler.request import Request

log = get_logger("scheduler")


@dataclass
class Seq:
    """One completion of a live request, as the scheduler tracks its delivery."""

    req: Request
    sent: int = 0  # output tokens handed to the detokenizer
    delivered: int = 0  # output tokens delivered to the client
    lp: list = field(default_factory=list)  # logprob rows of accepted tokens, (ids, lps, rank)
    chars: int = 0  # text characters delivered
    finish_reason: str | None = None  # set when the policy ended it; final Output pending
    hide_last: bool = False  # it ended on a stop token whose text stays out of the output
    done: bool = False  # final Output sent


@dataclass
class Live:
    """A client request, from Submit to its last Output."""

    key: str
    request_id: str
    client: bytes
    model: str
    params: SamplingParams
    prompt_ids: list[int]  # empty until tokenized
    seqs: list[Seq]
    group: str | None = None  # where its sequences run; None = waiting for a group
    deadline: float | None = None
    created: float = 0.0
    sent_first: bool = False
    pooling: str | None = None  # an embedding request: no text, the detokenizer never sees it


class SeqRef(NamedTuple):
    live: Live
    seq: Seq


@dataclass
class Pending:
    """Tokens accepted for a sequence but not yet sent to the detokenizer."""

    count: int = 0
    reason: str | None = None  # the finish reason to send with them


class Sent(NamedTuple):
    """A sequence's share of a DetokTokens batch still waiting for its DetokOutputs."""

    count: int
    reason: str | None


@dataclass
class DetokLink:
    ident: bytes
    worker_id: str
    last_seen: float


DETOK_ALIVE_S = 2.5  # heard from within this (heartbeats come every second): the detokenizer is alive
MAX_WAITING_DETOKS = 4  # newcomers held while it is


class Delivery:
    def __init__(self, scheduler_id: str) -> None:
        self.scheduler_id = scheduler_id
        self.detok: DetokLink | None = None
        self.waiting: dict[bytes, P.Hello] = {}  # detokenizers that said HELLO while one was alive
        self.detok_seq = itertools.count(1)
        self.detok_new: list[P.DetokRequest] = []  # sequences the detokenizer has not seen
        self.detok_tokens: dict[str, Pending] = {}  # seq id -> tokens to send at the next flush
        self.detok_inflight: dict[int, dict[str, Sent]] = {}  # DetokTokens seq -> its sequences
        self.seq_index: dict[str, SeqRef] = {}  # internal seq id ("key#i") -> its request and sequence
        self.out_buf: dict[bytes, list[P.Output]] = {}  # client -> Outputs items of this loop turn
        self.metrics = None  # services/scheduler/metrics.SchedulerMetrics, set by the cluster

    # ================================================================ sequences
    def add(self, live: Live) -> None:
        """A request just admitted: index its sequences, introduce them to the detokenizer."""
        for s in live.seqs:
            self.seq_index[s.req.req_id] = SeqRef(live, s)
            if live.pooling is None:
                self.detok_new.append(self._detok_request(live, s))

    def embedded(self, events: list[TokenEvent], now: float) -> list[Live]:
        """Embedding requests the policy finished: one Output each with the vector (the
        detokenizer has no part in them); returns their requests, which have ended."""
        out = []
        for ev in events:
            ref = self.seq_index.get(ev.req.req_id) if ev.embedding is not None else None
            if ref is None or ref.seq.done:
                continue
            live, s = ref
            self.output(live, s, [], "", "stop", None, now=now)
            self.out_buf[live.client][-1].embedding = np.asarray(ev.embedding, np.float32)
            s.done = True
            out.append(live)
        return out

    def remove(self, live: Live) -> None:
        for s in live.seqs:
            self.seq_index.pop(s.req.req_id, None)
            self.detok_tokens.pop(s.req.req_id, None)
        # admitted and gone within one loop turn: never introduce it to the detokenizer (its
        # DetokFree went out first, so the state a late DetokNew made would never be freed)
        if self.detok_new:
            gone = {s.req.req_id for s in live.seqs}
            self.detok_new = [d for d in self.detok_new if d.req_id not in gone]

    def get(self, req_id: str) -> SeqRef | None:
        return self.seq_index.get(req_id)

    def accept(self, events: list[TokenEvent]) -> int:
        """Tokens the policy accepted; returns how many counted (live ones)."""
        n = 0
        for ev in events:
            ref = self.seq_index.get(ev.req.req_id)
            if ref is None:
                continue
            s = ref.seq
            if ref.live.params.logprobs is not None and ev.logprobs is not None:
                s.lp.append(ev.logprobs)
            if ev.finished:
                s.finish_reason = ev.req.finish_reason
                s.hide_last = ev.req.hides_stop_token_text
            t = self.detok_tokens.setdefault(ev.req.req_id, Pending())
            t.count += 1
            t.reason = s.finish_reason
            n += 1
        return n

    def abort(self, live: Live, reason: str, ob: Outbox) -> None:
        """Final outputs for the sequences still open; the detokenizer drops their state."""
        free = []
        for s in live.seqs:
            if not s.done:
                self.output(live, s, [], "", reason, None)
                s.done = True
                free.append(s.req.req_id)
        if free and self.detok is not None:
            ob.to_backend(self.detok.ident, P.DetokFree(req_ids=free))

    # ================================================================ the detokenizer link
    def held(self, ident: bytes, now: float, alive_s: float = DETOK_ALIVE_S) -> bool:
        """A live detokenizer (heard from within ``alive_s``) on another connection: a newcomer
        waits (it says HELLO again) instead of taking the streams over. One that died is silent
        from then on, so its successor gets in within ``alive_s``."""
        d = self.detok
        return d is not None and d.ident != ident and now - d.last_seen < alive_s

    def wait(self, ident: bytes, h: P.Hello) -> None:
        """Keep a held newcomer's HELLO (the newest few): it is answered when the live one goes silent."""
        self.waiting.pop(ident, None)
        self.waiting[ident] = h
        while len(self.waiting) > MAX_WAITING_DETOKS:
            del self.waiting[next(iter(self.waiting))]

    def joined(self, ident: bytes, h: P.Hello, now: float, lives: list[Live], ob: Outbox) -> None:
        self.waiting.clear()
        log.info("detokenizer joined", worker=h.worker_id, pid=h.pid)
        self.detok = DetokLink(ident, h.worker_id, now)
        ob.to_backend(ident, P.Welcome(status="accepted", scheduler_id=self.scheduler_id))
        self._replay(lives)

    def own(self, ident: bytes, msg, now: float) -> bool:
        """True for the detokenizer's lifecycle messages (it sends Heartbeat and Goodbye too)."""
        d = self.detok
        if d is None or msg.worker_id != d.worker_id:
            return False
        if ident != d.ident:
            raise InvalidRequest(f"{type(msg).__name__} for detokenizer {msg.worker_id!r} from another connection")
        d.last_seen = now
        if isinstance(msg, P.Goodbye):
            self.detok = None
        return True

    def check(self, now: float, timeout_s: float) -> None:
        if self.detok is not None and now - self.detok.last_seen > timeout_s:
            log.warning("detokenizer silent; waiting for it to come back", worker=self.detok.worker_id)
            self.detok = None

    def _detok_request(self, live: Live, s: Seq, replay: bool = False) -> P.DetokRequest:
        out = s.req.output_token_ids[:s.delivered] if replay else []
        return P.DetokRequest(req_id=s.req.req_id, prompt_token_ids=np.asarray(live.prompt_ids, np.int32),
                              params=live.params, output_token_ids=np.asarray(out, np.int32),
                              text_offset=s.chars if replay else 0)

    def _replay(self, lives: list[Live]) -> None:
        """A (new) detokenizer: give it every live sequence's state, then what it has not seen."""
        self.detok_inflight.clear()
        self.detok_new = []
        self.detok_tokens.clear()
        for live in lives:
            for s in live.seqs:
                if s.done or not live.prompt_ids or live.pooling is not None:
                    continue
                self.detok_new.append(self._detok_request(live, s, replay=True))
                s.sent = s.delivered
                pending = s.req.num_output_tokens - s.delivered
                if pending or s.finish_reason:
                    self.detok_tokens[s.req.req_id] = Pending(pending, s.finish_reason)

    def _flush_detok(self, ob: Outbox) -> None:
        if self.detok is None or not (self.detok_new or self.detok_tokens):
            return
        to = self.detok.ident
        if self.detok_new:
            new, self.detok_new = self.detok_new, []
            ob.to_backend(to, P.DetokNew(items=new), on_fail=partial(self._new_unsent, new))
        if not self.detok_tokens:
            return
        seq = next(self.detok_seq)
        ids, toks, reasons, entry = [], [], [], {}
        for rid, p in self.detok_tokens.items():
            s = self.seq_index[rid].seq
            new = s.req.output_slice(s.sent, s.sent + p.count)
            ids.append(rid)
            toks.append(new[:-1] if s.hide_last and p.reason is not None and new else new)
            reasons.append(p.reason)
            entry[rid] = Sent(len(new), p.reason)
            s.sent += len(new)
        pending, self.detok_tokens = self.detok_tokens, {}
        self.detok_inflight[seq] = entry
        # the shell sends a peer nothing more after a failed send, so a DetokTokens never
        # overtakes the DetokNew it depends on
        ob.to_backend(to, P.DetokTokens.build(seq, ids, toks, reasons),
                      on_fail=partial(self._tokens_unsent, seq, pending))

    def _new_unsent(self, items: list[P.DetokRequest]) -> None:
        self.detok_new[:0] = items

    def _tokens_unsent(self, seq: int, pending: dict[str, Pending]) -> None:
        """Take a DetokTokens back: its tokens go out with the next flush."""
        for rid, sent in self.detok_inflight.pop(seq, {}).items():
            ref = self.seq_index.get(rid)
            if ref is not None:
                ref.seq.sent -= sent.count
        for rid, p in pending.items():
            if rid not in self.seq_index:
                continue
            cur = self.detok_tokens.get(rid)
            if cur is None:
                self.detok_tokens[rid] = p
            else:
                cur.count += p.count

    def on_outputs(self, ident: bytes, m: P.DetokOutputs, now: float,
                   stop: Callable[[Live, Seq, str], None]) -> list[Live]:
        """Text deltas for a DetokTokens batch -> client Outputs; returns the requests that
        ended. `stop(live, seq, stop_str)` ends a sequence a stop string hit in its policy."""
        if self.detok is None or ident != self.detok.ident:
            raise InvalidRequest("DetokOutputs comes from a connection that is not the detokenizer's")
        self.detok.last_seen = now
        entry = self.detok_inflight.pop(m.seq, None)
        if entry is None:
            return []
        ended: dict[str, Live] = {}
        for i, (rid, text, stop_str) in enumerate(zip(m.req_ids, m.text_deltas, m.stop_strs)):
            ref = self.seq_index.get(rid)
            if ref is None or rid not in entry:
                continue
            live, s = ref
            if s.done:
                continue
            reason, count = entry[rid].reason, entry[rid].count
            if stop_str is not None:
                stop(live, s, stop_str)
                reason = "stop"
                s.req.finish_reason, s.req.stop_reason = "stop", stop_str
                if m.stop_tokens and 0 <= m.stop_tokens[i] < count:
                    count = m.stop_tokens[i]  # the output ends on the token that completed the stop string
            start = s.delivered
            toks = s.req.output_slice(start, start + count)
            s.delivered += len(toks)
            s.chars += len(text)
            self.output(live, s, toks, text, reason, s.req.stop_reason if reason == "stop" else None, start, now)
            if self.metrics is not None:
                self.metrics.output(live, s, len(toks), now)
            if reason is not None:
                s.done = True
                self.detok_tokens.pop(rid, None)
                if all(x.done for x in live.seqs):
                    ended[live.key] = live
        return list(ended.values())

    # ================================================================ clients
    def output(self, live: Live, s: Seq, toks: list[int], text: str, reason: str | None, stop_reason,
               lp_start: int | None = None, now: float | None = None) -> None:
        o = P.Output(request_id=live.request_id, index=s.req.index, token_ids=toks, text=text,
                     finish_reason=reason, stop_reason=stop_reason)
        if lp_start is not None and live.params.logprobs is not None and toks:
            rows = s.lp[lp_start:lp_start + len(toks)]
            if len(rows) == len(toks):
                k = 1 + live.params.logprobs
                o.logprob_token_ids = np.stack([r[0][:k] for r in rows]).astype(np.int32)
                o.logprobs = np.stack([r[1][:k] for r in rows]).astype(np.float32)
                o.ranks = np.asarray([r[2] for r in rows], np.int32)
        if not live.sent_first:
            live.sent_first = True
            o.prompt_token_ids = np.asarray(live.prompt_ids, np.int32)
            o.num_cached_tokens = max(x.req.num_cached_tokens for x in live.seqs)
            if toks and now is not None:  # a first Output without tokens (an abort) has no first-token time
                o.first_token_latency = max(0.0, now - live.created)
        self.out_buf.setdefault(live.client, []).append(o)

    def flush(self, ob: Outbox) -> None:
        """What this loop turn produced: tokens for the detokenizer, one Outputs per client."""
        self._flush_detok(ob)
        for client, items in self.out_buf.items():
            ob.to_client(client, P.Outputs(items=items))
        self.out_buf = {}
