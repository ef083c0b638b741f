"""CURVE (ZeroMQ authentication + encryption) wired through the key directory, the CLI, the
services and the client.

Unit tests: `zeroserve keys DIR` (layout, modes, reruns keep keys, adds clients, a revoked
client stays out), the loaders' errors (each names the missing file and the command that makes
it), and the scheduler's sockets in-process (all four are CURVE servers, the authenticator
stops with it; a non-loopback bind without CURVE logs one warning).

Integration (one real cluster on loopback, started with `--curve-keys`): an allowed client,
using a client host's partial copy of the key folder, gets the same greedy tokens as the
in-process `zeroserve.LLM`; a client without keys and a client whose key is not allowed get
`ClusterUnavailable` within their short timeout while the good client keeps being served; a
worker holding a not-allowed key never joins.
"""

from __future__ import annotations

import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import zmq

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common.errors import ClusterUnavailable, CurveKeyError, ZeroserveError  # noqa: E402
from common.curve import create_curve_keys, curve_client_keys, curve_server_keys, generate_keys  # noqa: E402
from common.transport import free_port_block  # noqa: E402
from tests.cluster import LocalCluster, no_leftover_processes  # noqa: E402, F401 (fixture)
from tests.helpers import cached_model_dir, torch_single_thread  # noqa: E402, F401 (fixture)

pytestmark = pytest.mark.usefixtures("no_leftover_processes", "torch_single_thread")

PROMPT = "The cluster says"
MAX_TOKENS = 12


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------ zeroserve keys


def test_keys_command_creates_layout_and_reruns_keep_keys(tmp_path, capsys):
    from services.cli import main

    d = tmp_path / "keys"
    assert main(["keys", str(d)]) == 0
    out = capsys.readouterr().out
    files = set(_snapshot(d))
    assert files == {"server.key", "server.key_secret", "clients/client.key", "clients/client.key_secret",
                     "allowed/client.key"}
    for secret in ("server.key_secret", "clients/client.key_secret"):
        assert (d / secret).stat().st_mode & 0o777 == 0o600, secret
    assert (d / "allowed/client.key").read_bytes() == (d / "clients/client.key").read_bytes()
    # it says where each file goes
    assert str(d.resolve()) in out and "scheduler host only" in out and "every host" in out
    assert "clients/client.key_secret" in out and "--curve-keys" in out and "--curve-client" in out

    before = _snapshot(d)
    assert main(["keys", str(d)]) == 0  # a rerun changes nothing
    assert _snapshot(d) == before
    assert "created" not in capsys.readouterr().out

    assert main(["keys", str(d), "--client", "w1", "--client", "client", "--client", "w2"]) == 0
    after = _snapshot(d)
    assert {k: after[k] for k in before} == before  # existing keys kept, byte for byte
    for name in ("w1", "w2"):
        assert after[f"allowed/{name}.key"] == after[f"clients/{name}.key"]
        assert f"clients/{name}.key_secret" in after
    capsys.readouterr()

    # revoked (its public key removed from allowed/): a rerun does not let it back in
    (d / "allowed/w1.key").unlink()
    assert main(["keys", str(d), "--client", "w1"]) == 0
    assert not (d / "allowed/w1.key").exists()
    assert "NOT allowed" in capsys.readouterr().out

    # bad names and half key pairs: exit 2 with a message that says what to do
    assert main(["keys", str(d), "--client", "../evil"]) == 2
    assert "bad CURVE client name" in capsys.readouterr().err
    (d / "server.key").unlink()
    assert main(["keys", str(d)]) == 2
    err = capsys.readouterr().err
    assert "server.key" in err and "not replacing" in err and (d / "server.key_secret").exists()


# ------------------------------------------------------------------------------ loaders


def test_loaders_name_the_missing_file_and_the_command(tmp_path):
    assert curve_server_keys(None) is None and curve_client_keys(None) is None and curve_client_keys("") is None
    missing = tmp_path / "nope"
    for load in (curve_server_keys, curve_client_keys):
        with pytest.raises(CurveKeyError, match=rf"{missing}.*does not exist.*zeroserve keys {missing}"):
            load(missing)
    assert issubclass(CurveKeyError, ValueError) and issubclass(CurveKeyError, ZeroserveError)

    d = tmp_path / "keys"
    create_curve_keys(d)
    server = curve_server_keys(d)
    assert server.secret_key_file == d / "server.key_secret" and server.allowed_dir == d / "allowed"
    assert server.socket_kwargs() == {"curve_server_secret_key": d / "server.key_secret"}
    client = curve_client_keys(d)
    assert client.name == "client" and client.secret_key_file == d / "clients/client.key_secret"
    assert client.server_public_key_file == d / "server.key"

    with pytest.raises(CurveKeyError, match=r"clients/w9\.key_secret.*zeroserve keys .* --client w9"):
        curve_client_keys(d, "w9")
    with pytest.raises(CurveKeyError, match="bad CURVE client name"):
        curve_client_keys(d, "a/b")

    # a client host holds server.key and its own secret only: enough for a client, not for a server
    host = tmp_path / "client-host"
    (host / "clients").mkdir(parents=True)
    shutil.copy(d / "server.key", host / "server.key")
    shutil.copy(d / "clients/client.key_secret", host / "clients/client.key_secret")
    assert curve_client_keys(host).secret_key_file == host / "clients/client.key_secret"
    with pytest.raises(CurveKeyError, match=r"server\.key_secret.*scheduler's secret key.*zeroserve keys"):
        curve_server_keys(host)
    (host / "server.key").unlink()
    with pytest.raises(CurveKeyError, match=r"server\.key \(the scheduler's public key\).*copy server\.key"):
        curve_client_keys(host)
    # a public key where a secret one belongs; garbage; an empty allow-list
    shutil.copy(d / "clients/client.key", host / "clients/client.key_secret")
    with pytest.raises(CurveKeyError, match="holds no secret key"):
        curve_client_keys(host)
    (host / "clients/client.key_secret").write_text("not a key\n")
    with pytest.raises(CurveKeyError, match="broken CURVE key file"):
        curve_client_keys(host)
    (d / "allowed/client.key").unlink()
    with pytest.raises(CurveKeyError, match=r"no allowed client keys.*zeroserve keys .* --client client"):
        curve_server_keys(d)


def test_cli_reports_a_missing_key_file(tmp_path, capsys):
    from services.cli import main

    d = tmp_path / "keys"
    create_curve_keys(d)
    rc = main(["status", "--address", "tcp://127.0.0.1:1", "--curve-keys", str(d), "--curve-client", "ops"])
    assert rc == 1
    assert "clients/ops.key_secret" in capsys.readouterr().err


def test_up_passes_the_key_directory_to_every_child(tmp_path):
    from services.cli import build_parser
    from services.launcher import plan_children

    args = build_parser().parse_args(["up", "--workers", "2", "--tp", "2", "--curve-keys", str(tmp_path / "k")])
    children = plan_children(args, "/m")
    assert len(children) == 6
    for c in children:
        assert c.argv[c.argv.index("--curve-keys") + 1] == str((tmp_path / "k").resolve()), c.name
        assert build_parser().parse_args(c.argv[3:]).curve_keys == str((tmp_path / "k").resolve())
    plain = plan_children(build_parser().parse_args(["up"]), "/m")
    assert not any("--curve-keys" in c.argv for c in plain)


def test_worker_and_detokenizer_check_keys_at_start(tmp_path):
    from common.config import EngineArgs
    from services.detokenizer.service import DetokenizerService
    from services.worker.service import WorkerService

    model = str(cached_model_dir("llama"))
    with pytest.raises(CurveKeyError, match="does not exist"):
        WorkerService(EngineArgs(model=model), "tcp://127.0.0.1:1", curve_keys=str(tmp_path / "none"))
    create_curve_keys(tmp_path / "k")
    with pytest.raises(CurveKeyError, match=r"clients/det\.key_secret"):
        DetokenizerService("tcp://127.0.0.1:1", [model], curve_keys=str(tmp_path / "k"), curve_client="det")


# ------------------------------------------------------------------------------ scheduler sockets


def _scheduler(host: str, curve_keys=None):
    from services.scheduler.service import SchedulerConfig, SchedulerService

    ctx = zmq.Context()
    cfg = SchedulerConfig(host=host, port=free_port_block(4, host="127.0.0.1"), models=[], curve_keys=curve_keys)
    return SchedulerService(cfg, ctx=ctx), ctx


def test_scheduler_sockets_are_curve_servers_and_the_authenticator_stops(tmp_path):
    create_curve_keys(tmp_path / "k")
    svc, ctx = _scheduler("127.0.0.1", str(tmp_path / "k"))
    try:
        socks = (svc.client_sock, svc.backend, svc.steps_pub, svc.events_pub)
        assert all(s.getsockopt(zmq.MECHANISM) == zmq.CURVE and s.getsockopt(zmq.CURVE_SERVER) for s in socks)
        auth = svc.auth
        assert auth is not None and auth.is_alive()
    finally:
        svc.close()
        ctx.term()
    assert svc.auth is None and not auth.is_alive()
    plain, ctx = _scheduler("127.0.0.1")
    try:
        assert plain.auth is None and plain.client_sock.getsockopt(zmq.MECHANISM) == zmq.NULL
    finally:
        plain.close()
        ctx.term()


def test_non_loopback_bind_without_curve_warns_once(tmp_path):
    from structlog.testing import capture_logs

    create_curve_keys(tmp_path / "k")
    for host, keys, warned in (("0.0.0.0", None, 1), ("127.0.0.1", None, 0), ("0.0.0.0", str(tmp_path / "k"), 0)):
        with capture_logs() as logs:
            svc, ctx = _scheduler(host, keys)
            svc.close()
            ctx.term()
        warnings = [e for e in logs if e["log_level"] == "warning" and "without CURVE" in e["event"]]
        assert len(warnings) == warned, (host, keys, logs)
        if warned:
            assert "zeroserve keys" in warnings[0]["event"] and "--curve-keys" in warnings[0]["event"]


# ------------------------------------------------------------------------------ a real cluster


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_model_dir("llama")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    """client "client" allowed; "stranger" has a key pair in the folder but was revoked."""
    d = tmp_path_factory.mktemp("curve") / "keys"
    create_curve_keys(d, ["client", "stranger"])
    (d / "allowed" / "stranger.key").unlink()
    return d


@pytest.fixture(scope="module")
def cluster(model_dir, keys):
    c = LocalCluster(model_dir, workers=1, num_kv_blocks=64, curve_keys=keys)
    try:
        c.start()  # returns at once; the processes start while the test computes its reference
        c.start_worker("intruder", extra=["--curve-client", "stranger"])
        yield c
    finally:
        c.stop()


def _refused(make_client, call) -> float:
    t0 = time.monotonic()
    with make_client() as c, pytest.raises(ClusterUnavailable) as ei:
        call(c)
    took = time.monotonic() - t0
    assert took < 5.0, took
    return ei.value


@pytest.mark.timeout(240)
def test_curve_cluster_serves_allowed_clients_only(cluster, keys, model_dir, tmp_path):
    from zeroserve import LLM, Client, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = LLM(str(model_dir), num_kv_blocks=64).generate(PROMPT, params)[0].outputs[0]

    cluster.wait_ready(groups=1, timeout=180)

    # an allowed client on a "client host": only server.key and its own secret key
    host = tmp_path / "client-host"
    (host / "clients").mkdir(parents=True)
    shutil.copy(keys / "server.key", host / "server.key")
    shutil.copy(keys / "clients/client.key_secret", host / "clients/client.key_secret")
    with Client(cluster.address, timeout_s=10.0, curve_keys=host) as good:
        out = good.generate(PROMPT, params).outputs[0]
        assert out.token_ids == ref.token_ids and out.text == ref.text

        # no keys at all, and a key pair that is not allowed: refused, the cluster goes on serving
        err = _refused(lambda: Client(cluster.address, timeout_s=1.0, curve_keys=False), lambda c: c.stats())
        assert "curve_keys" in str(err)
        err = _refused(lambda: Client(cluster.address, timeout_s=1.0, curve_keys=keys, curve_client_name="stranger"),
                       lambda c: c.generate(PROMPT, params))
        assert "'stranger'" in str(err) and "allowed" in str(err)
        outsider = tmp_path / "outsider"  # a key pair the scheduler has never seen
        shutil.copytree(host, outsider)
        generate_keys(outsider / "clients", "client")
        _refused(lambda: Client(cluster.address, timeout_s=1.0, curve_keys=outsider), lambda c: c.health())

        out = good.generate(PROMPT, params).outputs[0]
        assert out.token_ids == ref.token_ids

    # the CLI: `zeroserve status --curve-keys` is served, without keys it is not
    from services.cli import main

    assert main(["status", "--address", cluster.address, "--curve-keys", str(keys), "--json"]) == 0
    assert main(["status", "--address", cluster.address, "--timeout", "1"]) == 1

    # the worker with the revoked key is up and saying HELLO, and never joins
    log = cluster.logdir / "intruder-r0.log"
    deadline = time.monotonic() + 90
    while "no answer from the scheduler yet" not in (log.read_text(errors="replace") if log.exists() else ""):
        assert cluster.children["intruder-r0"].proc.poll() is None, cluster.logs()
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.5)
    assert "curve_client=stranger" in log.read_text(errors="replace")
    s = cluster.stats()
    assert [g["name"] for g in s["groups"]] == ["g0"], s["groups"]
    assert [w["worker_id"] for w in s["groups"][0]["workers"]] == ["g0-r0"]
    # refused, it still stops on SIGTERM (a blocking HELLO send once hung it here)
    t0 = time.monotonic()
    cluster.kill("intruder-r0", signal.SIGTERM)
    assert cluster.wait_exit("intruder-r0", timeout=15) == 0
    assert time.monotonic() - t0 < 5.0
