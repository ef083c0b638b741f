"""`zeroserve up` as a user runs it: `python -m zeroserve.services.cli up ...` in a subprocess.

The launchers of the selected tests start together at the beginning of the module (their
start-ups overlap, which saves a minute or two on a busy 2-core box):

* A: `up --model <tiny llama>`: the ready line, `generate`, `status` (text and --json), then
  SIGINT: `up` exits 0 and none of its children survives;
* B: `up` without --model and a private ZEROSERVE_CACHE: the built-in default model is created
  there and served; then SIGKILL of `up`: its children die with it (PR_SET_PDEATHSIG);
* C: `up --demo PROMPT`: prints an answer and exits 0 by itself, children stopped;
* D: `up --dtype bogus`: the worker dies at start-up, so the cluster never gets ready; `up`
  says so and stops (SIGINT meanwhile stops it too).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import free_port_block, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

READY_TIMEOUT_S = 360.0  # three launchers start at once on a shared 2-core box
CLI = [sys.executable, "-m", "zeroserve.services.cli"]


def _die_with_parent() -> None:
    from zeroserve.services.launcher import _die_with_parent as die

    die()


class Up:
    """One `zeroserve up` subprocess; its stdout is read line by line in a thread."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None, tmp: Path | None = None):
        self.name = name
        self.port = args[args.index("--port") + 1]
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.stderr_path = (tmp or Path("/tmp")) / f"up-{name}-{os.getpid()}.stderr"
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(CLI + ["up", *args], stdout=subprocess.PIPE, stderr=self._stderr, cwd=ROOT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
                                     preexec_fn=_die_with_parent)  # noqa: PLW1509 (prctl + setpgrp only)
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, name=f"up-{name}-stdout", daemon=True)
        self._reader.start()
        self.child_pids: set[int] = set()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            with self._cv:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cv.notify_all()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def output(self) -> str:
        with self._cv:
            out = "\n".join(self.lines)
        err = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        return f"--- stdout of up {self.name}:\n{out}\n--- stderr (tail):\n{err[-3000:]}"

    def wait_line(self, pattern: str, timeout: float = READY_TIMEOUT_S) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines:
                    m = rx.search(line)
                    if m:
                        return m
                if self._eof and self.proc.poll() is not None:
                    raise AssertionError(f"up {self.name} exited ({self.proc.returncode}) before printing "
                                         f"{pattern!r}\n{self.output()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"up {self.name}: no line matching {pattern!r} in {timeout:.0f}s\n"
                                         f"{self.output()}")
                self._cv.wait(min(left, 1.0))

    def children(self) -> set[int]:
        """Pids of every descendant now (remembered for the orphan checks)."""
        try:
            kids = {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            kids = set()
        self.child_pids |= kids
        return kids

    def stop(self) -> None:
        """Teardown: SIGINT, then SIGKILL; and whatever child is left."""
        self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid in alive(self.child_pids):
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        self._stderr.close()


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_all_dead(pids, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = alive(pids)
    return left


def cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, cwd=ROOT, timeout=timeout, check=False,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port_block(4)
        if all(abs(p - q) >= 4 for q in ports):
            ports.append(p)
    return ports


def _common(port: int, kv: int = 128) -> list[str]:
    return ["--port", str(port), "--workers", "1", "--num-kv-blocks", str(kv), "--threads", "1",
            "--gateway-port", str(free_port_block(1))]


_USES = {  # test -> the launcher it uses (only the launchers of selected tests are started)
    "test_up_with_a_model_serves_and_sigint_stops_every_child": "A",
    "test_up_without_a_model_creates_the_default_one_and_sigkill_leaves_no_orphans": "B",
    "test_up_demo_prints_an_answer_and_exits_by_itself": "C",
    "test_up_stops_on_sigint_while_a_failed_worker_keeps_it_from_ready": "D",
}


@pytest.fixture(scope="module")
def ups(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up")
    model = str(cached_model_dir("llama"))
    cache = tmp / "zeroserve-cache"
    wanted = {_USES[i.originalname] for i in request.session.items if i.originalname in _USES}
    pa, pb, pc, pd = _ports(4)
    started: dict[str, Up] = {}
    try:
        if "A" in wanted:
            started["A"] = Up("A", ["--model", model, *_common(pa)], tmp=tmp)
        if "B" in wanted:
            started["B"] = Up("B", _common(pb), env={"ZEROSERVE_CACHE": str(cache)}, tmp=tmp)
            started["B"].cache = cache
        if "C" in wanted:
            started["C"] = Up("C", ["--model", model, *_common(pc, kv=64), "--demo", "Hello cluster"], tmp=tmp)
        if "D" in wanted:  # the worker exits at once (bad --dtype): the cluster never gets ready
            started["D"] = Up("D", ["--model", model, *_common(pd, kv=64), "--dtype", "bogus"], tmp=tmp)
        yield started
    finally:
        for u in started.values():
            u.stop()


def _check_status_json(u: Up, kv_blocks: int, pids: dict[str, int]) -> dict:
    r = cli("status", "--address", u.address, "--json")
    assert r.returncode == 0, f"status --json failed: {r.stderr}\n{u.output()}"
    s = json.loads(r.stdout)
    p = int(u.port)
    assert s["addresses"] == {"client": f"tcp://127.0.0.1:{p}", "backend": f"tcp://127.0.0.1:{p + 1}",
                              "steps": f"tcp://127.0.0.1:{p + 2}", "events": f"tcp://127.0.0.1:{p + 3}"}
    assert isinstance(s["scheduler_id"], str) and s["scheduler_id"] and s["uptime_s"] > 0
    assert s["detokenizer"]["connected"] is True
    assert s["queue"] == 0 and s["requests"] == 0
    assert isinstance(s["tokens_per_s"], (int, float)) and s["tokens_per_s"] >= 0
    assert s["tokens_total"] >= 1, "the generate request's tokens are not counted"
    assert len(s["groups"]) == 1
    g = s["groups"][0]
    assert g["name"] == "g0" and g["state"] == "ready" and g["tp_size"] == 1
    assert g["kv_blocks_total"] == kv_blocks and g["kv_blocks_used"] == 0 and g["steps"] >= 1
    assert len(g["workers"]) == 1
    w = g["workers"][0]
    assert w["worker_id"] == "g0-r0" and w["rank"] == 0 and w["device"] == "cpu"
    assert w["kv_blocks"] == kv_blocks
    assert w["pid"] == pids["worker"], f"status says worker pid {w['pid']}, up printed {pids['worker']}"
    return s


def _printed_pids(u: Up) -> dict[str, int]:
    """The pids `up` printed for its children (remembered for the orphan checks)."""
    pids = {"scheduler": int(u.wait_line(r"^scheduler\s+pid (\d+)").group(1)),
            "detokenizer": int(u.wait_line(r"^detokenizer\s+pid (\d+)").group(1)),
            "worker": int(u.wait_line(r"^worker g0\s+pid (\d+)").group(1))}
    u.child_pids |= set(pids.values())
    return pids


def _generate(u: Up) -> subprocess.CompletedProcess:
    r = cli("generate", "hello", "--address", u.address, "--max-tokens", "12")
    assert r.returncode == 0, f"generate failed ({r.returncode}): {r.stderr}\n{u.output()}"
    assert r.stdout.strip(), f"generate printed no text: {r.stdout!r} / {r.stderr!r}"
    assert re.search(r"\[(\d+) tokens, finish_reason=(length|stop)\]", r.stderr), r.stderr
    return r


@pytest.mark.timeout(600)
def test_up_with_a_model_serves_and_sigint_stops_every_child(ups):
    u = ups["A"]
    ready = u.wait_line(r"^ready: 1 worker group\(s\) x 1 shard\(s\) serving (\S+) at (\S+)")
    assert ready.group(2) == u.address
    pids = _printed_pids(u)
    kids = u.children()
    assert set(pids.values()) <= kids, f"printed pids {pids} are not children of up ({kids})"

    _generate(u)
    # the HTTP gateway is up too (its line in the start-up list), speaking the OpenAI API
    import httpx

    gw = u.wait_line(r"^gateway\s+pid (\d+)\s+(http://\S+)/v1")
    u.child_pids.add(int(gw.group(1)))
    assert httpx.get(gw.group(2) + "/health", timeout=30).status_code == 200
    r = httpx.post(gw.group(2) + "/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    s = _check_status_json(u, 128, pids)
    assert s["models"] == [Path(cached_model_dir("llama")).name]
    text = cli("status", "--address", u.address)
    assert text.returncode == 0, text.stderr
    assert "detokenizer: connected" in text.stdout and "group g0 [ready]" in text.stdout
    assert re.search(rf"worker g0-r0 rank 0 pid {pids['worker']} .*device cpu", text.stdout), text.stdout

    u.children()
    u.proc.send_signal(signal.SIGINT)
    try:
        rc = u.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"up did not stop within 60s of SIGINT\n{u.output()}") from None
    assert rc == 0, u.output()
    u.wait_line(r"^stopped\.$", timeout=10)
    left = wait_all_dead(u.child_pids, timeout=5)
    assert not left, f"children of up survived SIGINT: {left}"
    # and nobody answers at the address any more
    from zeroserve import Client, ClusterUnavailable

    with Client(u.address, timeout_s=1.0) as c, pytest.raises(ClusterUnavailable):
        c.health()


@pytest.mark.timeout(600)
def test_up_without_a_model_creates_the_default_one_and_sigkill_leaves_no_orphans(ups):
    u = ups["B"]
    u.wait_line(r"built-in tiny model")
    u.wait_line(r"^ready: 1 worker group\(s\) x 1 shard\(s\) serving default-model at ")
    cfg = u.cache / "default-model" / "config.json"
    assert cfg.is_file(), f"the default model was not created under ZEROSERVE_CACHE ({u.cache})"
    assert json.loads(cfg.read_text())["vocab_size"] > 512  # the "default" size, not the test one
    pids = _printed_pids(u)
    _generate(u)
    s = _check_status_json(u, 128, pids)
    assert s["models"] == ["default-model"]

    kids = u.children()
    assert set(pids.values()) <= kids
    u.proc.kill()
    u.proc.wait(timeout=10)
    left = wait_all_dead(kids, timeout=20)
    assert not left, f"SIGKILL of up left orphans: {left}"


@pytest.mark.timeout(600)
def test_up_demo_prints_an_answer_and_exits_by_itself(ups):
    u = ups["C"]
    _printed_pids(u)
    u.children()
    try:
        rc = u.proc.wait(timeout=READY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"up --demo did not exit\n{u.output()}") from None
    assert rc == 0, u.output()
    u.wait_line(r"^prompt: 'Hello cluster'$", timeout=10)
    u.wait_line(r"^answer: '", timeout=10)
    u.wait_line(r"^\[\d+ tokens, finish_reason=(length|stop)[;\]]", timeout=10)
    u.wait_line(r"^stopped\.$", timeout=10)
    left = wait_all_dead(u.child_pids, timeout=5)
    assert not left, f"children of up --demo survived: {left}"


@pytest.mark.timeout(600)
def test_up_stops_on_sigint_while_a_failed_worker_keeps_it_from_ready(ups):
    u = ups["D"]
    pids = _printed_pids(u)
    u.children()
    assert not wait_all_dead([pids["worker"]], timeout=READY_TIMEOUT_S), "the worker with --dtype bogus still runs"
    u.proc.send_signal(signal.SIGINT)
    try:
        u.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        u.proc.kill()  # do not make the teardown wait for it
        u.proc.wait(timeout=10)
        raise AssertionError(f"up did not stop within 20s of SIGINT during start-up\n{u.output()}") from None
    left = wait_all_dead(u.child_pids, timeout=10)
    assert not left, f"children of up survived: {left}"


def test_up_with_a_model_it_cannot_serve_prints_one_line(tmp_path):
    """A bad model stops `up` before any child starts: one message, no traceback per process."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"junk" * 10)
    r = subprocess.run(CLI + ["up", "--model", str(bad), "--port", "1"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr + r.stdout
    assert r.stderr.strip() == "zeroserve up: bad.gguf is not a GGUF file (bad magic b'junk')", r.stderr


def test_a_child_that_dies_while_the_gateway_starts_is_restarted():
    """`up` supervises from the moment the cluster is ready, not from the gateway's ready line:
    a scheduler killed while the gateway still starts comes back (once CI's slow gateway start
    left it dead, and every client waited out its timeout)."""
    from zeroserve.services.launcher import Child, _wait_port, supervise

    dies = Child("scheduler", [sys.executable, "-c", "pass"], role="scheduler")
    gateway = Child("gateway", [sys.executable, "-c", "import time; time.sleep(30)"], role="gateway")
    dies.start()
    gateway.start()
    try:
        first = dies.proc.pid
        dies.proc.wait(timeout=30)
        with pytest.raises(TimeoutError):
            _wait_port("127.0.0.1", free_port_block(1), gateway, timeout_s=3.0,
                       tick=lambda: supervise([dies], time.monotonic()))
        assert dies.proc.pid != first and dies.restarts >= 1
        stop = iter([False, True])
        t0 = time.monotonic()
        _wait_port("127.0.0.1", free_port_block(1), gateway, timeout_s=30.0, tick=lambda: next(stop))
        assert time.monotonic() - t0 < 5.0  # a true tick (told to stop) ends the wait
    finally:
        for c in (dies, gateway):
            if c.alive():
                c.proc.kill()
            c.proc.wait(timeout=10)
