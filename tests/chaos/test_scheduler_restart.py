"""SIGKILL the scheduler under `zeroserve up` while streams run.

`up` restarts it at once; the client notices the new scheduler by the next Pong (it names
another scheduler_id), so the in-flight streams fail with ClusterUnavailable("the scheduler
restarted ...") within about a ping interval of the new scheduler's start, not after the
client's 30 s timeout; the worker and the detokenizer rejoin and new requests are served.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.common.transport import free_port, free_port_block
from tests.cluster import SESSION_ENV, SESSION_TAG, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

CLIENT_TIMEOUT_S = 30.0  # far above what the restart may take: only the scheduler id can explain a fast error


def _scheduler_child(up: subprocess.Popen) -> psutil.Process | None:
    for p in psutil.Process(up.pid).children():
        try:
            if "scheduler" in p.cmdline():
                return p
        except psutil.Error:
            continue
    return None


def _wait_ready(address: str, up: subprocess.Popen, timeout: float, log_path: Path | None = None) -> None:
    """Until the cluster serves and (with ``log_path``) `up` printed its ready line: before it,
    `up` is still checking the start-up and treats a child that exits as a failed start."""
    from zeroserve import Client

    deadline = time.monotonic() + timeout
    while log_path is not None and b"\nready: " not in log_path.read_bytes():
        assert up.poll() is None, f"zeroserve up exited with {up.returncode}"
        assert time.monotonic() < deadline, "zeroserve up printed no ready line"
        time.sleep(0.2)
    with Client(address, timeout_s=2.0) as c:
        while time.monotonic() < deadline:
            assert up.poll() is None, f"zeroserve up exited with {up.returncode}"
            try:
                s = c.stats()
                if any(g["state"] == "ready" for g in s["groups"]) and s["detokenizer"]["connected"]:
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.2)
    raise TimeoutError("the cluster was not ready")


@pytest.mark.timeout(240)
def test_scheduler_sigkill_under_up_fails_streams_fast_and_serves_after(tmp_path):
    from zeroserve import AsyncClient, Client, ClusterUnavailable

    port = free_port_block(4)
    address = f"tcp://127.0.0.1:{port}"
    log = open(tmp_path / "up.log", "wb")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **{SESSION_ENV: SESSION_TAG})
    up = subprocess.Popen([sys.executable, "-m", "zeroserve.services.cli", "up", "--model", str(cached_model_dir("llama")),
                           "--port", str(port), "--gateway-port", str(free_port()), "--workers", "1", "--threads", "1",
                           "--num-kv-blocks", "256"],
                          env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(address, up, 180, tmp_path / "up.log")
        old = _scheduler_child(up)
        assert old is not None
        result: dict = {}

        async def streams():
            async with AsyncClient(address, timeout_s=CLIENT_TIMEOUT_S) as c:
                # kill once every stream has tokens: the first step may hold only the request that
                # reached the scheduler first (continuous batching starts it at once)
                got = [asyncio.Event() for _ in range(4)]

                async def one(i):
                    n = 0
                    try:
                        async for d in c.stream([3 + i, 5, 7], {"max_tokens": 1500, "ignore_eos": True,
                                                                "temperature": 0.0}):
                            n += len(d.token_ids)
                            got[i].set()
                        return ("finished", n, time.monotonic())
                    except ClusterUnavailable as e:
                        return (str(e), n, time.monotonic())

                tasks = [asyncio.ensure_future(one(i)) for i in range(4)]
                await asyncio.wait_for(asyncio.gather(*(g.wait() for g in got)), 60)
                result["kill_at"] = time.monotonic()
                old.send_signal(signal.SIGKILL)
                result["outs"] = await asyncio.wait_for(asyncio.gather(*tasks), 60)

        asyncio.run(streams())
        outs, kill_at = result["outs"], result["kill_at"]
        assert all("the scheduler restarted" in o[0] for o in outs), outs
        assert all(o[1] > 0 for o in outs)  # they were streaming
        waited = max(o[2] for o in outs) - kill_at
        new = _scheduler_child(up)
        assert new is not None and new.pid != old.pid
        # the new scheduler's start (python, tokenizer) plus at most ~2 ping intervals
        assert waited < 15.0, f"in-flight requests learnt of the restart after {waited:.1f}s"
        print(f"\nin-flight streams failed {waited:.2f}s after the SIGKILL")

        _wait_ready(address, up, 60)  # the worker and the detokenizer rejoined by themselves
        with Client(address, timeout_s=10.0) as c:
            out = c.generate([3, 5, 7], {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
        assert len(out.outputs[0].token_ids) == 8
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(timeout=10)
        log.close()
