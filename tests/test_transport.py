"""zeroserve.common.transport: real sockets on loopback, through Channel. Every receive has
a timeout; every socket is closed."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio

from zeroserve.common import codec as C
from zeroserve.common import messages as M
from zeroserve.common import transport as T
from zeroserve.common.errors import InvalidRequest

TIMEOUT = 5.0  # seconds; generous for loaded CI machines, never reached when things work
_inproc = itertools.count()


@pytest.fixture
def ctx():
    c = T.make_context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def socks(ctx):
    """make(type, **kw) -> socket; all closed at teardown."""
    made: list[zmq.Socket] = []

    def make(sock_type, **kw):
        s = T.make_socket(ctx, sock_type, **kw)
        made.append(s)
        return s

    yield make
    T.close_all(*made)


def router_and_dealer(socks, identity=b"client-1", **router_kw):
    router = socks(zmq.ROUTER, **router_kw)
    addr = T.bind_free_port(router)
    dealer = socks(zmq.DEALER, connect=addr, identity=identity)
    return router, dealer, addr


def channels(socks, identity=b"client-1", limit: int | None = None):
    """(router Channel, dealer Channel, address); ``limit`` sets the router's MAXMSGSIZE and its
    Channel's max_message_size."""
    kw = {} if limit is None else {"max_message_size": limit}
    router, dealer, addr = router_and_dealer(socks, identity, **kw)
    return T.Channel(router, **kw), T.Channel(dealer), addr


def expect_nothing(sock, seconds: float) -> None:
    assert not sock.poll(int(seconds * 1000)), "a message arrived that should have been dropped"


def messages_equal(a, b) -> bool:
    from test_protocol import messages_equal as eq

    return eq(a, b)


def test_addresses():
    assert T.tcp_addr(5555) == "tcp://127.0.0.1:5555"
    assert T.tcp_addr("5555") == "tcp://127.0.0.1:5555"
    assert T.tcp_addr("ipc:///tmp/x") == "ipc:///tmp/x"
    assert T.tcp_addr(5555, host="::1") == "tcp://[::1]:5555"
    with pytest.raises(ValueError):
        T.tcp_addr("localhost")
    port = T.free_port()
    assert isinstance(port, int) and 0 < port < 65536


def test_socket_defaults(socks):
    router = socks(zmq.ROUTER)
    addr = T.bind_free_port(router)
    assert addr.startswith("tcp://127.0.0.1:")
    assert router.getsockopt(zmq.LINGER) == 0
    assert router.getsockopt(zmq.SNDHWM) == T.DEFAULT_HWM and router.getsockopt(zmq.RCVHWM) == T.DEFAULT_HWM
    assert router.getsockopt(zmq.MAXMSGSIZE) == C.MAX_MESSAGE_SIZE
    assert router.getsockopt(zmq.TCP_KEEPALIVE) == 1
    port = int(addr.rsplit(":", 1)[1])
    other = socks(zmq.DEALER, connect=port, identity="w0")  # a bare port means 127.0.0.1
    assert other.getsockopt(zmq.ROUTING_ID) == b"w0"
    pub = socks(zmq.PUB, bind=T.free_port())
    assert pub.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://127.0.0.1:")
    with pytest.raises(ValueError, match="identity"):
        socks(zmq.DEALER, identity=b"")
    with pytest.raises(ValueError, match="identity"):
        socks(zmq.DEALER, identity=b"\x00abc")
    ch = T.Channel(router)
    assert ch.sock is router and ch.max_message_size == C.MAX_MESSAGE_SIZE


def test_router_dealer_round_trip(socks):
    router, dealer, _ = channels(socks)
    dealer.send(M.Ping(nonce=7))
    ident, msg = router.recv(timeout=TIMEOUT)
    assert ident == b"client-1" and isinstance(msg, M.Ping) and msg.nonce == 7
    router.send(M.Pong(nonce=7, scheduler_id="s1"), ident)
    ident2, pong = dealer.recv(timeout=TIMEOUT)
    assert ident2 is None and isinstance(pong, M.Pong) and pong.nonce == 7 and pong.protocol_version == 2

    # arrays big enough to travel as their own zero-copy frames
    ids = [f"r{i}" for i in range(50_000)]
    sampled = np.arange(50_000, dtype=np.int32)
    lp = np.random.default_rng(0).random((50_000, 3), dtype=np.float32)
    res = M.StepResult(
        seq=9, worker_id="w", req_ids=ids, sampled_token_ids=sampled, logprobs=lp,
        logprob_token_ids=np.zeros((50_000, 3), np.int32),
    )
    assert len(C.encode(res)) > 2
    dealer.send(res)
    ident, got = router.recv(timeout=TIMEOUT)
    assert ident == b"client-1" and messages_equal(got, res)

    # every message type survives the trip
    from test_protocol import ALL_SAMPLES

    for m in ALL_SAMPLES:
        dealer.send(m)
        _, got = router.recv(timeout=TIMEOUT)
        assert messages_equal(got, m)
        router.send(m, ident)
        _, got = dealer.recv(timeout=TIMEOUT)
        assert messages_equal(got, m)


def test_recv_nowait(socks):
    router, dealer, _ = channels(socks)
    assert router.recv_nowait() is None
    dealer.send(M.Ping(nonce=4))
    assert router.poll(TIMEOUT)
    ident, msg = router.recv_nowait()
    assert ident == b"client-1" and msg.nonce == 4
    assert router.recv_nowait() is None
    assert not router.poll(0.01)


def test_router_mandatory_and_try_send(socks):
    router, dealer, _ = channels(socks)
    with pytest.raises(zmq.ZMQError) as ei:
        router.send(M.Ping(), b"nobody")
    assert ei.value.errno == zmq.EHOSTUNREACH
    assert router.try_send(M.Ping(), b"nobody") is False
    dealer.send(M.Ping(nonce=1))
    ident, _ = router.recv(timeout=TIMEOUT)
    assert router.try_send(M.Ping(nonce=2), ident) is True
    assert dealer.recv(timeout=TIMEOUT)[1].nonce == 2
    with pytest.raises(ValueError, match="identity"):
        router.send(M.Ping())  # a ROUTER needs to know whom to send to
    with pytest.raises(ValueError, match="identity"):
        router.try_send(M.Ping())
    with pytest.raises(C.ProtocolError, match="not a registered"):
        router.try_send(M.CachedRequests(), ident)  # an encode error is not a "peer gone"


def test_try_send_false_for_a_peer_that_left(socks):
    """A ROUTER peer that was connected and went away: try_send says False (never raises, never
    blocks) once libzmq has noticed, and a reconnect under the same identity is served again."""
    router, dealer, addr = channels(socks, identity=b"leaver")
    dealer.send(M.Ping(nonce=1))
    ident, _ = router.recv(timeout=TIMEOUT)
    assert router.try_send(M.Ping(nonce=2), ident) is True
    dealer.close()
    deadline = time.monotonic() + TIMEOUT
    gone = False
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        ok = router.try_send(M.Ping(nonce=3), ident)
        assert time.monotonic() - t0 < 0.5  # non-blocking
        if not ok:
            gone = True
            break
        time.sleep(0.01)
    assert gone, "try_send kept succeeding for a closed peer"
    with pytest.raises(zmq.ZMQError) as ei:
        router.send(M.Ping(nonce=4), ident)
    assert ei.value.errno == zmq.EHOSTUNREACH
    # the same identity comes back
    back = T.Channel(socks(zmq.DEALER, connect=addr, identity=b"leaver"))
    back.send(M.Ping(nonce=5))
    ident2, msg = router.recv(timeout=TIMEOUT)
    assert ident2 == b"leaver" and msg.nonce == 5
    assert router.try_send(M.Ping(nonce=6), ident2) is True
    assert back.recv(timeout=TIMEOUT)[1].nonce == 6


def test_try_send_false_when_the_queue_is_full(socks):
    router_sock = socks(zmq.ROUTER)
    addr = T.bind_free_port(router_sock)
    dealer = T.Channel(socks(zmq.DEALER, connect=addr, identity=b"slow", sndhwm=4, immediate=True))
    deadline = time.monotonic() + TIMEOUT
    full = False
    sent = 0
    while time.monotonic() < deadline and not full:
        if dealer.try_send(M.Ping(nonce=sent)):
            sent += 1
        elif sent:  # the peer is connected (something went out) and the queue filled up
            full = True
        else:
            time.sleep(0.01)  # not connected yet (IMMEDIATE)
    assert full and sent >= 4


def test_recv_timeout(socks):
    router, _dealer, _ = channels(socks)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        router.recv(timeout=0.05)
    assert time.monotonic() - t0 < 2


def test_bad_message_is_reported_with_sender_and_socket_keeps_serving(socks):
    router, dealer, _ = channels(socks)
    dealer.sock.send_multipart([b"Submit", b"\xc1garbage"])
    with pytest.raises(C.ProtocolError) as ei:
        router.recv(timeout=TIMEOUT)
    assert ei.value.identity == b"client-1" and "not valid msgpack" in ei.value.reason
    # the service answers the sender with a typed error...
    router.send(M.Error.from_exception(ei.value), ei.value.identity)
    _, err = dealer.recv(timeout=TIMEOUT)
    assert isinstance(err, M.Error) and err.code == "invalid_request"
    assert isinstance(err.to_exception(), InvalidRequest)
    # ...and goes on serving
    dealer.sock.send_multipart([b"Unknown", b"\x90"])
    with pytest.raises(C.ProtocolError, match="unknown message type"):
        router.recv(timeout=TIMEOUT)
    dealer.sock.send_multipart([b"Hello", C.encode(M.Ping())[1]])  # a body of another type
    with pytest.raises(C.ProtocolError, match="Hello") as ei:
        router.recv(timeout=TIMEOUT)
    assert ei.value.identity == b"client-1"
    dealer.send(M.Abort(request_id="x"))
    assert router.recv(timeout=TIMEOUT)[1].request_id == "x"
    # and the other direction: a DEALER's ProtocolError has no identity
    router.sock.send_multipart([b"client-1", b"Ping", b"\xc1"])
    with pytest.raises(C.ProtocolError) as ei:
        dealer.recv(timeout=TIMEOUT)
    assert ei.value.identity is None


def test_size_limit_drops_oversized_message_without_killing_the_socket(socks):
    limit = 64 * 1024
    router, big_sender, addr = channels(socks, identity=b"big", limit=limit)
    assert router.sock.getsockopt(zmq.MAXMSGSIZE) == limit
    other = T.Channel(socks(zmq.DEALER, connect=addr, identity=b"other"))

    # 1) one frame over MAXMSGSIZE: libzmq drops it (and that peer's connection)
    big_sender.send(M.Submit(request_id="huge", prompt_token_ids=np.zeros(100_000, np.int32)))
    expect_nothing(router.sock, 0.3)
    # the other peers are served as before
    other.send(M.Ping(nonce=1))
    ident, msg = router.recv(timeout=TIMEOUT)
    assert ident == b"other" and msg.nonce == 1
    # the offender reconnects by itself and is served again
    deadline = time.monotonic() + TIMEOUT
    got = None
    while got is None and time.monotonic() < deadline:
        big_sender.send(M.Ping(nonce=2))
        try:
            ident, msg = router.recv(timeout=0.2)
        except TimeoutError:
            continue
        if ident == b"big":
            got = msg
    assert got is not None and got.nonce == 2

    # 2) frames each under MAXMSGSIZE but together over the limit: recv refuses it
    blob = np.zeros(15_000, np.int32)  # 60 KB frames
    many = M.StepResult(seq=1, worker_id="w", req_ids=["a"], sampled_token_ids=np.zeros(1, np.int32),
                        ranks=np.zeros(1, np.int32))
    frames = C.encode(many)
    frames += [blob.tobytes(), blob.tobytes()]  # 120 KB in all
    other.sock.send_multipart(frames)
    with pytest.raises(C.ProtocolError, match="limit") as ei:
        router.recv(timeout=TIMEOUT)
    assert ei.value.identity == b"other"
    other.send(M.Ping(nonce=3))
    assert router.recv(timeout=TIMEOUT)[1].nonce == 3

    # 3) the sender refuses to encode over the limit at all
    small = T.Channel(other.sock, max_message_size=1000)
    with pytest.raises(C.ProtocolError, match="limit"):
        small.send(M.Submit(request_id="x", prompt="y" * 2000))
    with pytest.raises(C.ProtocolError, match="limit"):
        small.try_send(M.Submit(request_id="x", prompt="y" * 2000))


def test_pub_sub_topic_filtering(socks):
    pub_sock = socks(zmq.PUB)
    addr = T.bind_free_port(pub_sock)
    pub = T.Channel(pub_sock)
    sub1 = T.Channel(socks(zmq.SUB, connect=addr, subscribe=C.group_topic("g1")))
    sub10 = T.Channel(socks(zmq.SUB, connect=addr, subscribe=[C.group_topic("g10")]))

    # PUB drops what it sends before a subscription arrives: probe until each SUB confirms
    pending = {b"g1\x00": sub1, b"g10\x00": sub10}
    deadline = time.monotonic() + TIMEOUT
    while pending and time.monotonic() < deadline:
        for topic, sub in list(pending.items()):
            pub.send(M.Probe(probe_id="p"), topic)
            try:
                got_topic, msg = sub.recv(timeout=0.05)
            except TimeoutError:
                continue
            assert got_topic == topic and isinstance(msg, M.Probe)
            del pending[topic]
    assert not pending, "subscriptions never reached the publisher"
    for sub in (sub1, sub10):  # drain extra probes
        while sub.sock.poll(50):
            sub.sock.recv_multipart()

    for seq in range(3):
        pub.send(M.Step(seq=seq, group="g1"), C.group_topic("g1"))
        pub.send(M.Step(seq=100 + seq, group="g10"), C.group_topic("g10"))
        pub.send(M.Step(seq=200 + seq, group="g2"), C.group_topic("g2"))
        assert pub.try_send(M.Step(seq=300 + seq, group="g2"), C.group_topic("g2")) is True
    for sub, group, base in ((sub1, "g1", 0), (sub10, "g10", 100)):
        seqs = []
        for _ in range(3):
            topic, step = sub.recv(timeout=TIMEOUT)
            assert topic == C.group_topic(group) and step.group == group
            seqs.append(step.seq)
        assert seqs == [base, base + 1, base + 2]
        expect_nothing(sub.sock, 0.1)
    with pytest.raises(ValueError, match="topic"):
        pub.send(M.Ping())
    # a bad message on a SUB names its topic
    pub_sock.send_multipart([C.group_topic("g1"), b"Step", b"\xc1"])
    with pytest.raises(C.ProtocolError) as ei:
        sub1.recv(timeout=TIMEOUT)
    assert ei.value.identity == C.group_topic("g1")


# --------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------


class Recorder:
    def __init__(self):
        self.handled: list[tuple[bytes | None, object]] = []
        self.bad: list[C.ProtocolError] = []
        self.errors: list[tuple[bytes | None, object, Exception]] = []

    def handler(self, peer, msg):
        self.handled.append((peer, msg))

    def on_bad(self, e):
        self.bad.append(e)

    def on_error(self, peer, msg, e):
        self.errors.append((peer, msg, e))


def _inproc_pair(ctx, identity=b"peer-1"):
    """A ROUTER/DEALER pair over inproc: a send is in the receiver's queue when it returns,
    so dispatch sees exactly what was sent."""
    addr = f"inproc://dispatch-{next(_inproc)}"
    router = T.make_socket(ctx, zmq.ROUTER, bind=addr)
    dealer = T.make_socket(ctx, zmq.DEALER, connect=addr, identity=identity)
    return T.Channel(router), T.Channel(dealer)


def _dispatch_until(ch, n, **kw) -> int:
    """dispatch until n messages were handled (tcp delivers asynchronously)."""
    total, deadline = 0, time.monotonic() + TIMEOUT
    while total < n and time.monotonic() < deadline:
        if not ch.poll(0.05):
            continue
        total += ch.dispatch(**kw)
    return total


def test_dispatch_by_type_bad_frames_and_errors(ctx):
    router, dealer = _inproc_pair(ctx)
    try:
        rec = Recorder()
        boom = RuntimeError("handler failed")

        def raising(peer, msg):
            raise boom

        handlers = {M.Ping: rec.handler, M.Abort: rec.handler, M.Goodbye: raising}
        dealer.send(M.Ping(nonce=1))
        dealer.sock.send_multipart([b"Ping", b"\xc1"])  # undecodable
        dealer.send(M.Abort(request_id="a"))
        dealer.send(M.Submit(request_id="s", prompt="x"))  # a type with no handler
        dealer.send(M.Goodbye(worker_id="w"))  # its handler raises
        dealer.sock.send_multipart([b"Nope", b"\x90"])  # unknown type
        dealer.send(M.Ping(nonce=2))
        n = router.dispatch(handlers, on_bad=rec.on_bad, on_error=rec.on_error)
        assert n == 7
        assert [(p, type(m).__name__) for p, m in rec.handled] == [(b"peer-1", "Ping"), (b"peer-1", "Abort"),
                                                                  (b"peer-1", "Ping")]
        assert [m.nonce for _, m in rec.handled if isinstance(m, M.Ping)] == [1, 2]
        assert len(rec.bad) == 2 and all(isinstance(e, C.ProtocolError) for e in rec.bad)
        assert all(e.identity == b"peer-1" for e in rec.bad)  # so the service can answer the sender
        assert "not valid msgpack" in rec.bad[0].reason and "unknown message type" in rec.bad[1].reason
        assert len(rec.errors) == 2
        (p1, m1, e1), (p2, m2, e2) = rec.errors
        assert p1 == b"peer-1" and isinstance(m1, M.Submit) and isinstance(e1, InvalidRequest)
        assert "Submit is not a message this socket takes" in str(e1)
        assert p2 == b"peer-1" and isinstance(m2, M.Goodbye) and e2 is boom
        # nothing left: dispatch returns 0 without blocking
        t0 = time.monotonic()
        assert router.dispatch(handlers, on_bad=rec.on_bad, on_error=rec.on_error) == 0
        assert time.monotonic() - t0 < 0.5
        # the socket keeps serving, and answers the sender of a bad frame
        router.send(M.Error.from_exception(rec.bad[0]), rec.bad[0].identity)
        assert dealer.recv(timeout=TIMEOUT)[1].code == "invalid_request"
    finally:
        router.close()
        dealer.close()


def test_dispatch_limit(ctx):
    router, dealer = _inproc_pair(ctx)
    try:
        rec = Recorder()
        for i in range(5):
            dealer.send(M.Ping(nonce=i))
        kw = dict(handlers={M.Ping: rec.handler}, on_bad=rec.on_bad, on_error=rec.on_error)
        assert router.dispatch(limit=2, **kw) == 2
        assert [m.nonce for _, m in rec.handled] == [0, 1]
        dealer.sock.send_multipart([b"Ping", b"\xc1"])  # bad frames count against the limit too
        assert router.dispatch(limit=2, **kw) == 2
        assert router.dispatch(limit=2, **kw) == 2
        assert router.dispatch(limit=2, **kw) == 0
        assert [m.nonce for _, m in rec.handled] == [0, 1, 2, 3, 4] and len(rec.bad) == 1
        assert router.dispatch(limit=0, **kw) == 0
    finally:
        router.close()
        dealer.close()


def test_dispatch_handlers_may_reply_and_errors_never_stop_the_loop(socks):
    router, dealer, _ = channels(socks)
    errors = []

    def ping(peer, msg):
        router.send(M.Pong(nonce=msg.nonce), peer)

    def on_bad(e):
        router.send(M.Error.from_exception(e), e.identity)

    for i in range(3):
        dealer.send(M.Ping(nonce=i))
        dealer.sock.send_multipart([b"Submit", b"\x91\x05"])  # request_id of the wrong type
    handled = _dispatch_until(router, 6, handlers={M.Ping: ping}, on_bad=on_bad,
                              on_error=lambda p, m, e: errors.append(e))
    assert handled == 6 and not errors
    got = [dealer.recv(timeout=TIMEOUT)[1] for _ in range(6)]
    assert [m.nonce for m in got if isinstance(m, M.Pong)] == [0, 1, 2]
    errs = [m for m in got if isinstance(m, M.Error)]
    assert len(errs) == 3 and all("Submit.request_id" in e.message for e in errs)


# --------------------------------------------------------------------------------------------
# CURVE
# --------------------------------------------------------------------------------------------


def test_curve_allowed_and_refused(ctx, socks, tmp_path):
    from zeroserve.common import curve  # the key helpers; make_socket takes the key files

    server_pub, server_secret = curve.generate_keys(tmp_path / "server", "server")
    _, good_secret = curve.generate_keys(tmp_path / "clients", "good")
    _, bad_secret = curve.generate_keys(tmp_path / "strangers", "bad")
    allowed = tmp_path / "allowed"
    curve.allow_client(allowed, tmp_path / "clients" / "good.key")
    assert (server_secret.stat().st_mode & 0o777) == 0o600

    auth = curve.start_authenticator(ctx, allowed)
    try:
        server_sock = socks(zmq.ROUTER, curve_server_secret_key=server_secret)
        addr = T.bind_free_port(server_sock)
        assert server_sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        server = T.Channel(server_sock)

        good = T.Channel(socks(zmq.DEALER, connect=addr, identity=b"good", curve_client_secret_key=good_secret,
                               curve_server_public_key=server_pub))
        good.send(M.Ping(nonce=11))
        ident, msg = server.recv(timeout=TIMEOUT)
        assert ident == b"good" and msg.nonce == 11
        server.send(M.Pong(nonce=11), ident)
        assert good.recv(timeout=TIMEOUT)[1].nonce == 11

        # a CURVE client whose key is not on the allow-list, and a plain client: refused
        bad = T.Channel(socks(zmq.DEALER, connect=addr, identity=b"bad", curve_client_secret_key=bad_secret,
                              curve_server_public_key=server_pub))
        plain = T.Channel(socks(zmq.DEALER, connect=addr, identity=b"plain"))
        bad.send(M.Ping(nonce=12))
        plain.send(M.Ping(nonce=13))
        expect_nothing(server_sock, 0.7)
        # the allowed client is still served
        good.send(M.Ping(nonce=14))
        assert server.recv(timeout=TIMEOUT)[1].nonce == 14
        with pytest.raises(ValueError, match="both"):
            socks(zmq.DEALER, curve_client_secret_key=good_secret)
    finally:
        auth.stop()


def test_curve_zap_domains(ctx, socks, tmp_path):
    """Per ZAP domain (make_socket(zap_domain=...)): domain "a" admits the allow-list, an unlisted
    one nobody. (A test of its own: a second authenticator on one context races the first one's
    ZAP endpoint, inproc://zeromq.zap.01, which its thread releases only after stop().)"""
    from zeroserve.common import curve

    server_pub, server_secret = curve.generate_keys(tmp_path / "server", "server")
    _, good_secret = curve.generate_keys(tmp_path / "clients", "good")
    allowed = tmp_path / "allowed"
    curve.allow_client(allowed, tmp_path / "clients" / "good.key")
    auth = curve.start_authenticator(ctx, {"a": [allowed]})
    try:
        for domain, admitted in (("a", True), ("b", False)):
            srv = socks(zmq.ROUTER, curve_server_secret_key=server_secret, zap_domain=domain)
            assert srv.getsockopt_string(zmq.ZAP_DOMAIN) == domain
            where = T.bind_free_port(srv)
            peer = T.Channel(socks(zmq.DEALER, connect=where, identity=b"good", curve_client_secret_key=good_secret,
                                   curve_server_public_key=server_pub))
            peer.try_send(M.Ping(nonce=15))
            if admitted:
                assert T.Channel(srv).recv(timeout=TIMEOUT)[1].nonce == 15
            else:
                expect_nothing(srv, 0.7)
    finally:
        auth.stop()
