"""A real local cluster for integration tests: scheduler, detokenizer and workers as separate
processes on loopback ports, each with its own log file, always cleaned up (PR_SET_PDEATHSIG
covers a test process that is killed outright).

    with LocalCluster(model_dir, workers=2) as c:
        c.wait_ready(groups=2)
        with c.client() as client:
            client.generate("hello", SamplingParams(max_tokens=8))
        c.kill("g0-r0")                 # SIGKILL one shard (names: scheduler, detokenizer, g<i>-r<rank>)

Start processes (`start`, `start_group`, `start_worker`) from the main thread: PR_SET_PDEATHSIG
fires when the *thread* that forked the child ends, so a child started from a short-lived
helper thread is killed when that thread returns.

Leftover check: every process started under a test session inherits `ZEROSERVE_TEST_SESSION`
(set here at import), orphans included, so `leftover_processes()` finds whatever a test left
running, and the module fixture `no_leftover_processes` fails the module that leaked one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from zeroserve.common.transport import free_port_block
from zeroserve.services.launcher import Child, stop_children

REPO = Path(__file__).resolve().parents[1]

# Every child of this test session (and their children, orphans too) inherits this variable.
SESSION_ENV = "ZEROSERVE_TEST_SESSION"
SESSION_TAG = os.environ.setdefault(SESSION_ENV, f"{os.getpid()}-{random.getrandbits(48):012x}")


def tagged_processes(exclude: set[int] | frozenset[int] = frozenset()) -> list:
    """Live (non-zombie) processes that carry this session's tag, other than this process."""
    import psutil

    out = []
    me = os.getpid()
    for p in psutil.process_iter(["pid"]):
        if p.pid == me or p.pid in exclude:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(SESSION_ENV) == SESSION_TAG:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return out


def leftover_processes(before: set[int] | frozenset[int] = frozenset(), grace_s: float = 10.0) -> list[str]:
    """Tagged processes not in `before` still alive after up to `grace_s` (PDEATHSIG and
    SIGTERM handling take a moment); each as "pid cmdline"."""
    import psutil

    deadline = time.monotonic() + grace_s
    while True:
        procs = tagged_processes(set(before))
        if not procs or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            out.append(f"{p.pid} {' '.join(p.cmdline())[:200]}")
    return out


@pytest.fixture(scope="module")
def no_leftover_processes():
    """Fails the module (at teardown) if a process it started outlives it; import it into a
    test module and use it with `pytestmark = pytest.mark.usefixtures("no_leftover_processes")`."""
    before = {p.pid for p in tagged_processes()}
    yield
    left = leftover_processes(before)
    if left:
        import psutil

        for line in left:  # do not leak them into the rest of the session either
            with contextlib.suppress(psutil.Error):
                psutil.Process(int(line.split()[0])).kill()
        pytest.fail("processes left running after the module: " + "; ".join(left), pytrace=False)


class LocalCluster:
    def __init__(self, model_dir: str | Path, workers: int = 1, tp: int = 1, num_kv_blocks: int = 256,
                 scheduler_args: list[str] | None = None, worker_args: list[str] | None = None,
                 detokenizer: bool = True, threads: int = 1, curve_keys: str | Path | None = None,
                 pp: int = 1, standby: bool = False) -> None:
        self.model = str(model_dir)
        self.port = free_port_block(4)
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.backend = f"tcp://127.0.0.1:{self.port + 1}"
        # a hot standby: a second scheduler, "scheduler-b", each --standby-of the other; every peer
        # and client() gets both addresses (services/scheduler/standby.py)
        self.standby_port = free_port_block(4) if standby else None
        if standby:
            self.address += f",tcp://127.0.0.1:{self.standby_port}"
            self.backend += f",tcp://127.0.0.1:{self.standby_port + 1}"
        self.n_workers, self.tp, self.pp = workers, tp, pp
        self.num_kv_blocks = num_kv_blocks
        self.scheduler_args = scheduler_args or []
        self.worker_args = worker_args or []
        self.with_detok = detokenizer
        self.threads = threads
        self.curve_keys = str(curve_keys) if curve_keys else None  # CURVE: every child and client() use it
        self.curve_args = ["--curve-keys", self.curve_keys] if self.curve_keys else []
        self.logdir = Path(tempfile.mkdtemp(prefix="zeroserve-cluster-"))
        self.children: dict[str, Child] = {}
        self._logs = []

    # ---- processes ------------------------------------------------------------------------
    def _cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "zeroserve.services.cli", *args]

    def _start(self, name: str, argv: list[str], role: str = "worker") -> Child:
        log = open(self.logdir / f"{name}.log", "ab")
        self._logs.append(log)
        child = Child(name, argv, role=role, env={"PYTHONPATH": str(REPO), "ZEROSERVE_LOG_LEVEL": "info",
                                                  "PYTHONUNBUFFERED": "1", SESSION_ENV: SESSION_TAG})
        env = dict(os.environ, **child.env)
        from zeroserve.services.launcher import _die_with_parent

        child.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                      preexec_fn=_die_with_parent)
        child.started = time.monotonic()
        self.children[name] = child
        return child

    def start_scheduler(self, name: str = "scheduler") -> Child:
        """The scheduler; with a standby, `name` "scheduler" or "scheduler-b" (each --standby-of the other)."""
        port, peer = (self.port, self.standby_port) if name == "scheduler" else (self.standby_port, self.port)
        standby = ["--standby-of", f"tcp://127.0.0.1:{peer}"] if self.standby_port else []
        return self._start(name, self._cmd(
            "scheduler", "--port", str(port), "--model", self.model, "--heartbeat-timeout", "3", *standby,
            *self.curve_args, *self.scheduler_args), role="scheduler")

    def role(self, name: str, timeout: float = 60.0) -> dict:
        """With a standby: scheduler `name`'s stats (its "role": active or standby, its "term")."""
        from zeroserve import Client

        port = self.port if name == "scheduler" else self.standby_port
        deadline = time.monotonic() + timeout
        while True:
            try:
                with Client(f"tcp://127.0.0.1:{port}", timeout_s=2.0,
                            **({"curve_keys": self.curve_keys} if self.curve_keys else {})) as c:
                    return c.stats()
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def wait_role(self, name: str, role: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while (s := self.role(name, timeout))["role"] != role:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} is not {role}: {s.get('role')}\n{self.logs()}")
            time.sleep(0.1)
        return s

    def start_detokenizer(self, name: str = "detokenizer") -> Child:
        return self._start(name, self._cmd("detokenizer", "--scheduler", self.backend, "--model", self.model,
                                           *self.curve_args), role="detokenizer")

    def start_worker(self, group: str, rank: int = 0, tp: int | None = None, extra: list[str] | None = None,
                     stage: int = 0, pp: int | None = None) -> Child:
        """Shard `rank` of pipeline stage `stage`, named `{group}-r{rank}` (`{group}-s{stage}-r{rank}`
        in a group of several stages, as `zeroserve up` names them)."""
        tp, pp = tp or self.tp, pp or self.pp
        wid = f"{group}-s{stage}-r{rank}" if pp > 1 else f"{group}-r{rank}"
        return self._start(wid, self._cmd(
            "worker", "--scheduler", self.backend, "--model", self.model, "--group", group, "--tp-size", str(tp),
            "--tp-rank", str(rank), "--pp-size", str(pp), "--pp-rank", str(stage), "--worker-id", wid,
            "--num-kv-blocks", str(self.num_kv_blocks),
            "--threads", str(self.threads), *self.curve_args, *self.worker_args, *(extra or [])))

    def start_group(self, group: str) -> None:
        for s in range(self.pp):
            for r in range(self.tp):
                self.start_worker(group, r, stage=s)

    def start(self) -> "LocalCluster":
        self.start_scheduler()
        if self.standby_port:  # "scheduler" first: it finds no active peer and takes over; then its standby
            self.wait_role("scheduler", "active")
            self.start_scheduler("scheduler-b")
        if self.with_detok:
            self.start_detokenizer()
        for g in range(self.n_workers):
            self.start_group(f"g{g}")
        return self

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.children[name].proc.send_signal(sig)

    def wait_exit(self, name: str, timeout: float = 30.0) -> int:
        return self.children[name].proc.wait(timeout=timeout)

    def pids(self) -> dict[str, int]:
        """name -> pid of every process this cluster started (alive or not)."""
        return {n: c.proc.pid for n, c in self.children.items() if c.proc is not None}

    def stop(self) -> None:
        """Workers first (SIGTERM: they drain and leave), then the detokenizer and the scheduler;
        SIGKILL whatever does not exit in time. Idempotent."""
        stop_children(list(self.children.values()))
        for f in self._logs:
            f.close()
        self._logs = []
        if not os.environ.get("ZEROSERVE_KEEP_LOGS"):  # set it to look at the logs afterwards
            shutil.rmtree(self.logdir, ignore_errors=True)

    def logs(self) -> str:
        out = []
        for p in sorted(self.logdir.glob("*.log")):
            out.append(f"===== {p.name}\n{p.read_text(errors='replace')[-4000:]}")
        return "\n".join(out)

    @contextlib.contextmanager
    def running(self, groups: int | None = None, timeout: float = 180.0):
        """Start, wait until `groups` groups are ready, yield, always stop (module fixtures)."""
        try:
            self.start()
            self.wait_ready(groups, timeout=timeout)
            yield self
        finally:
            self.stop()

    def __enter__(self) -> "LocalCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- client side ----------------------------------------------------------------------
    def client(self, **kw):
        from zeroserve import Client

        if self.curve_keys:
            kw.setdefault("curve_keys", self.curve_keys)
        return Client(self.address, **kw)

    def stats(self) -> dict:
        with self.client(timeout_s=5.0) as c:
            return c.stats()

    def wait_ready(self, groups: int | None = None, timeout: float = 120.0, detok: bool | None = None) -> dict:
        groups = self.n_workers if groups is None else groups
        detok = self.with_detok if detok is None else detok
        deadline = time.monotonic() + timeout
        last = None
        with self.client(timeout_s=3.0) as c:
            while time.monotonic() < deadline:
                try:
                    last = c.stats()
                    ready = sum(1 for g in last["groups"] if g["state"] == "ready")
                    if ready >= groups and (last["detokenizer"]["connected"] or not detok):
                        return last
                except Exception:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"cluster not ready in {timeout}s; last stats {last}\n{self.logs()}")


class PoolCluster(LocalCluster):
    """A LocalCluster whose scheduler and detokenizer serve a catalog and whose workers are pool members."""

    def __init__(self, catalog_args: list[str], workers: int = 2, **kw) -> None:
        super().__init__("(catalog)", workers=workers, **kw)
        self.catalog_args = catalog_args

    def start_scheduler(self):
        return self._start("scheduler", self._cmd(
            "scheduler", "--port", str(self.port), *self.catalog_args, "--heartbeat-timeout", "3",
            *self.scheduler_args), role="scheduler")

    def start_detokenizer(self, name: str = "detokenizer"):
        return self._start(name, self._cmd("detokenizer", "--scheduler", self.backend, *self.catalog_args),
                           role="detokenizer")

    def start_worker(self, group: str, rank: int = 0, tp=None, extra=None, stage: int = 0):
        # a pool member is one shard: `rank`, `tp` and `stage` keep LocalCluster's signature
        return self._start(group, self._cmd(
            "worker", "--scheduler", self.backend, "--pool", "--worker-id", group,
            "--num-kv-blocks", str(self.num_kv_blocks), "--threads", str(self.threads), *self.worker_args,
            *(extra or [])))

    def pool(self) -> dict:
        return self.stats()["pool"]

    def wait_members(self, n: int, timeout: float = 120.0) -> dict:
        return self.wait_for(lambda p: len(p["members"]) >= n, timeout, f"{n} pool members")

    def wait_for(self, cond, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                last = self.pool()
                if cond(last):
                    return last
            except Exception:  # noqa: BLE001 - the scheduler may still be starting
                pass
            time.sleep(0.1)
        raise TimeoutError(f"no {what} in {timeout}s; last pool {last}\n{self.logs()}")
