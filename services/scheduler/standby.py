"""A hot standby: a scheduler that follows its peer and takes over when the peer's lease lapses.

`zeroserve scheduler --standby-of ADDR` (ADDR: the peer's client address). In a deployment with a
standby each of the two schedulers names the other; whichever finds no active peer becomes
active. Why this shape:

* **Follow over the client port, with Ping/Pong.** The follower is a DEALER on the peer's client
  ROUTER that sends a `Ping` every FOLLOW_PING_S (0.1 s); each `Pong` says the peer's term and
  whether it is active (`Pong.standby`). An active peer's Pong renews the lease; none for
  `--standby-lease` (1 s by default) and the standby takes over. No extra infrastructure, no new socket on
  the active side, and a Pong comes from the active's loop: a loop that stopped turning (a
  SIGSTOP, a hang) lets the lease lapse like a dead process does. A process that died says so
  sooner: its kernel closes the connection, and once the follower's connection has dropped and
  no Pong came for DROPPED_GRACE_S (a live peer's reconnect and Pong take milliseconds), the
  lease lapses then instead of a full lease after the last Pong.
* **No replicated request state.** Adoption (adoption.py) rebuilds everything from the peers: the
  workers rejoin with the KV they kept, clients re-attach their open requests with what they
  received, the detokenizer is replayed. A standby that takes over is a restarted scheduler whose
  process was already up, its sockets bound and its tokenizers loaded: what is left of the pause
  is the lease and the peers' reconnect.
* **Bound but idle.** While standby the sockets are bound (peers fail over at once) and answered
  with "standby" only: a Pong with `standby`, a Welcome "rejoin" with `standby` to HELLOs and
  heartbeats, a StatsReply saying so; requests are dropped unanswered (their client's next Pong,
  from the active, re-attaches them). So peers move on to the active within a few round trips.
* **Terms** (common/failover.py). The standby takes over with term = the highest it has seen
  (from its peer's Pongs and from every Hello, Heartbeat and Ping it answered) + 1. An active
  scheduler that hears of a higher term (a peer's Hello, Heartbeat or Ping, or its own peer's
  Pong) steps down (a lone scheduler, without --standby-of, never does: service.py):
  it exits with EXIT_DEPOSED and its supervisor starts it again, as a standby.
  Two standbys that see each other: the one with the larger instance id takes over, the other
  waits. Two actives that see each other (each took over while unable to see the other): the
  lower (term, id) steps down.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from zeroserve.common import messages as P
from zeroserve.common.codec import ProtocolError
from zeroserve.common.failover import FOLLOW_PING_S, STANDBY_DETAIL, outranks
from zeroserve.common.log import get_logger
from zeroserve.common.transport import Channel, make_socket

log = get_logger("scheduler")

DROPPED_GRACE_S = 2 * FOLLOW_PING_S  # the follower's connection dropped: the peer has this long to answer again


class Follower:
    """The DEALER that follows the peer scheduler, and what its Pongs said."""

    def __init__(self, ctx: zmq.Context, peer_addr: str, my_id: str, lease_s: float, now: float,
                 curve_kw: dict | None = None) -> None:
        sock = make_socket(ctx, zmq.DEALER, identity=f"standby-{my_id}", immediate=True, **(curve_kw or {}))
        self.monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(peer_addr)
        self.ch = Channel(sock)
        self.dropped_at: float | None = None  # the connection to the peer dropped (and did not come back)
        self.peer_addr, self.lease_s = peer_addr, lease_s
        self.active_at = now  # the last Pong of an active peer (start(): the lease runs from the first ping)
        self.standby_at = -1e9  # the last Pong of a standby peer
        self.peer_term, self.peer_id, self.peer_active = 0, "", False
        self.next_ping = 0.0
        self.nonce = 0

    @property
    def sock(self) -> zmq.Socket:
        return self.ch.sock

    def start(self, now: float) -> None:
        """Following begins: the lease runs from here (a start-up that took longer than the lease,
        tokenizers loading on a busy host, must not make a standby take over before it asked)."""
        self.active_at, self.next_ping = now, 0.0

    def ping(self, now: float, term: int) -> None:
        if now >= self.next_ping:
            self.next_ping = now + FOLLOW_PING_S
            self.nonce += 1
            self.ch.try_send(P.Ping(nonce=self.nonce, term=term))  # IMMEDIATE: nothing queues while it is away

    def read(self, now: float) -> None:
        while self.monitor.poll(0):
            try:
                ev = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.ZMQError:
                break
            if ev == zmq.EVENT_DISCONNECTED:
                self.dropped_at = now
            elif ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.dropped_at = None
        while True:
            try:
                got = self.ch.recv_nowait()
            except ProtocolError as e:
                log.warning("bad message from the peer scheduler", reason=e.reason)
                continue
            if got is None:
                return
            m = got[1]
            if isinstance(m, P.Pong) and m.scheduler_id:
                self.note_pong(m, now)

    def note_pong(self, m: P.Pong, now: float) -> None:
        """What a peer's Pong says: who it is, whether it is active (renewing the lease), its term."""
        self.peer_id, self.peer_active = m.scheduler_id, not m.standby
        self.peer_term = max(self.peer_term, m.term)
        if m.standby:
            self.standby_at = now
        else:
            self.active_at = now

    def lapsed(self, now: float, my_id: str) -> bool:
        """A standby's question: take over now? Yes once no active peer answered for the lease,
        unless the peer is a standby too with the larger id (it takes over; we wait)."""
        dropped = self.dropped_at is not None and now - max(self.dropped_at, self.active_at) >= DROPPED_GRACE_S
        if now - self.active_at < self.lease_s and not dropped:
            return False
        peer_waits = now - self.standby_at < self.lease_s
        return not (peer_waits and self.peer_id > my_id)

    def deposes(self, now: float, term: int, my_id: str) -> bool:
        """An active's question: is the peer an active scheduler that outranks us (just heard)?"""
        return (self.peer_active and now - self.active_at < self.lease_s
                and outranks(self.peer_term, self.peer_id, term, my_id))

    def close(self) -> None:
        try:
            self.ch.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.ch.close()


def standby_answer(msg, scheduler_id: str, term: int, peer_addr: str) -> P.Message | None:
    """What a standby says to a message on its client or backend socket (None: nothing)."""
    if isinstance(msg, P.Ping):
        return P.Pong(nonce=msg.nonce, scheduler_id=scheduler_id, term=term, standby=True)
    if isinstance(msg, (P.Hello, P.Heartbeat)):
        return P.Welcome(status="rejoin", detail=f"{STANDBY_DETAIL}; the active one is at {peer_addr} (or this one "
                         "takes over when its lease lapses)", scheduler_id=scheduler_id, term=term, standby=True)
    if isinstance(msg, P.StatsRequest):
        return P.StatsReply(stats={"scheduler_id": scheduler_id, "role": "standby", "term": term,
                                   "standby_of": peer_addr, "groups": [], "requests": 0,
                                   "detokenizer": {"connected": False, "worker_id": None}})
    if isinstance(msg, (P.ModelsRequest, P.MetricsRequest, P.ModelsControl, P.LoadLoRA, P.UnloadLoRA)):
        return P.Error(code="unavailable", message=f"{STANDBY_DETAIL}; ask the active scheduler")
    return None  # Submit, Reattach, Abort: dropped; the client's next Pong tells it to move on
