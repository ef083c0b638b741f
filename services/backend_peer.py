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
        self.ctx, self.scheduler_addr, self.id, self.role = ctx, scheduler_addr, peer_id, role
        self.curve = curve
        self.socket_kw = curve.socket_kwargs() if curve else {}
        self.hb_interval = heartbeat_interval_s
        sock = make_socket(ctx, zmq.DEALER, identity=peer_id, immediate=immediate, **self.socket_kw)
        try:  # before connecting, so the first handshake is seen
            self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            sock.connect(scheduler_addr)
        except BaseException:
            sock.close(linger=0)
            raise
        self.ch = Channel(sock)
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

    # ------------------------------------------------------------------ joining
    def join(self, hello: Callable[[], P.Hello], stop: threading.Event,
             on_message: Callable[[Any], None] | None = None) -> P.Welcome | None:
        """HELLO until WELCOME; other messages that arrive meanwhile go to ``on_message``."""
        self._joined.clear()
        hint_at, hint_every = time.monotonic() + JOIN_WAIT_S, JOIN_WAIT_S
        heard = time.monotonic()  # the last time anything came from the scheduler
        while not stop.is_set():
            h = hello()
            self._watch_connection()
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
            deadline = time.monotonic() + JOIN_WAIT_S
            while time.monotonic() < deadline and not stop.is_set():
                if not self.ch.poll(0.2):
                    continue
                heard = time.monotonic()
                try:
                    _, msg = self.ch.recv()
                except ProtocolError as e:
                    log.warning("bad message dropped", reason=e.reason)
                    continue
                if not isinstance(msg, P.Welcome):
                    if on_message is not None:
                        on_message(msg)
                    continue
                if msg.status == "accepted":
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
        if now >= self._next_hb or (self._up_since is not None and self._up_since != was):
            self._next_hb = now + self.hb_interval
            self.ch.try_send(P.Heartbeat(worker_id=self.id, stats=stats()))  # not connected: nobody to tell
        return max(0.0, self._next_hb - now)

    def start_heartbeats(self, stats: Callable[[], dict], *, stuck_exit: int) -> None:
        """Heartbeats from a thread with its own socket. When the scheduler asks us to rejoin
        and the main thread does not clear ``rejoin`` within STUCK_AFTER_S, the process exits
        with ``stuck_exit``."""
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, args=(stats, stuck_exit), name="heartbeat",
                                           daemon=True)
        self._hb_thread.start()

    def _heartbeat_loop(self, stats: Callable[[], dict], stuck_exit: int) -> None:
        sock = make_socket(self.ctx, zmq.DEALER, identity=f"{self.id}-hb", immediate=True, **self.socket_kw)
        mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # before connecting: the first one counts
        sock.connect(self.scheduler_addr)
        hb = Channel(sock)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        next_hb = 0.0
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + self.hb_interval
                    hb.try_send(P.Heartbeat(worker_id=self.id, stats=stats()))
                # at most CLOSE_CHECK_S at a time: close() waits for this thread
                wait_s = min(next_hb - time.monotonic(), CLOSE_CHECK_S)
                events = dict(poller.poll(max(0, int(wait_s * 1000))))
                if mon in events:  # (re)connected: say so now, a restarted scheduler is waiting for us
                    while mon.poll(0):
                        recv_monitor_message(mon, zmq.NOBLOCK)
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
