"""services/backend_peer.py against a scripted scheduler: a ROUTER in this process.

Joining (accepted after a stale "rejoin", refused, drained, stopped while nobody answers, the
CURVE hint), noticing what the scheduler wants after WELCOME (rejoin outside the stale window,
drained), heartbeats from the caller's loop and from the thread with its own `<id>-hb` socket,
and the stuck check that exits a process whose main loop never takes up a rejoin.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from zeroserve.common import messages as P
from zeroserve.common.transport import Channel, bind_free_port, make_socket
from zeroserve.services import backend_peer as bp
from zeroserve.services.backend_peer import BackendPeer, Refused

HB = 0.05  # heartbeat interval: the stale window is 3 of them


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def router(ctx):
    sock = make_socket(ctx, zmq.ROUTER)
    addr = bind_free_port(sock)
    ch = Channel(sock)
    ch.addr = addr
    yield ch
    ch.close()


def _hello(peer_id: str = "w1") -> P.Hello:
    return P.Hello(role="worker", worker_id=peer_id, model="m", num_kv_blocks=1, block_size=16)


def _peer(ctx, addr: str, **kw) -> BackendPeer:
    return BackendPeer(ctx, addr, "w1", role="worker", heartbeat_interval_s=HB, **kw)


def _expect(router: Channel, kind: type, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ident, msg = router.recv(timeout=max(0.01, deadline - time.monotonic()))
        if isinstance(msg, kind):
            return ident, msg
    raise AssertionError(f"no {kind.__name__} within {timeout}s")


def _answer_hello(router: Channel, *welcomes: P.Welcome) -> threading.Thread:
    """A thread that answers the first HELLO with ``welcomes``, in order."""

    def run() -> None:
        ident, _ = _expect(router, P.Hello)
        for w in welcomes:
            router.send(w, ident)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_join_skips_a_stale_rejoin_and_returns_the_welcome(ctx, router):
    peer = _peer(ctx, router.addr)
    try:
        t = _answer_hello(router, P.Welcome(status="rejoin"), P.Welcome(status="accepted", group="g", step_addr="x"))
        got = []
        w = peer.join(_hello, threading.Event(), on_message=got.append)
        t.join(5)
        assert w is not None and w.accepted and w.group == "g"
        assert not peer.rejoin.is_set() and not peer.drained.is_set()
    finally:
        peer.close()


def test_join_passes_other_messages_on_and_raises_on_refusal(ctx, router):
    peer = _peer(ctx, router.addr)
    try:
        t = _answer_hello(router, P.DetokFree(req_ids=["a"]), P.Welcome(status="refused", detail="no such model"))
        got = []
        with pytest.raises(Refused) as e:
            peer.join(_hello, threading.Event(), on_message=got.append)
        t.join(5)
        assert e.value.detail == "no such model"
        assert [type(m) for m in got] == [P.DetokFree]
    finally:
        peer.close()


def test_join_ends_on_drained(ctx, router):
    peer = _peer(ctx, router.addr)
    try:
        _answer_hello(router, P.Welcome(status="drained"))
        assert peer.join(_hello, threading.Event()) is None
        assert peer.drained.is_set()
    finally:
        peer.close()


def test_join_with_nobody_there_stops_promptly_and_hints_at_curve(ctx, monkeypatch):
    from structlog.testing import capture_logs

    monkeypatch.setattr(bp, "JOIN_WAIT_S", 0.2)
    stop = threading.Event()
    peer = BackendPeer(ctx, "tcp://127.0.0.1:1", "d1", role="detokenizer", immediate=True)
    threading.Timer(0.8, stop.set).start()
    try:
        with capture_logs() as logs:
            t0 = time.monotonic()
            assert peer.join(_hello, stop) is None
        assert time.monotonic() - t0 < 2.0
        hints = [e for e in logs if "no answer from the scheduler yet" in e["event"]]
        assert hints and "--curve-keys" in hints[0]["event"]
        assert len(hints) <= 3, "the hint's interval doubles"
    finally:
        peer.close()


def _joined_peer(ctx, router) -> BackendPeer:
    peer = _peer(ctx, router.addr)
    _answer_hello(router, P.Welcome(status="accepted"))
    assert peer.join(_hello, threading.Event()) is not None
    return peer


def test_note_rejoin_outside_the_stale_window_and_drained(ctx, router):
    peer = _joined_peer(ctx, router)
    try:
        assert not peer.note(P.Welcome(status="rejoin")), "inside the stale window: an old heartbeat's answer"
        assert not peer.note(P.Welcome(status="accepted")) and not peer.note(P.Heartbeat(worker_id="x"))
        time.sleep(3 * HB + 0.05)
        assert peer.note(P.Welcome(status="rejoin")) and peer.rejoin.is_set()
        assert not peer.note(P.Welcome(status="rejoin")), "already starting over"
        assert peer.note(P.Welcome(status="drained")) and peer.drained.is_set()
    finally:
        peer.close()


def test_wait_drained_reads_the_main_socket(ctx, router):
    peer = _joined_peer(ctx, router)
    try:
        t0 = time.monotonic()
        assert not peer.wait_drained(0.2) and time.monotonic() - t0 >= 0.15
        router.send(P.Welcome(status="drained"), b"w1")  # the peer's identity
        assert peer.wait_drained(5.0)
    finally:
        peer.close()


def test_loop_heartbeats_are_paced(ctx, router):
    peer = _joined_peer(ctx, router)
    try:
        assert peer.maybe_heartbeat(lambda: {"live": 3}) == pytest.approx(HB, abs=0.02)
        assert 0 < peer.maybe_heartbeat(lambda: {"live": 3}) <= HB  # not due yet: nothing sent
        ident, hb = _expect(router, P.Heartbeat)
        assert ident == b"w1" and hb.worker_id == "w1" and hb.stats == {"live": 3}
        assert not router.poll(0.02)
    finally:
        peer.close()


def test_heartbeat_thread_uses_its_own_identity_and_exits_when_stuck(ctx, router, monkeypatch):
    exits = []
    monkeypatch.setattr(bp, "STUCK_AFTER_S", 0.3)
    peer = _joined_peer(ctx, router)

    def fake_exit(code: int) -> None:  # the real one ends the process
        exits.append(code)
        peer.rejoin.clear()

    monkeypatch.setattr(bp.os, "_exit", fake_exit)
    try:
        peer.start_heartbeats(lambda: {"steps": 1}, stuck_exit=3)
        ident, hb = _expect(router, P.Heartbeat)
        assert ident == b"w1-hb" and hb.stats == {"steps": 1}
        time.sleep(3 * HB)
        router.send(P.Welcome(status="rejoin"), ident)  # the scheduler restarted; nobody takes it up
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.02)
        assert exits == [3]
    finally:
        peer.close()


def test_a_rejoin_the_main_loop_takes_up_does_not_exit(ctx, router, monkeypatch):
    exits = []
    monkeypatch.setattr(bp, "STUCK_AFTER_S", 0.3)
    monkeypatch.setattr(bp.os, "_exit", exits.append)
    peer = _joined_peer(ctx, router)
    try:
        peer.start_heartbeats(dict, stuck_exit=3)
        ident, _ = _expect(router, P.Heartbeat)
        time.sleep(3 * HB)
        router.send(P.Welcome(status="rejoin"), ident)
        assert peer.rejoin.wait(5)
        peer.rejoin.clear()  # what a main loop does when it starts over
        time.sleep(0.5)
        assert exits == []
    finally:
        peer.close()


def test_a_restarted_scheduler_hears_a_heartbeat_at_once_and_its_rejoin_counts(ctx, router):
    """A scheduler that restarts on the same port gets a heartbeat from the thread and from the
    loop as soon as each connection is made again, not an interval later; its "rejoin" (another
    instance than the one that welcomed us) counts even inside the stale window."""
    peer = _joined_peer(ctx, router)
    peer.hb_interval = 30.0  # only a reconnection can explain a prompt heartbeat
    peer.scheduler_id = "first"
    addr = router.addr
    try:
        peer.start_heartbeats(lambda: {}, stuck_exit=3)
        _expect(router, P.Heartbeat)  # the thread's first
        peer.maybe_heartbeat(dict)  # the loop's first: the next is 30 s away
        _expect(router, P.Heartbeat)
        router.close()  # the scheduler dies ...
        time.sleep(0.3)
        again = make_socket(ctx, zmq.ROUTER)
        again.bind(addr)  # ... and comes back on the same port
        new = Channel(again)
        try:
            t0 = time.monotonic()
            ident, _ = _expect(new, P.Heartbeat, timeout=3.0)
            assert ident == b"w1-hb" and time.monotonic() - t0 < 2.0
            deadline = time.monotonic() + 3.0
            while True:  # the loop's, once its connection is made again
                peer.maybe_heartbeat(dict)
                if new.poll(0.05):
                    break
                assert time.monotonic() < deadline, "no heartbeat from the loop after the reconnection"
            assert new.recv()[0] == b"w1"
            peer._joined_at = time.monotonic()  # inside the stale window
            assert not peer.note(P.Welcome(status="rejoin", scheduler_id=peer.scheduler_id))
            assert peer.note(P.Welcome(status="rejoin", scheduler_id="another")) and peer.rejoin.is_set()
        finally:
            new.close()
    finally:
        peer.close()
