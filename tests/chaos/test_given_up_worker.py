"""A worker the scheduler gave up on (not a restarted scheduler) hears why, and rejoins.

A partition that outlasts the heartbeat timeout, stood in for here by SIGSTOP (no heartbeats,
no answers, the connection stays): the scheduler gives the group up and remembers the worker;
when the worker comes back its heartbeat is answered "rejoin" by the *same* scheduler instance,
with the reason. Before, the worker logged "the scheduler does not know us (restarted?)"
although nothing restarted. The worker must say it was given up, rejoin, and serve again.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.common.sampling_params import SamplingParams
from tests.cluster import LocalCluster, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _wait_log(c: LocalCluster, name: str, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = (c.logdir / f"{name}.log").read_text(errors="replace")
        if re.search(pattern, text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"{name} never logged {pattern!r}\n{c.logs()}")


def test_a_given_up_worker_is_told_so_and_rejoins_the_same_scheduler():
    with LocalCluster(cached_model_dir(), workers=1) as c:
        c.wait_ready(groups=1, timeout=120)
        sched_id = c.stats()["scheduler_id"]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        with c.client(timeout_s=30.0) as cl:
            before = cl.generate("hello there", params).outputs[0].token_ids
        c.kill("g0-r0", signal.SIGSTOP)  # silent, connection up: a partition as the scheduler sees it
        try:
            _wait_log(c, "scheduler", r"group gone.*no heartbeat", timeout=20)
        finally:
            c.kill("g0-r0", signal.SIGCONT)
        log = _wait_log(c, "g0-r0", r"joining again", timeout=20)
        assert "restarted" not in log, log
        assert re.search(r"(gave our group up \(it did not restart\)|ended our group).*no heartbeat", log), log
        stats = c.wait_ready(groups=1, timeout=30)
        assert stats["scheduler_id"] == sched_id  # the same instance all along
        with c.client(timeout_s=30.0) as cl:
            assert cl.generate("hello there", params).outputs[0].token_ids == before


def test_the_scheduler_answers_a_given_up_worker_with_why_and_remembers_a_bounded_number():
    from zeroserve.common import messages as P
    from zeroserve.services.scheduler import groups as G
    from zeroserve.services.scheduler.outbox import Outbox
    from tests.scheduler_sim import Net, make_cluster

    c = make_cluster()
    net = Net(c)
    (w,) = net.join("g0")
    net.silent.add("g0")
    net.run(lambda: c.groups.get("g0").state == G.GroupState.GONE)
    net.send(c.on_heartbeat(w.ident, P.Heartbeat(worker_id=w.worker_id), net.now))
    answer = net.backend[w.ident][-1]
    assert answer.status == "rejoin" and answer.scheduler_id == c.id
    assert "gave your group up (no heartbeat from g0-r0" in answer.detail
    net.send(c.on_heartbeat(b"stranger", P.Heartbeat(worker_id="stranger"), net.now))
    assert net.backend[b"stranger"][-1].detail == "unknown worker: say HELLO again"
    net.silent.clear()
    del net.workers["g0"]
    net.join("g0")  # rejoined: no longer on the list
    assert w.worker_id not in c.groups.given_up
    for i in range(G.MAX_GIVEN_UP + 10):
        c.groups.given_up[f"w{i}"] = "x"
    c.groups.gone(c.groups.get("g0"), "test", Outbox())
    assert len(c.groups.given_up) == G.MAX_GIVEN_UP and w.worker_id in c.groups.given_up
