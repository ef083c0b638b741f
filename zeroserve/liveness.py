"""The client's side of liveness: Pings while requests are live, and what a scheduler restart means.

``AsyncClient`` mixes this in. Every ``Pong`` names the scheduler (``scheduler_id``, new at each
start); a request belongs to the scheduler that answers the first Ping sent after its Submit, so
a Pong from another one means the old scheduler is gone and the new one does not hold the
request. The client re-attaches it (``Reattach``: the original Submit under a new wire id and
what it received; services/scheduler/adoption.py): the new scheduler recomputes its tokens so
far and the stream goes on where it stopped, with the same tokens. A request whose received
tokens exceed the client's ``reattach_max_tokens`` (or every request, with ``reattach=False``)
fails with ``ClusterUnavailable`` instead, or, with ``retries=N`` and no output yet, is
submitted again.

With several scheduler addresses (a hot standby: ``AsyncClient("tcp://a:7000,tcp://b:7000")``,
common/failover.py) the client talks to one at a time and moves to the next when its connection
drops, when it is silent for 2 * NO_ANSWER_S while requests are live, when it answers as a
standby (after asking again every STANDBY_RETRY_S for up to STANDBY_WAIT_S: it may be taking
over) or when its term is older than one already seen (a deposed scheduler). The active one's
first Pong names a new scheduler: the requests re-attach as after a restart. Outputs and Pongs of
a lower term than the highest seen are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from zeroserve.common import messages as P
from zeroserve.common.codec import decode, encode
from zeroserve.common.errors import ClusterUnavailable
from zeroserve.common.failover import NO_ANSWER_S, STANDBY_DETAIL, STANDBY_RETRY_S, STANDBY_WAIT_S
from zeroserve._request import _Req

log = logging.getLogger("zeroserve.client")

RESTARTED = "the scheduler restarted; request lost, retry"
RESTARTED_OVER_LIMIT = ("the scheduler restarted and this request had received more tokens than the client keeps to "
                        "re-attach it (reattach_max_tokens); request lost, retry")


class LivenessMixin:
    """Ping / Pong bookkeeping and the liveness ticker of ``AsyncClient`` (state lives there)."""

    def _next_nonce(self) -> int:
        self._nonce = next(self._nonces)
        return self._nonce

    def _ping(self) -> P.Ping:
        """A Ping naming the requests no Pong confirmed yet (the newest MAX_PING_IDS)."""
        unconfirmed = [r.wire for r in self._reqs.values() if r.sid is None]
        return P.Ping(nonce=self._next_nonce(), request_ids=unconfirmed[-P.MAX_PING_IDS:],
                      term=self._fence.term if self._multi else 0)

    # ---------------------------------------------------------------- several schedulers
    def _switch(self, why: str) -> None:
        """Move the socket to the next scheduler address and look for the active one there."""
        sock = self._sock
        if sock is None or sock.closed:
            return
        old = self.address
        self._addr_i = (self._addr_i + 1) % len(self.addresses)
        self.address = self.addresses[self._addr_i]
        log.info("scheduler %s: %s; trying %s", old, why, self.address)
        try:
            sock.disconnect(old)
        except Exception:  # noqa: BLE001 - not connected any more
            pass
        sock.connect(self.address)
        self._seek()

    def _seek(self) -> None:
        """Ping the current address until an active scheduler answers (or move on)."""
        loop = self._loop
        self._seek_since, self._standby_since = loop.time(), None
        if self._seeker is None or self._seeker.done():
            self._seeker = loop.create_task(self._seeking(), name="zeroserve-client-failover")

    async def _seeking(self) -> None:
        loop = self._loop
        while self._seek_since is not None:
            self._send(self._ping())
            await asyncio.sleep(STANDBY_RETRY_S)
            if self._seek_since is None:
                return
            now = loop.time()
            if self._standby_since is not None:
                if now - self._standby_since > STANDBY_WAIT_S:
                    self._switch("a standby")
            elif now - max(self._seek_since, self._last_rx) > NO_ANSWER_S:
                self._switch("no answer")

    def _on_disconnect(self, endpoint: str) -> None:
        if self._multi and endpoint == self.address:
            self._switch("the connection dropped")

    async def _watch(self) -> None:
        """Several schedulers: a dropped connection (a scheduler that died) moves us on at once."""
        mon = self._mon
        while True:
            try:
                ev = parse_monitor_message(await mon.recv_multipart())
            except zmq.ZMQError:  # closed
                return
            self._on_disconnect(ev.get("endpoint", b"").decode(errors="replace"))

    async def _ask(self, msg: Any, reply_type: type) -> Any:
        """Send a question and await its answer; with several schedulers, the active one's."""
        loop = self._ensure_started()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                reply = await self._ask_once(msg, reply_type)
            except ClusterUnavailable as e:
                if not (self._multi and str(e).startswith(STANDBY_DETAIL)) or loop.time() > deadline:
                    raise
                reply = None
            if reply is not None and not (self._multi and reply_type is P.StatsReply
                                          and reply.stats.get("role") == "standby"):
                return reply
            if loop.time() > deadline:
                raise self._unavailable()
            if self._seek_since is None:  # a standby answered: find the active one
                self._seek()
            await asyncio.sleep(0.1)

    def _on_pong(self, m: P.Pong) -> None:
        """Which scheduler holds each live request; those a restarted one lost end or go again."""
        sid = m.scheduler_id
        if not sid:  # a scheduler that does not say who it is
            return
        if self._multi:
            if m.standby:  # the active one is elsewhere, or this one takes over soon: ask again
                if self._seek_since is None:
                    self._seek()
                if self._standby_since is None:
                    self._standby_since = self._loop.time()
                self._fence.admit(m.term)
                return
            if self._fence.stale(m.term):
                self._fence.admit(m.term)
                self._switch(f"deposed (term {m.term} < {self._fence.term})")
                return
            self._seek_since = None
        self._fence.admit(m.term)
        prev, self._scheduler_id = self._scheduler_id, sid
        switched = prev is not None and prev != sid
        unknown = set(m.unknown)
        lost = []
        for r in self._reqs.values():
            if r.sid == sid:
                continue
            if r.sid is None:
                if m.nonce <= r.nonce0:  # a Ping sent before the Submit: says nothing about it
                    continue
                if not switched and r.wire not in unknown:
                    r.sid = sid
                    continue
                # the first Pong of a new scheduler, for a Submit sent before its Ping, or a
                # scheduler that says it does not hold it (it restarted before any Pong reached
                # us): the Submit went to a scheduler that died; re-submitting under another
                # wire id is safe either way (the Abort frees a copy the new one got)
            lost.append(r)
        if lost:
            log.warning("the scheduler restarted (%s -> %s); %s %d live request(s)", prev, sid,
                        "re-attaching" if self.reattach else "lost", len(lost))
        for r in lost:
            if r.ended or r.frames is None:
                self._end(r, ClusterUnavailable(RESTARTED), abort=True)
            elif self.reattach and (r.kept is not None or not r.started):
                self._send(self._rewire(r, r.reattach))
            elif r.retries > 0 and not r.started:
                r.retries -= 1
                self._rewire(r, None)
                self._send_frames(r.frames)
            else:
                self._end(r, ClusterUnavailable(RESTARTED_OVER_LIMIT if self.reattach else RESTARTED), abort=True)

    def _rewire(self, r: _Req, make):
        """Move a request to a new wire id (rid~k) for the scheduler now answering: the Abort
        frees a copy it may hold under the old id (a Submit that reached it), and outputs for the
        old id are dropped from then on. Returns ``make(submit)`` (None: r.frames is the Submit)."""
        self._send(P.Abort(request_id=r.wire))
        if self._reqs.get(r.wire) is r:
            del self._reqs[r.wire]
        r.attempts += 1
        r.wire = f"{r.rid}~{r.attempts}"
        sub = decode(r.frames)
        sub.request_id = r.wire
        r.frames = encode(sub)
        r.sid, r.nonce0 = None, self._nonce
        self._reqs[r.wire] = r
        return make(sub) if make is not None else None

    async def _ticker(self) -> None:
        """While requests are live: Ping every interval, fail them all when the scheduler is silent."""
        loop = self._loop
        last_ping = loop.time()
        while True:
            if not self._reqs:
                self._live_evt.clear()
                await self._live_evt.wait()
                last_ping = loop.time()  # the Submit itself tells the scheduler we are alive
            now = loop.time()
            if now - last_ping >= self._ping_s:
                last_ping = now
                self._send(self._ping())
            last_rx = self._last_rx
            deadline = math.inf
            dead = []
            for r in self._reqs.values():
                due = max(last_rx, r.t0) + self.timeout_s
                if due <= now:
                    dead.append(r)
                elif due < deadline:
                    deadline = due
            for r in dead:
                self._end(r, self._unavailable(), abort=True)
            if (self._multi and self._reqs and self._seek_since is None
                    and now - last_rx > 2 * NO_ANSWER_S and now - last_ping < self._ping_s):
                self._switch("silent")
            await asyncio.sleep(max(0.0, min(last_ping + self._ping_s, deadline) - loop.time()) + 0.001)
