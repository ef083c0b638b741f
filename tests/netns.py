"""Hosts as Linux network namespaces, for multi-host tests (tests/test_multihost.py).

    with NetnsHosts(["sched", "tpa", "tpb"]) as hosts:      # skips the test where it cannot
        hosts.addr("sched")                                   # 10.N.0.2
        hosts.start("sched", "scheduler", [...])              # `python -m zeroserve.services.cli ...` there
        hosts.link_down("tpb"); hosts.link_up("tpb")          # a partition, healed

Every host is a namespace with `lo` and `eth0` (10.N.0.x/24), wired by a veth pair to one
bridge that lives in a namespace of its own, so the test machine's own network is never
touched. Each host's /etc/hosts (`ip netns exec` mounts /etc/netns/NS/hosts over it) maps the
machine's hostname to 127.0.1.1, as Debian does: whatever binds by hostname binds to loopback,
the trap multi-host tensor parallelism must not fall into. Processes run with
`ip netns exec` (which execs: the pid is the process), die with the test process
(PR_SET_PDEATHSIG), and are killed, with anything else left in a namespace, before the
namespaces and their /etc/netns files are deleted, on every exit path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from zeroserve.services.launcher import _die_with_parent
from tests.cluster import SESSION_ENV, SESSION_TAG

REPO = Path(__file__).resolve().parents[1]
ETC_NETNS = Path("/etc/netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def why_not() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2; .ci/run installs it)"
    probe = f"zsprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class NetnsHosts:
    def __init__(self, hosts: list[str], subnet: int | None = None) -> None:
        self.tag = f"zs{os.getpid() % 100000}"  # namespace names are global: unique per test process
        self.subnet = subnet if subnet is not None else 100 + os.getpid() % 100
        self.hosts = list(hosts)
        self.bridge = f"{self.tag}-br"
        self.logdir = Path(tempfile.mkdtemp(prefix="zeroserve-netns-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []
        self._made: list[str] = []
        self._etc_existed = ETC_NETNS.exists()  # remove /etc/netns afterwards only if we made it

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"10.{self.subnet}.0.{self.hosts.index(host) + 2}"

    # ---- the network ----------------------------------------------------------------------
    def create(self) -> "NetnsHosts":
        reason = why_not()
        if reason:
            pytest.skip(reason)
        self._add_ns(self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        hosts_file = f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n"
        for i, h in enumerate(self.hosts):
            ns = self.ns(h)
            self._add_ns(ns)
            (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / ns / "hosts").write_text(hosts_file)
            _ip("-n", self.bridge, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.bridge, "link", "set", f"h{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(h)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def link_down(self, host: str) -> None:
        """Cut `host` off (its bridge port down: packets are dropped, no reset is sent)."""
        _ip("-n", self.bridge, "link", "set", f"h{self.hosts.index(host)}", "down")

    def link_up(self, host: str) -> None:
        _ip("-n", self.bridge, "link", "set", f"h{self.hosts.index(host)}", "up")

    # ---- processes ------------------------------------------------------------------------
    def start(self, host: str, name: str, argv: list[str], stdin=None) -> subprocess.Popen:
        """`python <argv>` on `host`, logging to `name`.log; argv[0] is a module for -m."""
        log = open(self.logdir / f"{name}.log", "ab")
        self._logs.append(log)
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", ZEROSERVE_LOG_LEVEL="info",
                   **{SESSION_ENV: SESSION_TAG})
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the worker must find them itself
            env.pop(var, None)
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(host), sys.executable, "-m", *argv], cwd=REPO, env=env,
                             stdout=log, stderr=subprocess.STDOUT, stdin=stdin, preexec_fn=_die_with_parent)
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        p = self.logdir / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.logdir.glob("*.log")))

    def wait_log(self, name: str, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log(name)
            if needle in text:
                return text
            p = self.procs.get(name)
            if p is not None and p.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{name} never logged {needle!r}\n{self.logs()}")

    # ---- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process (ours, then anything else in our namespaces), delete the
        namespaces and their /etc/netns files. Idempotent; never raises."""
        deadline = time.monotonic() + 10
        for p in reversed(list(self.procs.values())):  # the last started first: workers leave before the scheduler
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, min(3.0, deadline - time.monotonic())))
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)
        for ns in self._made:
            r = _ip("netns", "pids", ns, check=False)
            for pid in r.stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        self._made = []
        if not self._etc_existed:
            with contextlib.suppress(OSError):  # not empty: another test's; leave it
                ETC_NETNS.rmdir()
        for f in self._logs:
            f.close()
        self._logs = []
        if not os.environ.get("ZEROSERVE_KEEP_LOGS"):
            shutil.rmtree(self.logdir, ignore_errors=True)

    def __enter__(self) -> "NetnsHosts":
        try:
            return self.create()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
