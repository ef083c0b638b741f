"""A backend peer's side of the scheduler connection: the one loop workers and the detokenizer share.

A backend peer (a worker shard or the detokenizer) holds a DEALER to the scheduler's backend
ROUTER and, through `BackendPeer`:

* joins: `join(hello, stop)` says HELLO until a WELCOME says "accepted" (it returns that Welcome),
  "refused" (raises `Refused` with the scheduler's reason) or "drained" (returns None, as does
  `stop` being set). HELLOs never block (a blocking send hangs while no connection exists, and
  then SIGTERM could not stop us); when nobody answers it logs a hint about CURVE keys.
  One live connection per identity: the scheduler's backend ROUTER never reads a second DEALER
  showing an identity in use, so a peer whose connection is up (handshake done) but whose
  HELLOs get no answer for DUPLICATE_AFTER_S is a duplicate: `join` raises `Refused` naming
  the identity (ranks > 0 of a TP group wait for rank 0 unanswered, so they do not conclude).
* heartbeats every `heartbeat_interval_s`: from the caller's loop on the main socket
  (`maybe_heartbeat`: the detokenizer), or from a thread with its own DEALER `<id>-hb`
  (`start_heartbeats`: a worker, whose steps may take longer than the scheduler's heartbeat
  timeout; the scheduler takes that identity as the worker's). Heartbeat sockets are IMMEDIATE:
  none pile up while the scheduler is away. A heartbeat also goes out as soon as a connection
  is (re)made: a restarted scheduler answers it "rejoin", so the peer joins again within
  milliseconds of the scheduler's start rather than up to an interval later (the streams of a
  restarted scheduler wait for that: services/scheduler/adoption.py).
* notices what the scheduler wants after WELCOME (`note(msg)` on every Welcome that arrives,
  from either socket): `rejoin` is set when it no longer knows us (a restarted scheduler answers
  an unknown peer's heartbeat with status "rejoin"; so does one that gave our group up, saying
  why: `rejoin_reason()` tells the two apart by the instance id), `drained` when it let our
  group go after a drain. The caller clears `rejoin` when it starts over; a worker's heartbeat
  thread exits the process when nobody does within STUCK_AFTER_S (its main thread is stuck in
  a collective), so a supervisor restarts it.
* fails over between schedulers (a hot standby: common/failover.py) when given several
  addresses (`--scheduler tcp://a:7001,tcp://b:7001`): it talks to one at a time and moves to the
  next when a standby answers (after asking it again for up to STANDBY_WAIT_S: it may be about to
  take over), when nothing answers a HELLO for NO_ANSWER_S, or, once joined, when the connection
  drops or the scheduler stops answering heartbeats (3 intervals). Leaving a scheduler that way
  counts as its restart (`rejoin_reason`): a worker reports the KV it kept. With several
  addresses it also fences by term (`fence`): its HELLOs and heartbeats say the highest term it
  has seen, and a Welcome (or a step, a detokenizer batch) of a lower one is dropped.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from zeroserve.common import messages as P
from zeroserve.common.codec import ProtocolError
from zeroserve.common.curve import CurveClientKeys
from zeroserve.common.failover import NO_ANSWER_S, STANDBY_RETRY_S, STANDBY_WAIT_S, Fence, split_addresses
from zeroserve.common.log import get_logger
from zeroserve.common.transport import Channel, make_socket

log = get_logger("backend_peer")

JOIN_WAIT_S = 5.0  # one HELLO waits this long for its WELCOME before the next
HINT_MAX_EVERY_S = 60.0  # the "no answer" hint comes after 5 s, then at doubling intervals up to this
STALE_HEARTBEATS = 3  # a "rejoin" this many intervals after WELCOME may answer a heartbeat sent before it
STUCK_AFTER_S = 10.0
CLOSE_CHECK_S = 0.25  # the heartbeat thread looks at close() this often
# connected yet never answered this long: another connection holds our identity (the scheduler
# drops a vanished peer's connection after 3 s of missed ZMTP heartbeats, well within this)
DUPLICATE_AFTER_S = 10.0


class Refused(Exception):
    """The scheduler refused our HELLO; ``detail`` says why."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class BackendPeer:
    def __init__(self, ctx: zmq.Context, scheduler_addr: str, peer_id: str, *, role: str,
                 curve: CurveClientKeys | None = None, heartbeat_interval_s: float = 1.0,
                 immediate: bool = False) -> None:
        """``immediate``: HELLOs and replies are only queued on a completed connection. A worker
        leaves it off: its step results queue across a reconnect instead of blocking the step."""
        self.ctx, self.id, self.role = ctx, peer_id, role
        self.addrs = split_addresses(scheduler_addr, "--scheduler")
        self.multi = len(self.addrs) > 1  # several schedulers (a standby): fail over, fence by term
        self._addr_i = 0
        self.fence = Fence()
        self.gone = ""  # why we left the last scheduler ourselves (it dropped, went silent, is a standby)
        self._heard = 0.0  # the last message from the scheduler (with several addresses: liveness)
        self.curve = curve
        self.socket_kw = curve.socket_kwargs() if curve else {}
        self.hb_interval = heartbeat_interval_s
        sock = make_socket(ctx, zmq.DEALER, identity=peer_id, immediate=immediate, **self.socket_kw)
        try:  # before connecting, so the first handshake is seen
            self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            sock.connect(self.scheduler_addr)
        except BaseException:
            sock.close(linger=0)
            raise
        self.ch = Channel(sock)
        self._main_addr = self.scheduler_addr  # where the main socket is connected
        self._up_since: float | None = None  # the connection's handshake time (None: not connected)
        self.rejoin = threading.Event()  # the scheduler does not know us (any more): start over
        self.drained = threading.Event()  # the scheduler let our group go after a drain: leave
        self._joined = threading.Event()
        self._joined_at = 0.0
        self.scheduler_id = ""  # the instance that welcomed us: a "rejoin" from another one means it restarted
        self.rejoin_welcome: P.Welcome | None = None  # the Welcome that set `rejoin` (its detail says why)
        self._closed = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._next_hb = 0.0

    @property
    def sock(self) -> zmq.Socket:
        return self.ch.sock

    @property
    def scheduler_addr(self) -> str:
        return self.addrs[self._addr_i]

    def _next_address(self, why: str) -> None:
        """Move on to the next scheduler address (each socket reconnects in its own thread)."""
        old = self.scheduler_addr
        self._addr_i = (self._addr_i + 1) % len(self.addrs)
        log.info("trying the next scheduler", was=old, now=self.scheduler_addr, why=why)

    def _follow_address(self) -> None:
        """The main socket onto the current address (the main thread's: it owns that socket)."""
        if self._main_addr != self.scheduler_addr:
            try:
                self.sock.disconnect(self._main_addr)
            except zmq.ZMQError:
                pass
            self.sock.connect(self.scheduler_addr)
            self._main_addr, self._up_since = self.scheduler_addr, None

    def _lost(self, why: str) -> None:
        """With several addresses: the scheduler we joined is gone (dropped, silent, deposed or a
        standby); start over on the next one, as after a restart."""
        if not self._joined.is_set():
            return
        self._joined.clear()
        self.gone = why
        self.rejoin_welcome = None
        self._next_address(why)
        self.rejoin.set()

    def _hello_msg(self, hello: Callable[[], P.Hello]) -> P.Hello:
        h = hello()
        if self.multi:
            h.term = self.fence.term
        return h

    # ------------------------------------------------------------------ joining
    def join(self, hello: Callable[[], P.Hello], stop: threading.Event,
             on_message: Callable[[Any], None] | None = None) -> P.Welcome | None:
        """HELLO until WELCOME; other messages that arrive meanwhile go to ``on_message``."""
        self._joined.clear()
        hint_at, hint_every = time.monotonic() + JOIN_WAIT_S, JOIN_WAIT_S
        heard = time.monotonic()  # the last time anything came from the scheduler
        tried_at, standby_since = time.monotonic(), None  # on this address
        while not stop.is_set():
            self._follow_address()
            h = self._hello_msg(hello)
            self._watch_connection()
            now = time.monotonic()
            if self.multi and (standby_since is not None and now - standby_since > STANDBY_WAIT_S
                               or standby_since is None and now - max(tried_at, heard) > NO_ANSWER_S):
                self._next_address("a standby" if standby_since is not None else "no answer")
                tried_at, standby_since = now, None
                continue
            up = self._up_since
            if h.tp_rank == 0 and up is not None and time.monotonic() - max(up, heard) > DUPLICATE_AFTER_S:
                raise Refused(f"the scheduler at {self.scheduler_addr} accepts this connection but never reads it: "
                              f"another live connection already uses the identity {self.id!r} (a second {self.role} "
                              f"with the same id, e.g. a duplicate --worker-id {self.id}); give each one a unique id")
            if time.monotonic() >= hint_at:
                self._hint()
                hint_every = min(2 * hint_every, HINT_MAX_EVERY_S)
                hint_at = time.monotonic() + hint_every
            if not self.ch.try_send(h):  # nothing connected (IMMEDIATE), or a full queue
                stop.wait(0.1)
                continue
            deadline = time.monotonic() + (STANDBY_RETRY_S if standby_since is not None else
                                           NO_ANSWER_S if self.multi else JOIN_WAIT_S)
            while time.monotonic() < deadline and not stop.is_set():
                if not self.ch.poll(0.2):
                    continue
                heard = time.monotonic()
                try:
                    _, msg = self.ch.recv()
                except ProtocolError as e:
                    log.warning("bad message dropped", reason=e.reason)
                    continue
                if isinstance(msg, P.Pong):  # a heartbeat's answer
                    continue
                if not isinstance(msg, P.Welcome):
                    if on_message is not None:
                        on_message(msg)
                    continue
                if msg.standby:  # the active scheduler is elsewhere, or this one takes over soon
                    standby_since = standby_since or time.monotonic()
                    self.fence.admit(msg.term)
                    stop.wait(STANDBY_RETRY_S)
                    break
                if self.multi and self.fence.stale(msg.term):  # a deposed scheduler: never serve it
                    log.warning("a scheduler of an old term answered; passing it over", term=msg.term,
                                known=self.fence.term, scheduler=self.scheduler_addr)
                    self.fence.admit(msg.term)
                    standby_since = time.monotonic() - STANDBY_WAIT_S  # move on at the next turn
                    break
                if msg.status == "accepted":
                    self.fence.admit(msg.term)
                    self._heard = time.monotonic()
                    self.gone = ""
                    self.scheduler_id = msg.scheduler_id
                    self.rejoin.clear()
                    self.drained.clear()
                    self._joined_at = time.monotonic()
                    self._joined.set()
                    return msg
                if msg.status == "refused":
                    raise Refused(msg.detail)
                if msg.status == "drained":
                    self.drained.set()
                    return None
                # "rejoin": the answer to a heartbeat sent before this HELLO
        return None

    def _watch_connection(self) -> None:
        """Follow the main connection's state from the socket monitor."""
        mon = self._monitor
        while mon is not None and mon.poll(0):
            try:
                ev = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._up_since = time.monotonic()
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                self._up_since = None

    def _hint(self) -> None:
        if self.curve:
            log.info(f"no answer from the scheduler yet; saying hello again (CURVE: is this {self.role}'s key "
                     f"in the scheduler's allowed/{self.role}s/, and server.key the scheduler's?)",
                     scheduler=self.scheduler_addr, curve_client=self.curve.name)
        else:
            log.info("no answer from the scheduler yet; saying hello again (does the scheduler use CURVE? "
                     "then pass --curve-keys)", scheduler=self.scheduler_addr)

    # ------------------------------------------------------------------ after WELCOME
    def note(self, msg: Any) -> bool:
        """Take in a message that arrived after WELCOME; True when it is a Welcome that set
        ``rejoin`` or ``drained``."""
        if isinstance(msg, P.Pong):  # the answer to a heartbeat (several addresses): the scheduler lives
            if self.multi and self.fence.stale(msg.term):
                self._lost(f"the scheduler is deposed (term {msg.term} < {self.fence.term})")
                return True
            self._heard = time.monotonic()
            return False
        if isinstance(msg, P.Welcome) and msg.standby and self.multi:
            self._lost("the scheduler became a standby")
            return True
        if not isinstance(msg, P.Welcome) or msg.status == "accepted":  # accepted: a repeated HELLO's answer
            return False
        if msg.status == "drained":
            self.drained.set()
            return True
        if not self._joined.is_set():  # before our WELCOME, or already starting over
            return False
        restarted = bool(msg.scheduler_id and self.scheduler_id and msg.scheduler_id != self.scheduler_id)
        if (msg.status == "rejoin" and not restarted
                and time.monotonic() - self._joined_at < STALE_HEARTBEATS * self.hb_interval):
            return False  # most likely the answer to a heartbeat sent before our HELLO (another instance's is not)
        self._joined.clear()
        self.rejoin_welcome = msg
        self.rejoin.set()
        return True

    def rejoin_reason(self) -> tuple[bool, str]:
        """Why we must rejoin: (restarted, detail). The scheduler restarted when the instance
        asking is not the one that welcomed us; otherwise it gave our group up (a partition,
        missed heartbeats) and its detail says why."""
        if self.gone:  # we left it: for the peer it is a scheduler that died
            return True, self.gone
        w = self.rejoin_welcome
        if w is None:
            return False, ""
        return bool(w.scheduler_id and self.scheduler_id and w.scheduler_id != self.scheduler_id), w.detail

    def wait_drained(self, timeout_s: float) -> bool:
        """Read the main socket for up to ``timeout_s`` until the scheduler says we are drained
        (or asks us to rejoin); True when drained."""
        deadline = time.monotonic() + timeout_s
        while not self.drained.is_set() and not self.rejoin.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or not self.ch.poll(left):
                break
            try:
                self.note(self.ch.recv()[1])
            except ProtocolError as e:
                log.warning("bad message dropped", reason=e.reason)
        return self.drained.is_set()

    def goodbye(self, reason: str) -> None:
        self.ch.try_send(P.Goodbye(worker_id=self.id, reason=reason))

    # ------------------------------------------------------------------ heartbeats
    def maybe_heartbeat(self, stats: Callable[[], dict]) -> float:
        """Send a heartbeat on the main socket when one is due (or the connection was just made);
        returns the seconds until the next."""
        was = self._up_since
        self._watch_connection()
        now = time.monotonic()
        if self.multi and self._joined.is_set():
            if was is not None and self._up_since is None:
                self._lost("the connection dropped")
            elif now - self._heard > self.silent_after_s:
                self._lost("the scheduler went silent")
        if now >= self._next_hb or (self._up_since is not None and self._up_since != was):
            self._next_hb = now + self.hb_interval
            self.ch.try_send(self._heartbeat(stats))  # not connected: nobody to tell
        return max(0.0, self._next_hb - now)

    @property
    def silent_after_s(self) -> float:
        return max(3 * self.hb_interval, 2 * NO_ANSWER_S)

    def _heartbeat(self, stats: Callable[[], dict]) -> P.Heartbeat:
        # term 0 with one address: nothing to fence, and no answer asked for (common/failover.py)
        return P.Heartbeat(worker_id=self.id, stats=stats(), term=self.fence.term if self.multi else 0)

    def start_heartbeats(self, stats: Callable[[], dict], *, stuck_exit: int) -> None:
        """Heartbeats from a thread with its own socket. When the scheduler asks us to rejoin
        and the main thread does not clear ``rejoin`` within STUCK_AFTER_S, the process exits
        with ``stuck_exit``."""
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, args=(stats, stuck_exit), name="heartbeat",
                                           daemon=True)
        self._hb_thread.start()

    def _heartbeat_loop(self, stats: Callable[[], dict], stuck_exit: int) -> None:
        sock = make_socket(self.ctx, zmq.DEALER, identity=f"{self.id}-hb", immediate=True, **self.socket_kw)
        # before connecting: the first one counts
        mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        addr = self.scheduler_addr
        sock.connect(addr)
        hb = Channel(sock)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        next_hb = 0.0
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                if addr != self.scheduler_addr:  # failed over: follow (this thread owns the socket)
                    sock.disconnect(addr)
                    addr = self.scheduler_addr
                    sock.connect(addr)
                    next_hb = 0.0
                if self.multi and self._joined.is_set() and now - self._heard > self.silent_after_s:
                    self._lost("the scheduler went silent")
                if now >= next_hb:
                    next_hb = now + self.hb_interval
                    hb.try_send(self._heartbeat(stats))
                # at most CLOSE_CHECK_S at a time: close() waits for this thread
                wait_s = min(next_hb - time.monotonic(), CLOSE_CHECK_S)
                events = dict(poller.poll(max(0, int(wait_s * 1000))))
                if mon in events:  # (re)connected: say so now, a restarted scheduler is waiting for us
                    while mon.poll(0):
                        ev = recv_monitor_message(mon, zmq.NOBLOCK)
                        if ev["event"] == zmq.EVENT_DISCONNECTED and self.multi:
                            if ev.get("endpoint", b"").decode(errors="replace") == addr:
                                self._lost("the connection dropped")
                    next_hb = 0.0
                if sock not in events:
                    continue
                try:
                    _, msg = hb.recv()
                except ProtocolError:
                    continue
                if self.note(msg) and self.rejoin.is_set():
                    self._watch_rejoin(stuck_exit)
        finally:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(linger=0)
            hb.close()

    def _watch_rejoin(self, stuck_exit: int) -> None:
        deadline = time.monotonic() + STUCK_AFTER_S
        while self.rejoin.is_set() and not self._closed.is_set():
            if time.monotonic() > deadline:
                log.error("stuck while the scheduler asked us to rejoin; exiting", code=stuck_exit)
                os._exit(stuck_exit)
            self._closed.wait(0.1)

    def close(self) -> None:
        self._closed.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)
        if self._monitor is not None:
            try:
                self.ch.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
            self._monitor = None
        self.ch.close()
