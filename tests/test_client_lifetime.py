"""A client nobody closed never hangs its process: an AsyncClient used inside one `asyncio.run`
and left open, then a second `asyncio.run` in the same process (a script, a notebook), then
garbage collection and interpreter exit. pyzmq's Context.__del__ used to term() the context with
the client's socket still open and block forever.

Each case runs as a real script in its own interpreter with a time limit; one of them leaves a
stream open in the middle of a request against a real cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import LocalCluster, no_leftover_processes  # noqa: E402,F401 (fixture)
from tests.helpers import cached_model_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

SCRIPT = """
import asyncio, gc, sys
from zeroserve import AsyncClient, ClusterUnavailable, SamplingParams

ADDRESS = sys.argv[1]

async def first():
    c = AsyncClient(ADDRESS, timeout_s=1.0)
    try:
        {body}
    except ClusterUnavailable as e:
        print("unavailable")
    # not closed, on purpose

asyncio.run(first())

async def second():
    gc.collect()  # the first client is collected inside a new event loop
    await asyncio.sleep(0.05)
    print("second run")

asyncio.run(second())
{tail}
print("exiting")
"""

STREAM_LEFT_OPEN = """
        stream = c.stream("hello there", SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
        async for delta in stream:
            print("got a delta")
            break  # leave the request running: no close, no abort by hand
"""


def _run_script(tmp_path: Path, address: str, body: str, tail: str = "") -> str:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(body=textwrap.dedent(body).strip().replace("\n", "\n        "), tail=tail))
    try:
        r = subprocess.run([sys.executable, str(script), address], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the script hung: {e.stdout!r} {e.stderr!r}") from None
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.parametrize("tail", ["", "gc.collect()"], ids=["exit", "collect-then-exit"])
def test_an_unclosed_client_of_an_absent_scheduler_never_blocks(tmp_path, tail):
    out = _run_script(tmp_path, "tcp://127.0.0.1:9", "await c.health()", tail)
    assert out.split() == ["unavailable", "second", "run", "exiting"]


@pytest.mark.timeout(300)
def test_an_unclosed_client_with_a_stream_open_never_blocks(tmp_path):
    with LocalCluster(cached_model_dir("llama"), workers=1, num_kv_blocks=64) as cluster:
        cluster.wait_ready(timeout=240)
        out = _run_script(tmp_path, cluster.address, STREAM_LEFT_OPEN, "gc.collect()")
        assert out.split() == ["got", "a", "delta", "second", "run", "exiting"]
        # the abandoned request does not stay behind in the scheduler (its client is gone)
        deadline = time.monotonic() + 30
        while cluster.stats()["requests"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cluster.stats()["requests"] == 0
