"""The term rule and the address lists of scheduler failover (common/failover.py), the standby's
lease and answers (services/scheduler/standby.py), and the new message fields' defaults."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from zeroserve.common import messages as P
from zeroserve.common.codec import decode, encode
from zeroserve.common.config import PeerArgs, SchedulerConfig
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.failover import Fence, outranks, split_addresses
from zeroserve.services.scheduler.standby import DROPPED_GRACE_S, Follower, standby_answer


def test_a_fence_drops_lower_terms_and_remembers_the_highest():
    f = Fence()
    assert f.admit(1) and f.term == 1
    assert f.admit(3) and f.term == 3  # a standby took over
    assert not f.admit(2) and f.dropped == 1  # the deposed one's message
    assert f.stale(2) and not f.stale(3) and not f.stale(4)
    assert f.admit(0) and f.term == 3  # no term (an older peer, the in-process engine): never fenced
    assert not f.stale(0)


def test_of_two_actives_the_higher_term_then_the_larger_id_stays():
    assert outranks(2, "a", 1, "z") and not outranks(1, "z", 2, "a")
    assert outranks(2, "b", 2, "a") and not outranks(2, "a", 2, "b")


def test_address_lists():
    assert split_addresses("tcp://a:1, tcp://b:2") == ["tcp://a:1", "tcp://b:2"]
    assert split_addresses(["tcp://a:1", "tcp://a:1"]) == ["tcp://a:1"]
    with pytest.raises(InvalidRequest, match="empty"):
        split_addresses("tcp://a:1,,tcp://b:2")
    assert PeerArgs(scheduler="tcp://a:7001,tcp://b:7005").scheduler == "tcp://a:7001,tcp://b:7005"
    with pytest.raises(InvalidRequest, match="--scheduler"):
        PeerArgs(scheduler="tcp://a:7001,tcp://:7005")
    with pytest.raises(InvalidRequest, match="--standby-of"):
        SchedulerConfig(standby_of="a:7000")
    with pytest.raises(InvalidRequest, match="--standby-lease"):
        SchedulerConfig(standby_of="tcp://a:7000", standby_lease_s=0.01)


def test_messages_without_a_term_decode_as_term_zero():
    """An older peer's messages have no term field: they decode, with term 0 (never fenced)."""
    pong = decode([b"Pong", msgpack.packb([7, P.PROTOCOL_VERSION, "sid", []])])
    assert pong.term == 0 and pong.standby is False
    hb = decode([b"Heartbeat", msgpack.packb(["w", {}])])
    assert hb.term == 0
    step = decode(encode(P.Step(seq=3, term=5)))
    assert step.term == 5


def _follower(lease_s: float = 0.5) -> tuple[Follower, zmq.Context]:
    ctx = zmq.Context()
    return Follower(ctx, "tcp://127.0.0.1:1", "m", lease_s, now=100.0), ctx


def _pong(f: Follower, now: float, **kw) -> None:
    """A Pong as Follower.read hands it on (its socket is not used here)."""
    f.note_pong(P.Pong(nonce=1, **kw), now)


def test_the_lease_lapses_without_an_active_peer_and_the_larger_id_of_two_standbys_takes_over():
    f, ctx = _follower()
    try:
        assert not f.lapsed(100.4, "m")  # the lease runs from our start
        assert f.lapsed(100.5, "m")  # nobody answered: take over
        _pong(f, 101.0, scheduler_id="a", term=4)
        assert not f.lapsed(101.4, "m") and f.lapsed(101.5, "m") and f.peer_term == 4
        _pong(f, 102.0, scheduler_id="z", term=4, standby=True)  # a standby with a larger id: it goes
        assert not f.lapsed(102.2, "m")
        _pong(f, 103.0, scheduler_id="a", term=4, standby=True)  # a smaller id: we go
        assert f.lapsed(103.1, "m")
        f.active_at, f.dropped_at = 104.0, 104.05  # a live peer's connection dropped: a short grace
        assert not f.lapsed(104.05 + DROPPED_GRACE_S - 0.01, "m") and f.lapsed(104.05 + DROPPED_GRACE_S, "m")
    finally:
        f.close()
        ctx.term()


def test_an_active_steps_down_for_an_active_peer_that_outranks_it():
    f, ctx = _follower()
    try:
        _pong(f, 100.0, scheduler_id="b", term=3)
        assert f.deposes(100.1, 2, "m") and not f.deposes(100.1, 3, "z") and not f.deposes(100.1, 4, "a")
        assert not f.deposes(100.6, 2, "m")  # heard too long ago
        _pong(f, 101.0, scheduler_id="b", term=9, standby=True)
        assert not f.deposes(101.1, 2, "m")  # a standby never deposes
    finally:
        f.close()
        ctx.term()


def test_a_standby_answers_standby_and_serves_nothing():
    pong = standby_answer(P.Ping(nonce=5), "sb", 3, "tcp://a:7000")
    assert isinstance(pong, P.Pong) and pong.standby and pong.term == 3 and pong.nonce == 5
    w = standby_answer(P.Hello(role="worker", worker_id="w"), "sb", 3, "tcp://a:7000")
    assert isinstance(w, P.Welcome) and w.status == "rejoin" and w.standby and "tcp://a:7000" in w.detail
    assert standby_answer(P.StatsRequest(), "sb", 3, "x").stats["role"] == "standby"
    assert standby_answer(P.Submit(request_id="r", prompt="x"), "sb", 3, "x") is None  # dropped: the client moves on
    err = standby_answer(P.ModelsRequest(), "sb", 3, "x")
    assert isinstance(err, P.Error) and err.code == "unavailable"


# ---- a backend peer with two scheduler addresses, against scripted schedulers (ROUTERs here) ----
class _Scripted:
    """A ROUTER that answers every HELLO with `answer(hello)` (None: silence) and records them;
    with `on_message`, that handles every message instead."""

    def __init__(self, ctx: zmq.Context, on_message=None) -> None:
        import threading

        from zeroserve.common.transport import Channel, bind_free_port, make_socket

        sock = make_socket(ctx, zmq.ROUTER)
        self.addr = bind_free_port(sock)
        self.ch = Channel(sock)
        self.answer = lambda h: None
        self.hellos: list[P.Hello] = []
        self.on_message = on_message
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.ch.poll(0.02):
                continue
            ident, msg = self.ch.recv()
            if self.on_message is not None:
                self.on_message(ident, msg)
            elif isinstance(msg, P.Hello):
                self.hellos.append(msg)
                w = self.answer(msg)
                if w is not None:
                    self.ch.send(w, ident)

    def close(self) -> None:
        self._stop.set()
        self._t.join(2)
        self.ch.close()


def test_a_backend_peer_passes_a_standby_over_and_fences_a_deposed_scheduler(monkeypatch):
    import threading

    from zeroserve.services import backend_peer as bp

    monkeypatch.setattr(bp, "STANDBY_WAIT_S", 0.3)
    ctx = zmq.Context()
    a, b = _Scripted(ctx), _Scripted(ctx)
    peer = bp.BackendPeer(ctx, f"{a.addr},{b.addr}", "w1", role="worker", heartbeat_interval_s=0.05)
    stop = threading.Event()
    try:
        hello = lambda: P.Hello(role="worker", worker_id="w1", model="m", num_kv_blocks=1, block_size=16)  # noqa: E731
        a.answer = lambda h: P.Welcome(status="rejoin", standby=True, scheduler_id="A", term=1)
        b.answer = lambda h: P.Welcome(status="accepted", scheduler_id="B", term=2)
        w = peer.join(hello, stop)
        assert w.scheduler_id == "B" and peer.scheduler_addr == b.addr and peer.fence.term == 2
        assert a.hellos[0].term == 0 and b.hellos[0].term == 1  # the standby's answer said term 1
        # a Pong of a lower term: the scheduler we talk to is deposed; leave it, as after a restart
        assert peer.note(P.Pong(nonce=0, scheduler_id="B", term=1))
        assert peer.rejoin.is_set() and peer.rejoin_reason()[0] and peer.scheduler_addr == a.addr
        peer.rejoin.clear()
        # A now believes it is active at term 1: its Welcome is passed over, B (term 2) welcomes us
        a.answer = lambda h: P.Welcome(status="accepted", scheduler_id="A", term=1)
        n_b = len(b.hellos)
        w = peer.join(hello, stop)
        assert w.scheduler_id == "B" and peer.fence.term == 2
        assert a.hellos[-1].term == 2 and b.hellos[n_b].term == 2  # each HELLO says the term we know
    finally:
        stop.set()
        peer.close()
        a.close()
        b.close()
        ctx.destroy(linger=0)


def test_a_client_drops_outputs_of_a_lower_term():
    """A client with two addresses that met term 2 does not deliver a term-1 Output (a deposed
    scheduler's), and delivers the rest of the stream."""
    from zeroserve import Client

    ctx = zmq.Context()

    def serve(ident: bytes, msg) -> None:
        if isinstance(msg, P.Ping):
            a.ch.send(P.Pong(nonce=msg.nonce, scheduler_id="A", term=2), ident)
        elif isinstance(msg, P.Submit):
            rid = msg.request_id
            a.ch.send(P.Outputs(items=[P.Output(request_id=rid, token_ids=[5], prompt_token_ids=[1, 2])], term=2),
                      ident)
            a.ch.send(P.Outputs(items=[P.Output(request_id=rid, token_ids=[6])], term=1), ident)
            a.ch.send(P.Outputs(items=[P.Output(request_id=rid, token_ids=[7], finish_reason="length")], term=2),
                      ident)

    a = _Scripted(ctx, serve)
    try:
        with Client(f"{a.addr},tcp://127.0.0.1:1", timeout_s=5.0) as c:
            c.health()  # learns term 2 from the Pong
            out = c.generate([1, 2], {"max_tokens": 3})
        assert out.outputs[0].token_ids == [5, 7]
    finally:
        a.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("standby_of", [None, "tcp://127.0.0.1:1"])
def test_who_may_depose_an_active_scheduler(standby_of):
    """A lone scheduler never steps down (a fuzzed client Ping of term 12 once stopped one): a
    backend peer's higher term becomes its own, a client's changes nothing. A scheduler with a
    standby peer steps down for any peer's higher term (the peers come back from its successor)."""
    import types

    from zeroserve.services.scheduler.service import SchedulerService

    s = SchedulerService.__new__(SchedulerService)
    s.cfg = types.SimpleNamespace(standby_of=standby_of)
    s.cluster = types.SimpleNamespace(term=2)
    s.term, s.deposed, s._stop = 2, False, False
    assert not s._outranked(P.Heartbeat(worker_id="w", term=2), from_backend=True)  # the same term: ours
    if standby_of is not None:
        assert s._outranked(P.Ping(nonce=1, term=12), from_backend=False) and s.deposed
        return
    assert not s._outranked(P.Ping(nonce=1, term=12), from_backend=False)
    assert (s.term, s.deposed, s._stop) == (2, False, False)
    hb = P.Heartbeat(worker_id="w", term=7)
    if standby_of is None:
        assert not s._outranked(hb, from_backend=True)
        assert (s.term, s.cluster.term, s.deposed) == (7, 7, False)
    else:
        assert s._outranked(hb, from_backend=True)
        assert s.deposed and s._stop and s.term == 2
