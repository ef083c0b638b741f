"""Garbage on every socket of a live cluster, while requests run.

Raw ZeroMQ peers (and raw TCP) send the scheduler's client ROUTER and backend ROUTER random
bytes, wrong frame counts, valid msgpack of the wrong shape, unknown type tags, messages meant
for the other socket, a HELLO with an old protocol version, results for steps that do not
exist, and messages that pretend to come from the real worker. A worker's SUB cannot be reached
(the PUB side is the scheduler's), so the pretend-worker messages go through the backend.
Meanwhile a batch of requests runs: every one must come back exactly as in a clean run, every
bad message that gets an answer gets an `Error` (or a refusing `Welcome`) with a readable
reason, nothing fails inside the scheduler, and the cluster still serves afterwards.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.common import codec
from zeroserve.common import messages as P
from zeroserve.common.sampling_params import SamplingParams
from tests.cluster import LocalCluster, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir, greedy_jobs, stream_jobs, torch_single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("no_leftover_processes", "torch_single_thread")

VOCAB = 512
MAX_MODEL_LEN = 2048  # the tiny model's max_position_embeddings (KV: 256 blocks x 16 = 4096 tokens)


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(cached_model_dir("llama"), workers=1, num_kv_blocks=256).running(timeout=240) as c:
        yield c


def _workload() -> list[tuple[list[int], dict]]:
    return greedy_jobs(cached_model_dir("llama"))


@pytest.fixture(scope="module")
def clean_run(cluster):
    """The workload's outputs on the untouched cluster: the reference for the runs under fire."""
    jobs = _workload()
    outs = asyncio.run(stream_jobs(cluster.address, jobs))
    assert all(reason == "length" and len(t) == sp["max_tokens"] for (t, _, reason), (_, sp) in zip(outs, jobs))
    return jobs, outs


# ------------------------------------------------------------------------------ raw peers


class Peer:
    """A raw DEALER on one of the scheduler's ROUTER ports."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes | None = None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity or b"garbage-" + os.urandom(6).hex().encode())
        self.sock.connect(address)

    def send(self, frames: list) -> None:
        self.sock.send_multipart([bytes(f) if isinstance(f, memoryview) else f for f in frames])

    def recv(self, timeout_s: float = 15.0):
        """The next reply, decoded (None when nothing came)."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return codec.decode(self.sock.recv_multipart())

    def ask(self, frames: list, timeout_s: float = 15.0):
        self.send(frames)
        return self.recv(timeout_s)

    def silent(self, wait_s: float = 0.3) -> bool:
        """True when no reply arrives within wait_s (messages the scheduler ignores)."""
        return not self.sock.poll(int(wait_s * 1000))

    def close(self) -> None:
        self.sock.close(linger=0)


def _body(msg) -> list[bytes]:
    return [bytes(f) for f in codec.encode(msg)]


def _submit(request_id: str, **kw) -> list[bytes]:
    ids = kw.pop("prompt_token_ids", None)
    if ids is not None:
        ids = np.asarray(ids, dtype=np.int32)
    return _body(P.Submit(request_id=request_id, prompt_token_ids=ids, **kw))


def _nested(depth: int):
    d: dict = {}
    for _ in range(depth):
        d = {"x": d}
    return d


def _expect_error(reply, *needles: str, code: str = "invalid_request", request_id: str | None = None,
                  garbage: bool = False) -> P.Error:
    assert isinstance(reply, P.Error), f"expected an Error, got {reply!r}"
    assert reply.code == code, f"code {reply.code!r} ({reply.message})"
    # a Submit that does not validate is answered for its request id (r1 in the garbage) when it has one
    assert reply.request_id in ((None, "r1") if garbage else (request_id,)), reply
    assert 10 <= len(reply.message) <= 1000 and reply.message.isprintable(), f"unreadable message {reply.message!r}"
    msg = reply.message.lower()
    for n in needles:
        assert n.lower() in msg, f"{n!r} not in {reply.message!r}"
    return reply


# Bad messages for either ROUTER, each with the words its Error must contain.
def _generic_garbage(rng: random.Random) -> list[tuple[str, list[bytes], tuple[str, ...]]]:
    def rnd(n: int) -> bytes:
        return bytes(rng.getrandbits(8) for _ in range(n))

    valid_ping = _body(P.Ping(nonce=1))
    return [
        ("one random frame", [rnd(64)], ("bad message", "2 frames")),
        ("one empty frame", [b""], ("bad message", "2 frames")),
        ("two random frames", [b"\xff" + rnd(8), rnd(32)], ("unknown message type",)),
        ("many random frames", [rnd(5) for _ in range(40)], ("bad message",)),
        ("unknown type tag", [b"Frobnicate", msgpack.packb([1, 2])], ("unknown message type", "frobnicate")),
        ("empty type tag", [b"", msgpack.packb([])], ("unknown message type",)),
        ("body not msgpack", [b"Submit", b"\xc1\xc1\xc1"], ("submit", "msgpack")),
        ("body truncated", [b"Submit", msgpack.packb(["r1", "hello", None, {}, False, None])[:-3]], ("submit",)),
        ("map instead of array", [b"Submit", msgpack.packb({"request_id": "r1", "prompt": "x"})], ("submit",)),
        ("too few fields", [b"Submit", msgpack.packb(["r1"])], ("submit",)),
        ("too many fields", [b"Ping", msgpack.packb([1, 2, 3, 4])], ("ping",)),
        ("wrong field type", [b"Ping", msgpack.packb(["one"])], ("ping", "int")),
        ("msgpack ext type", [b"Ping", msgpack.packb([msgpack.ExtType(5, b"xx")])], ("ping", "ext")),
        ("unreferenced buffer frame", valid_ping + [b"\x00" * 16], ("buffer",)),
        ("array with a bad buffer ref", [b"Submit", msgpack.packb(["r1", None, [1, [4], 7], {}, False, None])],
         ("submit",)),
        ("array of the wrong dtype", [b"Submit", msgpack.packb(["r1", None, [3, [1], b"\x00" * 4], {}, False, None])],
         ("submit",)),
        ("array shape and bytes disagree",
         [b"Submit", msgpack.packb(["r1", None, [1, [9], b"\x00" * 4], {}, False, None])], ("submit",)),
        ("params nested too deep", [b"Submit", msgpack.packb(["r1", "hi", None, _nested(40), False, None])],
         ("submit",)),
        ("scalar body", [b"Abort", msgpack.packb(7)], ("abort",)),
    ]


def _assert_no_internal_errors(cluster: LocalCluster) -> None:
    log = (cluster.logdir / "scheduler.log").read_text(errors="replace")
    assert "handler failed" not in log and "Traceback" not in log, f"the scheduler failed inside:\n{log[-4000:]}"


# ------------------------------------------------------------------------------ client ROUTER


@pytest.mark.timeout(300)
def test_client_router_answers_garbage_with_readable_errors(cluster):
    ctx = zmq.Context()
    peer = Peer(ctx, cluster.address)
    try:
        for name, frames, needles in _generic_garbage(random.Random(1)):
            reply = peer.ask(frames)
            try:
                _expect_error(reply, *needles, garbage=True)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from None

        # valid messages that do not belong on the client socket
        hello = P.Hello(role="worker", worker_id="w", model="m", num_kv_blocks=1, block_size=16)
        _expect_error(peer.ask(_body(hello)), "hello is not a client message")
        _expect_error(peer.ask(_body(P.StepResult(seq=1, worker_id="w"))), "not a client message")

        # Submits the scheduler must refuse, each answered for its request id
        bad_submits = [
            ("neg-temp", {"prompt": "hi", "params": {"temperature": -1.0}}, ("temperature",)),
            ("unknown-field", {"prompt": "hi", "params": {"temprature": 0.5}}, ("unknown field", "temprature")),
            ("bad-type", {"prompt": "hi", "params": {"max_tokens": "many"}}, ("max_tokens",)),
            ("list-for-int", {"prompt": "hi", "params": {"n": [1, 2]}}, ("params.n", "expected int")),
            ("no-model", {"prompt": "hi", "params": {"model": "no-such-model"}}, ("no-such-model", "not served")),
            ("too-long", {"prompt_token_ids": [5] * MAX_MODEL_LEN}, ("tokens", "max_model_len")),
            ("vocab", {"prompt_token_ids": [5, VOCAB + 7]}, ("token ids", str(VOCAB))),
            ("empty-ids", {"prompt_token_ids": []}, ("empty",)),
        ]
        for rid, kw, needles in bad_submits:
            _expect_error(peer.ask(_submit(rid, **kw)), *needles, request_id=rid)
        _expect_error(peer.ask([b"Submit", msgpack.packb(["", "hi", None, {}, False, None])]), "request_id")
        _expect_error(peer.ask([b"Submit", msgpack.packb(["r", None, None, {}, False, None])]), "prompt", request_id="r")
        _expect_error(peer.ask([b"Submit", msgpack.packb(["r", "hi", None, {}, False, -1.0])]), "timeout_s",
                      request_id="r")

        # ignored without an answer: an Abort for a request nobody runs
        peer.send(_body(P.Abort(request_id="nobody-runs-this")))
        assert peer.silent()

        # the same socket still works: ping, then a real request
        pong = peer.ask(_body(P.Ping(nonce=42)))
        assert isinstance(pong, P.Pong) and pong.nonce == 42
        peer.send(_submit("fine", prompt_token_ids=[5, 6, 7], params=SamplingParams(temperature=0.0, max_tokens=3)))
        toks = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = peer.recv(30)
            assert isinstance(m, P.Outputs), m
            toks += [t for it in m.items for t in it.token_ids]
            if any(it.finish_reason for it in m.items):
                break
        assert len(toks) == 3
    finally:
        peer.close()
        ctx.term()
    _assert_no_internal_errors(cluster)


@pytest.mark.timeout(300)
def test_client_api_raises_invalid_request_with_a_reason(cluster):
    from zeroserve import InvalidRequest, SamplingParams

    with cluster.client(timeout_s=30.0, request_timeout_s=60.0) as c:
        cases = [
            # rejected by the client before anything is sent
            (lambda: c.generate("hi", {"temperature": -0.5}), ("temperature",)),
            (lambda: c.generate("hi", {"max_tokens": 4, "bogus_field": 1}), ("unknown field", "bogus_field")),
            (lambda: c.generate([], {"max_tokens": 4}), ("token ids",)),
            # rejected by the scheduler
            (lambda: c.generate("hi", SamplingParams(max_tokens=4, model="not-served")), ("not-served", "served")),
            (lambda: c.generate([7] * (MAX_MODEL_LEN + 10), SamplingParams(max_tokens=4)), ("max_model_len",)),
            (lambda: c.generate([7, 70000], SamplingParams(max_tokens=4)), (str(VOCAB),)),
            (lambda: list(c.stream([7] * MAX_MODEL_LEN, SamplingParams(max_tokens=4))), ("max_model_len",)),
        ]
        for call, needles in cases:
            with pytest.raises(InvalidRequest) as ei:
                call()
            msg = str(ei.value).lower()
            assert all(n.lower() in msg for n in needles), f"{needles} not all in {ei.value}"
        assert c.generate([7, 8], SamplingParams(max_tokens=2, temperature=0.0)).outputs[0].finish_reason
        assert c.stats()["requests"] == 0


# ------------------------------------------------------------------------------ backend ROUTER


def _hello(**kw) -> P.Hello:
    base = {"role": "worker", "worker_id": "intruder-" + os.urandom(3).hex(), "group": "evil", "model": "",
            "device": "cpu", "host": "nowhere", "pid": 1, "num_kv_blocks": 16, "block_size": 16, "max_model_len": 2048}
    base.update(kw)
    return P.Hello(**base)


@pytest.mark.timeout(300)
def test_backend_router_answers_garbage_and_refuses_bad_hellos(cluster):
    model = cluster.stats()["models"][0]
    ctx = zmq.Context()
    peer = Peer(ctx, cluster.backend)
    try:
        for name, frames, needles in _generic_garbage(random.Random(2)):
            try:
                _expect_error(peer.ask(frames), *needles, garbage=True)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from None

        # HELLO from an older release: refused, and the reason names the versions
        w = peer.ask(_body(_hello(model=model, protocol_version=0)))
        assert isinstance(w, P.Welcome) and not w.accepted, w
        assert "protocol version" in w.detail and "0" in w.detail and str(codec.PROTOCOL_VERSION) in w.detail, w.detail
        w = peer.ask(_body(_hello(role="detokenizer", protocol_version=codec.PROTOCOL_VERSION + 1)))
        assert isinstance(w, P.Welcome) and not w.accepted and "protocol version" in w.detail, w
        # a short HELLO of another version decodes (trailing fields default): refused by version
        w = peer.ask([b"Hello", msgpack.packb(["worker", 0, "old-worker", "g9"])])
        assert isinstance(w, P.Welcome) and not w.accepted and "speaks version 0" in w.detail, w
        # a protocol v1 HELLO (its layout: memory map last, no dist_init_addr) gets v1's WELCOME
        # layout, [accepted, reason, ...], so a v1 worker prints the reason and exits
        v1 = ["worker", 1, "v1-worker", "g9", 0, 1, model, "cpu", "h", 1, 64, 16, 128, {"rss_bytes": 1}]
        peer.send([b"Hello", msgpack.packb(v1)])
        assert peer.sock.poll(15000)
        tag, body = peer.sock.recv_multipart()
        accepted, reason = msgpack.unpackb(body)[:2]
        assert tag == b"Welcome" and accepted is False and "protocol version 1" in reason, reason
        # HELLOs the scheduler cannot serve
        w = peer.ask(_body(_hello(model="some-other-model")))
        assert isinstance(w, P.Welcome) and not w.accepted and "some-other-model" in w.detail, w
        w = peer.ask(_body(_hello(model=model, num_kv_blocks=0)))
        assert isinstance(w, P.Welcome) and not w.accepted and "kv" in w.detail.lower(), w
        w = peer.ask(_body(_hello(model=model, group="g0")))  # rank 0 of g0 is the real worker
        assert isinstance(w, P.Welcome) and not w.accepted and "already connected" in w.detail, w

        # a heartbeat from a worker nobody knows: "say HELLO again"
        w = peer.ask(_body(P.Heartbeat(worker_id="ghost-worker", stats={"steps": 1})))
        assert isinstance(w, P.Welcome) and not w.accepted and "hello" in w.detail.lower(), w
        # a client message on the backend
        _expect_error(peer.ask(_submit("x", prompt="hi")), "submit is not a worker message", request_id="x")

        # messages naming a real worker (or the detokenizer's role) from another connection are
        # refused with an Error and change nothing
        for msg in (P.StepResult(seq=10**9, worker_id="g0-r0", req_ids=["0#0"], sampled_token_ids=np.array([1], np.int32)),
                    P.ProbeAck(worker_id="g0-r0", probe_id="not-the-probe"),
                    P.DetokOutputs(seq=10**9, req_ids=["0#0"], text_deltas=["boo"], stop_strs=[None])):
            _expect_error(peer.ask(_body(msg)), "connection")
        # ignored silently: a result from a worker nobody knows, a peer's own error report
        for msg in (P.StepResult(seq=10**9, worker_id="ghost-worker"),
                    P.Error(code="internal", message="a peer complains")):
            peer.send(_body(msg))
        assert peer.silent(1.0)

        s = cluster.stats()
        g0 = next(g for g in s["groups"] if g["name"] == "g0")
        assert g0["state"] == "ready" and [x["worker_id"] for x in g0["workers"]] == ["g0-r0"]
        assert not any(g["name"] == "evil" for g in s["groups"]), "a refused HELLO left a group behind"
    finally:
        peer.close()
        ctx.term()
    _assert_no_internal_errors(cluster)


# ------------------------------------------------------------------------------ under fire


def _raw_tcp_garbage(host: str, port: int, rng: random.Random) -> None:
    """Connect, write bytes that are no ZMTP greeting, hang up."""
    for payload in (bytes(rng.getrandbits(8) for _ in range(512)), b"\xff" + b"\x00" * 8 + b"\x7f" + b"A" * 100,
                    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"):
        try:
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(payload)
        except OSError:
            pass


@pytest.mark.timeout(420)
def test_requests_in_flight_survive_garbage_on_every_socket(cluster, clean_run):
    jobs, ref = clean_run
    port = cluster.port
    # a monitor on the events PUB sees the stats events throughout
    ctx = zmq.Context()
    events = ctx.socket(zmq.SUB)
    events.setsockopt(zmq.LINGER, 0)
    events.setsockopt(zmq.SUBSCRIBE, b"stats")
    events.connect(f"tcp://127.0.0.1:{port + 3}")

    result: dict = {}

    def run():
        try:
            result["outs"] = asyncio.run(stream_jobs(cluster.address, jobs))
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=run, name="requests-under-fire", daemon=True)
    peers: list[Peer] = []
    raw: list[zmq.Socket] = []
    rounds = 0
    try:
        client_peer = Peer(ctx, cluster.address)
        backend_peer = Peer(ctx, cluster.backend)
        # a peer that claims the real worker's heartbeat identity pattern, sending junk for it
        fake_worker = Peer(ctx, cluster.backend, identity=b"g0-r0-fake")
        peers = [client_peer, backend_peer, fake_worker]
        # wrong socket types on the PUB ports and on the ROUTERs: the ZMTP handshake refuses them
        for addr_port, kind in ((port + 2, zmq.DEALER), (port + 3, zmq.ROUTER), (port, zmq.PUB), (port + 1, zmq.SUB)):
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{addr_port}")
            raw.append(s)
            if kind != zmq.SUB:
                try:
                    s.send_multipart([b"g0\x00", b"Step", b"\xc1"], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

        t.start()
        rng = random.Random(3)
        deadline = time.monotonic() + 300
        while (t.is_alive() or rounds == 0) and time.monotonic() < deadline:
            rounds += 1
            for name, frames, needles in _generic_garbage(rng):
                client_peer.send(frames)
                backend_peer.send(frames)
                fake_worker.send(frames)
            fake_worker.send(_body(P.StepResult(seq=10**6 + rounds, worker_id="g0-r0", req_ids=["0#0"],
                                                sampled_token_ids=np.array([3], np.int32))))
            fake_worker.send(_body(P.ProbeAck(worker_id="g0-r0", probe_id="nope")))
            fake_worker.send(_body(P.Heartbeat(worker_id="g0-r0-nobody", stats={"junk": [1, {"a": None}]})))
            backend_peer.send(_body(_hello(protocol_version=0)))
            client_peer.send([b"Submit", msgpack.packb([f"bad-{rounds}", "x", None, {"top_p": 5.0}])])  # bad params
            client_peer.send(_body(P.Abort(request_id="0#0")))  # someone else's request: not ours to abort
            for p in (port, port + 1, port + 2, port + 3):
                _raw_tcp_garbage("127.0.0.1", p, rng)
            time.sleep(0.2)
        t.join(timeout=120)
        assert not t.is_alive(), "the requests did not finish"
        assert "error" not in result, f"requests failed under garbage: {result.get('error')!r}"
        outs = result["outs"]
        assert rounds >= 1
        bad = [i for i, (a, b) in enumerate(zip(outs, ref)) if a != b]
        assert not bad, f"{len(bad)} requests differ from the clean run, e.g. #{bad[0]}: {outs[bad[0]]} vs {ref[bad[0]]}"

        # every bad message got an Error (drain the replies; no internal errors among them)
        for peer in (client_peer, backend_peer, fake_worker):
            n = 0
            while peer.sock.poll(200):
                m = codec.decode(peer.sock.recv_multipart())
                n += 1
                if isinstance(m, P.Error):
                    assert m.code == "invalid_request", m
                else:
                    assert isinstance(m, P.Welcome) and not m.accepted, m
            assert n > 0
        assert events.poll(5000), "no stats event on the events PUB"
        topic, kind, body = events.recv_multipart()[:3]
        ev = codec.decode([kind, body])
        assert topic == b"stats" and isinstance(ev, P.Event) and ev.kind == "stats"
    finally:
        for p in peers:
            p.close()
        for r in raw:
            r.close(linger=0)
        events.close(linger=0)
        ctx.term()

    # afterwards the cluster serves as before, with the same worker, and nothing failed inside
    outs = asyncio.run(stream_jobs(cluster.address, jobs[:6]))
    assert outs == ref[:6]
    s = cluster.stats()
    g0 = next(g for g in s["groups"] if g["name"] == "g0")
    assert g0["state"] == "ready" and g0["workers"][0]["pid"] == cluster.children["g0-r0"].proc.pid
    assert s["detokenizer"]["connected"] and s["requests"] == 0
    assert all(c.alive() for c in cluster.children.values())
    _assert_no_internal_errors(cluster)
    log = (cluster.logdir / "scheduler.log").read_text(errors="replace")
    assert "group gone" not in log and "detokenizer silent" not in log, log[-4000:]


# ------------------------------------------------------------------------------ impostors


@pytest.mark.timeout(300)
def test_lifecycle_messages_naming_the_worker_from_another_peer_do_not_end_its_group(cluster, clean_run):
    """Runs last: with the bug, the impostor's Goodbye ends g0 (the real worker then joins again)."""
    jobs, ref = clean_run
    log_path = cluster.logdir / "scheduler.log"
    seen = len(log_path.read_text(errors="replace"))
    ctx = zmq.Context()
    impostor = Peer(ctx, cluster.backend, identity=b"not-g0-r0")
    try:
        for msg in (P.WorkerError(worker_id="g0-r0", seq=1, message="impostor"),
                    P.Goodbye(worker_id="g0-r0", reason="impostor"),
                    P.Drain(worker_id="g0-r0")):
            impostor.send(_body(msg))
        time.sleep(1.0)
    finally:
        impostor.close()
        ctx.term()
    cluster.wait_ready(timeout=60)  # with the bug, g0 re-forms once the real worker said HELLO again
    outs = asyncio.run(stream_jobs(cluster.address, jobs[:4]))
    assert outs == ref[:4]
    log = log_path.read_text(errors="replace")[seen:]
    assert "group gone" not in log and "group draining" not in log, log[-3000:]
    s = cluster.stats()
    g0 = next(g for g in s["groups"] if g["name"] == "g0")
    assert g0["state"] == "ready"
