"""common.transport: real sockets on loopback. Every receive has a timeout; every socket is closed."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
import zmq.asyncio

from common import protocol as P
from common import transport as T

TIMEOUT = 5.0  # seconds; generous for loaded CI machines, never reached when things work


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


def expect_nothing(sock, seconds: float) -> None:
    assert not sock.poll(int(seconds * 1000)), "a message arrived that should have been dropped"


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
    assert router.getsockopt(zmq.MAXMSGSIZE) == P.MAX_MESSAGE_SIZE
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


def test_router_dealer_round_trip(socks):
    router, dealer, _ = router_and_dealer(socks)
    T.send_msg(dealer, P.Ping(nonce=7))
    ident, msg = T.recv_msg(router, timeout=TIMEOUT)
    assert ident == b"client-1" and isinstance(msg, P.Ping) and msg.nonce == 7
    T.send_msg(router, P.Pong(nonce=7, scheduler_id="s1"), ident)
    ident2, pong = T.recv_msg(dealer, timeout=TIMEOUT)
    assert ident2 is None and isinstance(pong, P.Pong) and pong.nonce == 7 and pong.protocol_version == 1

    # arrays big enough to travel as their own zero-copy frames
    ids = [f"r{i}" for i in range(50_000)]
    sampled = np.arange(50_000, dtype=np.int32)
    lp = np.random.default_rng(0).random((50_000, 3), dtype=np.float32)
    res = P.StepResult(
        seq=9, worker_id="w", req_ids=ids, sampled_token_ids=sampled, logprobs=lp, logprob_token_ids=np.zeros((50_000, 3), np.int32)
    )
    assert len(P.encode(res)) > 2
    T.send_msg(dealer, res)
    ident, got = T.recv_msg(router, timeout=TIMEOUT)
    assert ident == b"client-1" and P.messages_equal(got, res)

    # every message type survives the trip
    from test_protocol import ALL_SAMPLES

    for m in ALL_SAMPLES:
        T.send_msg(dealer, m)
        _, got = T.recv_msg(router, timeout=TIMEOUT)
        assert P.messages_equal(got, m)


def test_router_mandatory_and_try_send(socks):
    router, dealer, _ = router_and_dealer(socks)
    with pytest.raises(zmq.ZMQError) as ei:
        T.send_msg(router, P.Ping(), b"nobody")
    assert ei.value.errno == zmq.EHOSTUNREACH
    assert T.try_send(router, P.Ping(), b"nobody") is False
    T.send_msg(dealer, P.Ping(nonce=1))
    ident, _ = T.recv_msg(router, timeout=TIMEOUT)
    assert T.try_send(router, P.Ping(nonce=2), ident) is True
    assert T.recv_msg(dealer, timeout=TIMEOUT)[1].nonce == 2
    with pytest.raises(ValueError, match="identity"):
        T.send_msg(router, P.Ping())  # a ROUTER needs to know whom to send to


def test_recv_timeout(socks):
    router, _dealer, _ = router_and_dealer(socks)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        T.recv_msg(router, timeout=0.05)
    assert time.monotonic() - t0 < 2


def test_bad_message_is_reported_with_sender_and_socket_keeps_serving(socks):
    router, dealer, _ = router_and_dealer(socks)
    dealer.send_multipart([b"Submit", b"\xc1garbage"])
    with pytest.raises(P.ProtocolError) as ei:
        T.recv_msg(router, timeout=TIMEOUT)
    assert ei.value.identity == b"client-1" and "not valid msgpack" in ei.value.reason
    # the service answers the sender with a typed error...
    T.send_msg(router, P.Error.from_exception(ei.value), ei.value.identity)
    _, err = T.recv_msg(dealer, timeout=TIMEOUT)
    assert isinstance(err, P.Error) and err.code == "invalid_request"
    # ...and goes on serving
    dealer.send_multipart([b"Unknown", b"\x90"])
    with pytest.raises(P.ProtocolError, match="unknown message type"):
        T.recv_msg(router, timeout=TIMEOUT)
    T.send_msg(dealer, P.Abort(request_id="x"))
    assert T.recv_msg(router, timeout=TIMEOUT)[1].request_id == "x"


def test_size_limit_drops_oversized_message_without_killing_the_socket(socks):
    limit = 64 * 1024
    router, big_sender, addr = router_and_dealer(socks, identity=b"big", max_message_size=limit)
    other = socks(zmq.DEALER, connect=addr, identity=b"other")

    # 1) one frame over MAXMSGSIZE: libzmq drops it (and that peer's connection)
    T.send_msg(big_sender, P.Submit(request_id="huge", prompt_token_ids=np.zeros(100_000, np.int32)))
    expect_nothing(router, 0.3)
    # the other peers are served as before
    T.send_msg(other, P.Ping(nonce=1))
    ident, msg = T.recv_msg(router, timeout=TIMEOUT)
    assert ident == b"other" and msg.nonce == 1
    # the offender reconnects by itself and is served again
    deadline = time.monotonic() + TIMEOUT
    got = None
    while got is None and time.monotonic() < deadline:
        T.send_msg(big_sender, P.Ping(nonce=2))
        try:
            ident, msg = T.recv_msg(router, timeout=0.2)
        except TimeoutError:
            continue
        if ident == b"big":
            got = msg
    assert got is not None and got.nonce == 2

    # 2) frames each under MAXMSGSIZE but together over the limit: recv_msg refuses it
    blob = np.zeros(15_000, np.int32)  # 60 KB frames
    many = P.StepResult(
        seq=1, worker_id="w", req_ids=["a"], sampled_token_ids=np.zeros(1, np.int32), ranks=np.zeros(1, np.int32), step_time_s=0.0
    )
    frames = P.encode(many)
    frames += [blob.tobytes(), blob.tobytes()]  # 120 KB in all
    other.send_multipart(frames)
    with pytest.raises(P.ProtocolError, match="limit") as ei:
        T.recv_msg(router, timeout=TIMEOUT, max_message_size=limit)
    assert ei.value.identity == b"other"
    T.send_msg(other, P.Ping(nonce=3))
    assert T.recv_msg(router, timeout=TIMEOUT, max_message_size=limit)[1].nonce == 3

    # 3) the sender refuses to encode over the limit at all
    with pytest.raises(P.ProtocolError, match="limit"):
        T.send_msg(other, P.Submit(request_id="x", prompt="y" * 2000), max_message_size=1000)


def test_pub_sub_topic_filtering(socks):
    pub = socks(zmq.PUB)
    addr = T.bind_free_port(pub)
    sub1 = socks(zmq.SUB, connect=addr, subscribe=P.group_topic("g1"))
    sub10 = socks(zmq.SUB, connect=addr, subscribe=[P.group_topic("g10")])

    # PUB drops what it sends before a subscription arrives: probe until each SUB confirms
    pending = {b"g1\x00": sub1, b"g10\x00": sub10}
    deadline = time.monotonic() + TIMEOUT
    while pending and time.monotonic() < deadline:
        for topic, sub in list(pending.items()):
            T.send_msg(pub, P.Probe(probe_id="p"), topic)
            try:
                got_topic, msg = T.recv_msg(sub, timeout=0.05)
            except TimeoutError:
                continue
            assert got_topic == topic and isinstance(msg, P.Probe)
            del pending[topic]
    assert not pending, "subscriptions never reached the publisher"
    for sub in (sub1, sub10):  # drain extra probes
        while sub.poll(50):
            sub.recv_multipart()

    for seq in range(3):
        T.send_msg(pub, P.Step(seq=seq, group="g1"), P.group_topic("g1"))
        T.send_msg(pub, P.Step(seq=100 + seq, group="g10"), P.group_topic("g10"))
        T.send_msg(pub, P.Step(seq=200 + seq, group="g2"), P.group_topic("g2"))
    for sub, group, base in ((sub1, "g1", 0), (sub10, "g10", 100)):
        seqs = []
        for _ in range(3):
            topic, step = T.recv_msg(sub, timeout=TIMEOUT)
            assert topic == P.group_topic(group) and step.group == group
            seqs.append(step.seq)
        assert seqs == [base, base + 1, base + 2]
        expect_nothing(sub, 0.1)
    with pytest.raises(ValueError, match="topic"):
        T.send_msg(pub, P.Ping())


async def test_asyncio_sockets():
    actx = T.make_context(asyncio_ctx=True)
    router = dealer = None
    try:
        router = T.make_socket(actx, zmq.ROUTER)
        addr = T.bind_free_port(router)
        dealer = T.make_socket(actx, zmq.DEALER, connect=addr, identity=b"async-client")
        await T.asend_msg(dealer, P.Submit(request_id="a", prompt="hi", stream=True))
        ident, msg = await T.arecv_msg(router, timeout=TIMEOUT)
        assert ident == b"async-client" and msg.prompt == "hi" and msg.stream
        await T.asend_msg(router, P.Outputs(items=[P.Output(request_id="a", token_ids=[1, 2], text="ok")]), ident)
        _, outs = await T.arecv_msg(dealer, timeout=TIMEOUT)
        assert outs.items[0].token_ids.tolist() == [1, 2]
        with pytest.raises(TimeoutError):
            await T.arecv_msg(dealer, timeout=0.05)
        # a receive cancelled by its timeout does not eat the next message
        await T.asend_msg(router, P.Ping(nonce=5), ident)
        assert (await T.arecv_msg(dealer, timeout=TIMEOUT))[1].nonce == 5
    finally:
        T.close_all(router, dealer)
        actx.destroy(linger=0)


def test_curve_allowed_and_refused(ctx, socks, tmp_path):
    server_pub, server_secret = T.generate_keys(tmp_path / "server", "server")
    _, good_secret = T.generate_keys(tmp_path / "clients", "good")
    _, bad_secret = T.generate_keys(tmp_path / "strangers", "bad")
    allowed = tmp_path / "allowed"
    T.allow_client(allowed, tmp_path / "clients" / "good.key")
    assert (server_secret.stat().st_mode & 0o777) == 0o600

    auth = T.start_authenticator(ctx, allowed)
    try:
        server = socks(zmq.ROUTER, curve_server_secret_key=server_secret)
        addr = T.bind_free_port(server)
        assert server.getsockopt(zmq.MECHANISM) == zmq.CURVE

        good = socks(
            zmq.DEALER, connect=addr, identity=b"good", curve_client_secret_key=good_secret, curve_server_public_key=server_pub
        )
        T.send_msg(good, P.Ping(nonce=11))
        ident, msg = T.recv_msg(server, timeout=TIMEOUT)
        assert ident == b"good" and msg.nonce == 11
        T.send_msg(server, P.Pong(nonce=11), ident)
        assert T.recv_msg(good, timeout=TIMEOUT)[1].nonce == 11

        # a CURVE client whose key is not on the allow-list, and a plain client: refused
        bad = socks(
            zmq.DEALER, connect=addr, identity=b"bad", curve_client_secret_key=bad_secret, curve_server_public_key=server_pub
        )
        plain = socks(zmq.DEALER, connect=addr, identity=b"plain")
        T.send_msg(bad, P.Ping(nonce=12))
        T.send_msg(plain, P.Ping(nonce=13))
        expect_nothing(server, 0.7)
        # the allowed client is still served
        T.send_msg(good, P.Ping(nonce=14))
        assert T.recv_msg(server, timeout=TIMEOUT)[1].nonce == 14
        with pytest.raises(ValueError, match="both"):
            socks(zmq.DEALER, curve_client_secret_key=good_secret)
    finally:
        auth.stop()
