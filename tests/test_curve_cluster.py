"""CURVE (ZeroMQ authentication + encryption) wired through the key directory, the CLI, the
services and the client.

Unit tests: `zeroserve keys DIR` (one key pair per role: client, worker, detokenizer; modes,
reruns keep keys, role flags add keys, a revoked key stays out), the old single-role layout
(the scheduler and `up` stop naming it, `zeroserve keys` migrates it), the loaders' errors (each
names the missing file and the command that makes it), and the scheduler's sockets in-process
(all four are CURVE servers with their own ZAP domain, each admits only its roles' keys in the
handshake, the authenticator stops with it; without CURVE one warning, stronger off loopback).

Integration (one real cluster on loopback, started with `--curve-keys`, each process with its
role's default key): an allowed client, using a client host's partial copy of the key folder,
gets the same greedy tokens as the in-process `zeroserve.LLM`; a client without keys, with a
revoked or unknown key, or with a worker's key gets `ClusterUnavailable` within its short
timeout while the good client keeps being served; a worker holding a revoked worker key never
joins. Client keys on the backend and steps ports: tests/chaos/test_curve_roles.py.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.common.errors import ClusterUnavailable, CurveKeyError, ZeroserveError  # noqa: E402
from zeroserve.common.curve import create_curve_keys, curve_client_keys, curve_server_keys, generate_keys  # noqa: E402
from zeroserve.common.transport import free_port_block  # noqa: E402
from tests.cluster import LocalCluster, no_leftover_processes  # noqa: E402, F401 (fixture)
from tests.helpers import cached_model_dir, torch_single_thread  # noqa: E402, F401 (fixture)

pytestmark = pytest.mark.usefixtures("no_leftover_processes", "torch_single_thread")

PROMPT = "The cluster says"
MAX_TOKENS = 12


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------ zeroserve keys

DEFAULT_FILES = {"server.key", "server.key_secret", "clients/client.key", "clients/client.key_secret",
                 "workers/worker.key", "workers/worker.key_secret", "detokenizers/detokenizer.key",
                 "detokenizers/detokenizer.key_secret", "allowed/clients/client.key", "allowed/workers/worker.key",
                 "allowed/detokenizers/detokenizer.key"}


def test_keys_command_creates_layout_and_reruns_keep_keys(tmp_path, capsys):
    from zeroserve.services.cli import main

    d = tmp_path / "keys"
    assert main(["keys", str(d)]) == 0
    out = capsys.readouterr().out
    assert set(_snapshot(d)) == DEFAULT_FILES
    for secret in ("server.key_secret", "clients/client.key_secret", "workers/worker.key_secret",
                   "detokenizers/detokenizer.key_secret"):
        assert (d / secret).stat().st_mode & 0o777 == 0o600, secret
    for role, name in (("clients", "client"), ("workers", "worker"), ("detokenizers", "detokenizer")):
        assert (d / f"allowed/{role}/{name}.key").read_bytes() == (d / f"{role}/{name}.key").read_bytes()
    # it says where each file goes, per role
    assert str(d.resolve()) in out and "scheduler host only" in out and "every host" in out
    for f in ("clients/client.key_secret", "workers/worker.key_secret", "detokenizers/detokenizer.key_secret"):
        assert f in out, f
    assert "worker hosts" in out and "detokenizer host" in out and "client hosts" in out
    assert "--curve-keys" in out and "--curve-client" in out

    before = _snapshot(d)
    assert main(["keys", str(d)]) == 0  # a rerun changes nothing
    assert _snapshot(d) == before
    assert "created" not in capsys.readouterr().out

    assert main(["keys", str(d), "--client", "w1", "--client", "client", "--client", "w2"]) == 0
    after = _snapshot(d)
    assert {k: after[k] for k in before} == before  # existing keys kept, byte for byte
    for name in ("w1", "w2"):
        assert after[f"allowed/clients/{name}.key"] == after[f"clients/{name}.key"]
        assert f"clients/{name}.key_secret" in after
    capsys.readouterr()

    # revoked (its public key removed from allowed/clients/): a rerun does not let it back in
    (d / "allowed/clients/w1.key").unlink()
    assert main(["keys", str(d), "--client", "w1"]) == 0
    assert not (d / "allowed/clients/w1.key").exists()
    assert "NOT allowed" in capsys.readouterr().out
    (d / "allowed/workers/worker.key").unlink()  # a revoked default stays out on a plain rerun too
    assert main(["keys", str(d)]) == 0
    assert not (d / "allowed/workers/worker.key").exists()
    capsys.readouterr()

    # bad names and half key pairs: exit 2 with a message that says what to do
    assert main(["keys", str(d), "--client", "../evil"]) == 2
    assert "bad CURVE key name" in capsys.readouterr().err
    assert main(["keys", str(d), "--worker", "a/b"]) == 2
    assert "bad CURVE key name" in capsys.readouterr().err
    (d / "server.key").unlink()
    assert main(["keys", str(d)]) == 2
    err = capsys.readouterr().err
    assert "server.key" in err and "not replacing" in err and (d / "server.key_secret").exists()


def test_keys_command_role_flags(tmp_path, capsys):
    from zeroserve.services.cli import main

    d = tmp_path / "keys"
    # a fresh folder with some role flags: those names, and each role without a key yet gets its default
    assert main(["keys", str(d), "--worker", "w1", "--worker", "w2", "--detokenizer", "det"]) == 0
    out = capsys.readouterr().out
    assert set(_snapshot(d)) == {
        "server.key", "server.key_secret", "clients/client.key", "clients/client.key_secret",
        "allowed/clients/client.key", "detokenizers/det.key", "detokenizers/det.key_secret",
        "allowed/detokenizers/det.key",
        *(f"{p}/{n}{ext}" for n in ("w1", "w2") for p, ext in (("workers", ".key"), ("workers", ".key_secret"),
                                                              ("allowed/workers", ".key")))}
    assert "secret key of worker 'w1'" in out and "secret key of detokenizer 'det'" in out
    assert "workers allowed on the backend and steps ports: w1, w2" in out
    assert "clients allowed on the client port: client" in out

    # later flags add only what they name (no default for a role that has keys already)
    before = _snapshot(d)
    assert main(["keys", str(d), "--client", "app"]) == 0
    after = _snapshot(d)
    assert set(after) - set(before) == {"clients/app.key", "clients/app.key_secret", "allowed/clients/app.key"}
    assert {k: after[k] for k in before} == before
    capsys.readouterr()
    # a process loads its role's key by name; the default name is the role's
    assert curve_client_keys(d, "w2", role="worker").secret_key_file == d / "workers/w2.key_secret"
    assert curve_client_keys(d, role="detokenizer", name="det").role == "detokenizer"
    with pytest.raises(CurveKeyError, match=r"workers/worker\.key_secret.*zeroserve keys .* --worker worker"):
        curve_client_keys(d, role="worker")
    # the half-pair rule holds per role folder
    (d / "workers/w1.key").unlink()
    assert main(["keys", str(d), "--worker", "w1"]) == 2
    assert "not replacing half a key pair" in capsys.readouterr().err


def _old_layout(d: Path, names=("client", "worker1"), revoked=("gone",)) -> None:
    """A key folder as the single-role `zeroserve keys` made it: every key a client key, one flat allow-list."""
    generate_keys(d, "server")
    for name in (*names, *revoked):
        generate_keys(d / "clients", name)
    (d / "allowed").mkdir()
    for name in names:
        shutil.copy(d / f"clients/{name}.key", d / f"allowed/{name}.key")


def test_old_layout_stops_the_scheduler_and_keys_migrates_it(tmp_path, capsys):
    from zeroserve.services.cli import main

    d = tmp_path / "keys"
    _old_layout(d)
    old = _snapshot(d)
    with pytest.raises(CurveKeyError, match=rf"old CURVE key layout: client\.key, worker1\.key directly in "
                                            rf"{d / 'allowed'}.*allowed/clients/.*Migrate with `zeroserve keys {d}`"):
        curve_server_keys(d)
    # `zeroserve up` checks the same at start: exit 2 with that message, before any child starts
    r = subprocess.run([sys.executable, "-m", "zeroserve.services.cli", "up", "--curve-keys", str(d), "--port", "1",
                        "--model", str(cached_model_dir("llama"))], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, check=False)
    assert r.returncode == 2 and "old CURVE key layout" in r.stderr and "zeroserve keys" in r.stderr, r
    assert "scheduler " not in r.stdout, r.stdout

    assert main(["keys", str(d)]) == 0
    out = capsys.readouterr().out
    assert "migrated from the old layout: client, worker1" in out and "allowed/clients/" in out
    new = _snapshot(d)
    assert not list((d / "allowed").glob("*.key"))
    for name in ("client", "worker1"):  # the allowed keys are now client keys, byte for byte
        assert new[f"allowed/clients/{name}.key"] == old[f"allowed/{name}.key"]
    assert "allowed/clients/gone.key" not in new  # revoked stays out
    for f in ("server.key", "server.key_secret", "clients/client.key_secret", "clients/worker1.key_secret"):
        assert new[f] == old[f], f  # nothing replaced
    # workers and detokenizers got keys of their own; the scheduler starts with this folder
    assert {"workers/worker.key_secret", "allowed/workers/worker.key", "detokenizers/detokenizer.key_secret",
            "allowed/detokenizers/detokenizer.key"} <= set(new)
    assert curve_server_keys(d).key_counts() == {"client": 2, "worker": 1, "detokenizer": 1}
    # a worker still named after its old client key is told that it needs a worker key now
    with pytest.raises(CurveKeyError, match=r"workers/worker1\.key_secret.*--worker worker1.*is a client key"):
        curve_client_keys(d, "worker1", role="worker")
    assert main(["keys", str(d)]) == 0 and _snapshot(d) == new  # migrated once
    capsys.readouterr()

    # migration by the library call, and a flat key that lands next to the role folders later
    shutil.copy(d / "clients/gone.key", d / "allowed/gone.key")
    with pytest.raises(CurveKeyError, match="old CURVE key layout: gone.key"):
        curve_server_keys(d)
    kd = create_curve_keys(d)
    assert kd.migrated == ["gone"] and kd.allowed["client"]["gone"] and not kd.created["client"]["gone"]
    assert curve_server_keys(d).key_counts()["client"] == 3


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
    assert server.allow_lists() == {
        "client": [d / "allowed/clients"], "backend": [d / "allowed/workers", d / "allowed/detokenizers"],
        "steps": [d / "allowed/workers", d / "allowed/detokenizers"],
        "events": [d / "allowed/clients", d / "allowed/workers", d / "allowed/detokenizers"]}
    for role, folder in (("client", "clients"), ("worker", "workers"), ("detokenizer", "detokenizers")):
        keys = curve_client_keys(d, role=role)  # the default name is the role's
        assert (keys.name, keys.role, keys.secret_key_file) == (role, role, d / f"{folder}/{role}.key_secret")
        assert keys.server_public_key_file == d / "server.key"
    assert curve_client_keys(d).role == "client"
    with pytest.raises(ValueError, match="unknown CURVE role"):
        curve_client_keys(d, role="admin")

    with pytest.raises(CurveKeyError, match=r"clients/w9\.key_secret.*zeroserve keys .* --client w9"):
        curve_client_keys(d, "w9")
    with pytest.raises(CurveKeyError, match=r"detokenizers/d2\.key_secret.*zeroserve keys .* --detokenizer d2"):
        curve_client_keys(d, "d2", role="detokenizer")
    with pytest.raises(CurveKeyError, match="bad CURVE key name"):
        curve_client_keys(d, "a/b")

    # a client host holds server.key and its own secret only: enough for a client, not for a server
    host = tmp_path / "client-host"
    (host / "clients").mkdir(parents=True)
    shutil.copy(d / "server.key", host / "server.key")
    shutil.copy(d / "clients/client.key_secret", host / "clients/client.key_secret")
    assert curve_client_keys(host).secret_key_file == host / "clients/client.key_secret"
    with pytest.raises(CurveKeyError, match=r"workers/worker\.key_secret"):
        curve_client_keys(host, role="worker")  # ... and not for a worker
    with pytest.raises(CurveKeyError, match=r"server\.key_secret.*scheduler's secret key.*zeroserve keys"):
        curve_server_keys(host)
    (host / "server.key").unlink()
    with pytest.raises(CurveKeyError, match=r"server\.key \(the scheduler's public key\).*copy server\.key"):
        curve_client_keys(host)
    # a public key where a secret one belongs; garbage
    shutil.copy(d / "clients/client.key", host / "clients/client.key_secret")
    with pytest.raises(CurveKeyError, match="holds no secret key"):
        curve_client_keys(host)
    (host / "clients/client.key_secret").write_text("not a key\n")
    with pytest.raises(CurveKeyError, match="broken CURVE key file"):
        curve_client_keys(host)
    # an empty allow-list of any role: nobody of that role could get in
    for role, folder, flag in (("worker", "workers", "--worker worker"), ("client", "clients", "--client client")):
        (d / f"allowed/{folder}/{role}.key").unlink()
        with pytest.raises(CurveKeyError, match=rf"no allowed {role} keys in {d / 'allowed' / folder}.*{flag}"):
            curve_server_keys(d)
        shutil.copy(d / f"{folder}/{role}.key", d / f"allowed/{folder}/{role}.key")
    (d / "allowed/detokenizers/detokenizer.key").write_text("junk\n")
    with pytest.raises(CurveKeyError, match=r"broken CURVE key file .*allowed/detokenizers/detokenizer\.key"):
        curve_server_keys(d)


def test_cli_reports_a_missing_key_file(tmp_path, capsys):
    from zeroserve.services.cli import main

    d = tmp_path / "keys"
    create_curve_keys(d)
    rc = main(["status", "--address", "tcp://127.0.0.1:1", "--curve-keys", str(d), "--curve-client", "ops"])
    assert rc == 1
    assert "clients/ops.key_secret" in capsys.readouterr().err


def test_up_passes_the_key_directory_to_every_child(tmp_path):
    from zeroserve.services.cli import build_parser
    from zeroserve.services.launcher import plan_children

    args = build_parser().parse_args(["up", "--workers", "2", "--tp", "2", "--curve-keys", str(tmp_path / "k")])
    children = plan_children(args, "/m")
    assert len(children) == 6
    for c in children:
        assert c.argv[c.argv.index("--curve-keys") + 1] == str((tmp_path / "k").resolve()), c.name
        assert build_parser().parse_args(c.argv[3:]).curve_keys == str((tmp_path / "k").resolve())
    plain = plan_children(build_parser().parse_args(["up"]), "/m")
    assert not any("--curve-keys" in c.argv for c in plain)
    # no child is told a key name: each loads its role's default (worker, detokenizer, client)
    assert not any("--curve-client" in c.argv for c in children)


def test_up_checks_every_roles_default_key(tmp_path):
    d = tmp_path / "keys"
    create_curve_keys(d)
    (d / "detokenizers/detokenizer.key_secret").unlink()
    r = subprocess.run([sys.executable, "-m", "zeroserve.services.cli", "up", "--curve-keys", str(d), "--port", "1",
                        "--model", str(cached_model_dir("llama"))], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, check=False)
    assert r.returncode == 2, r
    assert "detokenizers/detokenizer.key_secret" in r.stderr and f"zeroserve keys {d}" in r.stderr, r.stderr


def test_worker_and_detokenizer_check_keys_at_start(tmp_path):
    from zeroserve.common.config import EngineArgs
    from zeroserve.services.detokenizer.service import DetokenizerService
    from zeroserve.services.worker.service import WorkerService

    model = str(cached_model_dir("llama"))
    with pytest.raises(CurveKeyError, match="does not exist"):
        WorkerService(EngineArgs(model=model), "tcp://127.0.0.1:1", curve_keys=str(tmp_path / "none"))
    create_curve_keys(tmp_path / "k", ["det"])  # a client key named "det" is not a detokenizer key
    with pytest.raises(CurveKeyError, match=r"detokenizers/det\.key_secret.*--detokenizer det.*is a client key"):
        DetokenizerService("tcp://127.0.0.1:1", [model], curve_keys=str(tmp_path / "k"), curve_client="det")
    with pytest.raises(CurveKeyError, match=r"workers/w1\.key_secret.*--worker w1"):
        WorkerService(EngineArgs(model=model), "tcp://127.0.0.1:1", curve_keys=str(tmp_path / "k"), curve_client="w1")


# ------------------------------------------------------------------------------ scheduler sockets


def _scheduler(host: str, curve_keys=None):
    from zeroserve.services.scheduler.service import SchedulerConfig, SchedulerService

    ctx = zmq.Context()
    cfg = SchedulerConfig(host=host, port=free_port_block(4, host="127.0.0.1"), models=[], curve_keys=curve_keys)
    return SchedulerService(cfg, ctx=ctx), ctx


def test_scheduler_sockets_are_curve_servers_and_the_authenticator_stops(tmp_path):
    create_curve_keys(tmp_path / "k")
    svc, ctx = _scheduler("127.0.0.1", str(tmp_path / "k"))
    try:
        socks = (svc.client_sock, svc.backend, svc.steps_pub, svc.events_pub)
        assert all(s.getsockopt(zmq.MECHANISM) == zmq.CURVE and s.getsockopt(zmq.CURVE_SERVER) for s in socks)
        # each socket's ZAP domain picks its allow-lists (SOCKET_ROLES)
        assert [s.getsockopt_string(zmq.ZAP_DOMAIN) for s in socks] == ["client", "backend", "steps", "events"]
        auth = svc.auth
        assert auth is not None and auth.is_alive()
    finally:
        svc.close()
        ctx.term()
    assert svc.auth is None and not auth.is_alive()
    plain, ctx = _scheduler("127.0.0.1")
    try:
        assert plain.auth is None and plain.client_sock.getsockopt(zmq.MECHANISM) == zmq.NULL
        assert plain.client_sock.getsockopt_string(zmq.ZAP_DOMAIN) == ""
    finally:
        plain.close()
        ctx.term()


def test_without_curve_the_scheduler_warns_once(tmp_path):
    from structlog.testing import capture_logs

    create_curve_keys(tmp_path / "k")
    # non-loopback: the stronger warning; loopback: local users are no boundary either; CURVE: none
    for host, keys, warned in (("0.0.0.0", None, "without CURVE"), ("127.0.0.1", None, "CURVE is off"),
                               ("0.0.0.0", str(tmp_path / "k"), None)):
        with capture_logs() as logs:
            svc, ctx = _scheduler(host, keys)
            svc.close()
            ctx.term()
        warnings = [e for e in logs if e["log_level"] == "warning" and "CURVE" in e["event"]]
        assert len(warnings) == (1 if warned else 0), (host, keys, logs)
        if warned:
            event = warnings[0]["event"]
            assert warned in event and "zeroserve keys" in event and "--curve-keys" in event, event
            assert "steps port" in event and "worker" in event, event


def _handshake(ctx, addr: str, keys, sock_type) -> bool | None:
    """Connect with ``keys``: True when the CURVE handshake (ZAP included) succeeds, False when
    it is refused, None when nothing happened within 3 s."""
    import zmq.utils.monitor as zmon

    from zeroserve.common.transport import make_socket

    sock = make_socket(ctx, sock_type, **keys.socket_kwargs(), **({"subscribe": b""} if sock_type == zmq.SUB else {}))
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    try:
        sock.connect(addr)
        if not mon.poll(3000):
            return None
        return zmon.recv_monitor_message(mon)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sock.disable_monitor()
        mon.close(linger=0)
        sock.close(linger=0)


def test_each_scheduler_socket_admits_only_its_roles(tmp_path):
    d = tmp_path / "k"
    create_curve_keys(d)
    svc, ctx = _scheduler("127.0.0.1", str(d))
    try:
        role_keys = {r: curve_client_keys(d, role=r) for r in ("client", "worker", "detokenizer")}
        got = {name: {r: _handshake(ctx, svc.addrs[name], k, st) for r, k in role_keys.items()}
               for name, st in (("client", zmq.DEALER), ("backend", zmq.DEALER), ("steps", zmq.SUB),
                                ("events", zmq.SUB))}
    finally:
        svc.close()
        ctx.term()
    assert got == {"client": {"client": True, "worker": False, "detokenizer": False},
                   "backend": {"client": False, "worker": True, "detokenizer": True},
                   "steps": {"client": False, "worker": True, "detokenizer": True},
                   "events": {"client": True, "worker": True, "detokenizer": True}}


# ------------------------------------------------------------------------------ a real cluster


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_model_dir("llama")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    """The default key per role, allowed; "stranger" has a client and a worker key pair in the
    folder, both revoked."""
    d = tmp_path_factory.mktemp("curve") / "keys"
    create_curve_keys(d, ["client", "stranger"], workers=["worker", "stranger"], detokenizers=["detokenizer"])
    (d / "allowed/clients/stranger.key").unlink()
    (d / "allowed/workers/stranger.key").unlink()
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
        posing = tmp_path / "posing"  # an allowed worker's key offered on the client port
        (posing / "clients").mkdir(parents=True)
        shutil.copy(keys / "server.key", posing / "server.key")
        shutil.copy(keys / "workers/worker.key_secret", posing / "clients/client.key_secret")
        _refused(lambda: Client(cluster.address, timeout_s=1.0, curve_keys=posing), lambda c: c.stats())

        out = good.generate(PROMPT, params).outputs[0]
        assert out.token_ids == ref.token_ids

    # the CLI: `zeroserve status --curve-keys` is served, without keys it is not
    from zeroserve.services.cli import main

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
