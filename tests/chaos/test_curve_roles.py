"""Peers holding the wrong role's CURVE key, on a live cluster under CURVE (scheduler,
detokenizer and worker group g0, each process with its role's default key).

1. Client key on the backend port: a raw DEALER with the application's client key says a valid
   HELLO as a worker and gets no answer (refused in the handshake), while the same HELLO with
   a worker key gets a Welcome.
2. Client key on the steps port: a SUB with it sees none of g0's steps (the prompts' tokens)
   while requests run; a SUB with a worker key sees them.
3. Worker key on the client port: a Ping and a Submit get no answer; the client key's Ping gets
   its Pong.
Each time the cluster keeps serving the same greedy tokens and g0 stays its only ready group.
(The handshake per socket and role, in-process: tests/test_curve_cluster.py.)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import zmq

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.common import codec  # noqa: E402
from zeroserve.common import messages as P  # noqa: E402
from zeroserve.common.curve import create_curve_keys, curve_client_keys  # noqa: E402
from zeroserve.common.transport import Channel, make_socket  # noqa: E402
from tests.cluster import LocalCluster, no_leftover_processes  # noqa: E402, F401 (fixture)
from tests.helpers import cached_model_dir, torch_single_thread  # noqa: E402, F401 (fixture)

pytestmark = pytest.mark.usefixtures("no_leftover_processes", "torch_single_thread")

PROMPT = "The roles say"
QUIET_S = 1.5  # how long a refused peer waits for an answer that must not come


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("curve-roles") / "keys"
    create_curve_keys(d)  # one key per role, default names
    return d


@pytest.fixture(scope="module")
def cluster(keys):
    with LocalCluster(cached_model_dir("llama"), workers=1, num_kv_blocks=64,
                      curve_keys=keys).running(timeout=240) as c:
        yield c


@pytest.fixture()
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture(scope="module")
def reference(cluster):
    from zeroserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with cluster.client(timeout_s=30.0) as c:
        return params, c.generate(PROMPT, params).outputs[0].token_ids


def _still_serves(cluster, reference) -> None:
    params, tokens = reference
    with cluster.client(timeout_s=30.0) as c:
        assert c.generate(PROMPT, params).outputs[0].token_ids == tokens
    s = cluster.stats()
    assert [g["name"] for g in s["groups"] if g["state"] == "ready"] == ["g0"], s["groups"]
    assert "evil" not in {g["name"] for g in s["groups"]}, s["groups"]


def _dealer(ctx, addr: str, keys, identity: bytes) -> Channel:
    return Channel(make_socket(ctx, zmq.DEALER, connect=addr, identity=identity, **keys.socket_kwargs()))


def _hello(cluster, group: str) -> P.Hello:
    s = cluster.stats()
    return P.Hello(role="worker", worker_id=f"{group}-r0", group=group, model=s["models"][0], device="cpu",
                   num_kv_blocks=64, block_size=16, max_model_len=256,
                   numeric_mode=s["numeric_modes"][s["models"][0]])  # as the real workers compute


@pytest.mark.timeout(300)
def test_a_client_key_on_the_backend_port_is_refused(cluster, keys, reference, ctx):
    evil, probe = _hello(cluster, "evil"), _hello(cluster, "probe")  # HELLOs the scheduler accepts from a worker
    app = _dealer(ctx, cluster.backend, curve_client_keys(keys, role="client"), b"evil-r0")
    # never blocks: queued for a handshake that fails, or (already refused, no pipe) not taken at all
    app.try_send(evil)
    assert not app.poll(QUIET_S), f"a client key got an answer on the backend port: {app.recv_nowait()}"

    worker = _dealer(ctx, cluster.backend, curve_client_keys(keys, role="worker"), b"probe-r0")
    worker.send(probe)
    _, welcome = worker.recv(timeout=10.0)
    assert isinstance(welcome, P.Welcome), welcome
    worker.sock.close(linger=0)  # its group never gets past probing; the scheduler drops it
    assert not app.poll(0.1)
    app.sock.close(linger=0)
    _still_serves(cluster, reference)


def _steps(ctx, cluster, keys) -> zmq.Socket:
    return make_socket(ctx, zmq.SUB, connect=f"tcp://127.0.0.1:{cluster.port + 2}", subscribe=codec.group_topic("g0"),
                       **keys.socket_kwargs())


def _drain_steps(sub: zmq.Socket) -> int:
    n = 0
    while sub.poll(0):
        _, msg = codec.decode_pub(sub.recv_multipart())
        n += isinstance(msg, P.Step) and not msg.empty
    return n


@pytest.mark.timeout(300)
def test_a_client_key_reads_no_steps(cluster, keys, reference, ctx):
    snoop = _steps(ctx, cluster, curve_client_keys(keys, role="client"))
    peer = _steps(ctx, cluster, curve_client_keys(keys, role="worker"))  # what a worker key may see
    time.sleep(1.0)  # both connect (or are refused) and subscribe before the steps leave
    seen = {"client": 0, "worker": 0}
    deadline = time.monotonic() + 60
    while seen["worker"] == 0 and time.monotonic() < deadline:
        _still_serves(cluster, reference)  # requests run on g0: steps go out on its topic
        time.sleep(0.3)
        seen["client"] += _drain_steps(snoop)
        seen["worker"] += _drain_steps(peer)
    assert seen["worker"] > 0, seen
    assert seen["client"] == 0, seen


@pytest.mark.timeout(300)
def test_a_worker_key_on_the_client_port_is_refused(cluster, keys, reference, ctx):
    from zeroserve.common.sampling_params import SamplingParams

    posing = _dealer(ctx, cluster.address, curve_client_keys(keys, role="worker"), b"posing")
    posing.try_send(P.Ping(nonce=7))  # try_send: a refused DEALER has no pipe left to queue on
    posing.try_send(P.Submit(request_id="posing-1", prompt=PROMPT, params=SamplingParams(max_tokens=4)))
    assert not posing.poll(QUIET_S), f"a worker key got an answer on the client port: {posing.recv_nowait()}"
    posing.sock.close(linger=0)

    app = _dealer(ctx, cluster.address, curve_client_keys(keys, role="client"), b"app")
    app.send(P.Ping(nonce=8))
    _, pong = app.recv(timeout=10.0)
    assert isinstance(pong, P.Pong) and pong.nonce == 8, pong
    app.sock.close(linger=0)
    _still_serves(cluster, reference)
