"""A hot standby scheduler (services/scheduler/standby.py) and the term that fences a deposed one.

* `zeroserve up --standby`: the active scheduler is SIGKILLed under 24 streams (greedy, seeded,
  seeded under a regex); the standby takes over when its lease lapses (the dropped connection cuts
  it short), the workers, the detokenizer and the client move to it, the client re-attaches, and
  every stream ends with the tokens and text of an undisturbed run. The pause (SIGKILL -> next
  token) is printed; benchmarks/scheduler_restart.py --standby records it in docs/benchmarks.md.
* A deposed scheduler: the active one is SIGSTOPped, the standby takes over (term 2) and the
  peers move to it. Then the standby is stopped and the old one continued: it still believes it is
  active at term 1, and the peers that come back to it say term 2 (HELLO, Ping), so it steps down
  (exit code EXIT_DEPOSED) without serving them; once the standby continues the streams end as an
  undisturbed run's, nothing lost or repeated.
* A real worker welcomed at term 2 does not run a step stamped term 1 (a deposed scheduler's).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.scheduler_restart import (
    params,
    pauses,
    prompt,
    standby_address,
    start_up,
    stop_up,
    streams_through_kills,
    summary,
    wait_ready,
)
from zeroserve.common.failover import EXIT_DEPOSED
from zeroserve.common.transport import free_port, free_port_block
from tests.cluster import SESSION_ENV, SESSION_TAG, LocalCluster, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

STREAMS, MAX_TOKENS = 24, 320


@pytest.mark.timeout(300)
def test_active_scheduler_sigkilled_under_24_streams_the_standby_takes_over(tmp_path):
    port = free_port_block(8)
    address = standby_address(port)
    up = start_up(str(cached_model_dir("llama")), port, free_port(), tmp_path / "up.log", {SESSION_ENV: SESSION_TAG},
                  extra=("--standby",))
    try:
        wait_ready(address, up, 180, tmp_path / "up.log")
        r = asyncio.run(streams_through_kills(address, up, STREAMS, MAX_TOKENS, kills=1))
    finally:
        stop_up(up)
    log = (tmp_path / "up.log").read_text(errors="replace")
    assert "taking over" in log and "term=2" in log, log[-3000:]
    for i, (got, want) in enumerate(zip(r["outs"], r["ref"])):
        assert len(want[0]) == params(i, MAX_TOKENS)["max_tokens"]
        assert got == want, f"stream {i} differs from the undisturbed run"
    p = pauses(r["stamps"], r["kills"], 0)
    print(f"\nstandby: SIGKILL -> next new token {summary(p)}")


def _wait(cond, timeout: float, what: str, cluster: LocalCluster) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}\n{cluster.logs()}")
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_a_deposed_scheduler_steps_down_when_peers_name_a_higher_term():
    from zeroserve import AsyncClient

    n, max_tokens = 6, 400
    # a 2 s lease: on a loaded 2-core host the active's loop can stall past the default 1 s, and a
    # takeover before the SIGSTOP would test another story (a dead process is noticed by its
    # dropped connection whatever the lease)
    c = LocalCluster(cached_model_dir("llama"), standby=True, scheduler_args=["--standby-lease", "2"])
    try:
        c.start()
        c.wait_ready(timeout=180)
        c.wait_role("scheduler-b", "standby")

        async def run():
            async with AsyncClient(c.address, timeout_s=30.0) as ac:
                ref = await asyncio.gather(*(ac.generate(prompt(i), params(i, max_tokens)) for i in range(n)))
                counts = [0] * n

                async def one(i: int) -> tuple[list[int], str]:
                    toks, text = [], ""
                    async for d in ac.stream(prompt(i), params(i, max_tokens)):
                        toks += d.token_ids
                        text += d.text
                        counts[i] = len(toks)
                    return toks, text

                async def until(cond, timeout: float, what: str) -> None:
                    deadline = time.monotonic() + timeout
                    while not cond():
                        assert time.monotonic() < deadline, f"{what}: {counts}"
                        await asyncio.sleep(0.05)

                tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
                await until(lambda: min(counts) >= 10, 60, "no tokens")
                assert (await asyncio.to_thread(c.role, "scheduler-b"))["role"] == "standby"
                c.kill("scheduler", signal.SIGSTOP)  # paused, not dead: its sockets stay open
                t0 = time.monotonic()
                await asyncio.to_thread(c.wait_role, "scheduler-b", "active", 30)
                took_over = time.monotonic() - t0
                base = list(counts)
                await until(lambda: all(x > b + 5 for x, b in zip(counts, base)), 60,
                            "the streams did not go on on the standby")
                # the peers are on "scheduler-b" at term 2; now it pauses and the old one resumes
                c.kill("scheduler-b", signal.SIGSTOP)
                c.kill("scheduler", signal.SIGCONT)
                code = await asyncio.to_thread(c.wait_exit, "scheduler", 30)
                c.kill("scheduler-b", signal.SIGCONT)
                outs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
                return ref, outs, code, took_over

        ref, outs, code, took_over = asyncio.run(run())
        log_a = (c.logdir / "scheduler.log").read_text(errors="replace")
        assert code == EXIT_DEPOSED, log_a[-3000:]
        assert "deposed" in log_a
        assert c.role("scheduler-b")["term"] == 2
        for i, (o, r) in enumerate(zip(outs, ref)):
            assert o == (r.outputs[0].token_ids, r.outputs[0].text), f"stream {i} differs from the undisturbed run"
        print(f"\nSIGSTOP -> the standby active in {took_over:.2f} s")
    finally:
        for name in ("scheduler", "scheduler-b"):  # never leave one stopped
            ch = c.children.get(name)
            if ch is not None and ch.proc.poll() is None:
                ch.proc.send_signal(signal.SIGCONT)
        c.stop()


@pytest.mark.timeout(120)
def test_a_worker_does_not_run_a_step_of_a_lower_term(tmp_path):
    """A real worker process that a term-2 scheduler welcomed: a Step stamped term 1 (what a
    deposed scheduler still subscribed to would publish) is dropped unrun; the same step at term 2
    runs and is answered. The scheduler here is a scripted ROUTER + PUB in the test."""
    import subprocess

    import zmq

    from zeroserve.common import messages as P
    from zeroserve.common.codec import group_topic
    from zeroserve.common.transport import Channel, bind_free_port, make_socket
    from zeroserve.services.launcher import _die_with_parent

    ctx = zmq.Context()
    backend, steps = make_socket(ctx, zmq.ROUTER), make_socket(ctx, zmq.PUB)
    b_addr, s_addr = bind_free_port(backend), bind_free_port(steps)
    bch, sch = Channel(backend), Channel(steps)
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 (closed below)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{SESSION_ENV: SESSION_TAG})
    # two addresses: the worker fences by term (the second one never answers)
    w = subprocess.Popen([sys.executable, "-m", "zeroserve.services.cli", "worker", "--scheduler",
                          f"{b_addr},tcp://127.0.0.1:{free_port()}", "--model", str(cached_model_dir("llama")),
                          "--worker-id", "w1", "--threads", "1", "--num-kv-blocks", "64", "--heartbeat-interval", "0.2"],
                         env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    try:
        def recv(kind, timeout: float):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if bch.poll(0.05):
                    ident, msg = bch.recv()
                    if isinstance(msg, P.Heartbeat):  # a live scheduler answers a heartbeat with a term
                        bch.send(P.Pong(nonce=0, scheduler_id="S2", term=2), ident)
                    if isinstance(msg, kind):
                        return ident, msg
            return None, None

        ident, hello = recv(P.Hello, 90)
        assert hello is not None, (tmp_path / "worker.log").read_text()[-3000:]
        bch.send(P.Welcome(status="accepted", group=hello.group, step_addr=s_addr, scheduler_id="S2", term=2), ident)
        topic = group_topic(hello.group)
        deadline = time.monotonic() + 30
        while recv(P.ProbeAck, 0.1)[1] is None:  # until its SUB is subscribed
            assert time.monotonic() < deadline
            sch.send(P.Probe(probe_id="p"), topic)

        def step(term: int) -> P.Step:
            return P.Step(seq=1, group=hello.group, term=term, new_reqs=[P.NewRequest(
                req_id="r", token_ids=[1, 2, 3], num_prompt_tokens=3, block_ids=[0], num_scheduled_tokens=3)])

        sch.send(step(1), topic)
        assert recv(P.StepResult, 2.0)[1] is None, "a term-1 step ran"
        sch.send(step(2), topic)
        _, res = recv(P.StepResult, 30)
        assert res is not None and res.seq == 1 and res.req_ids == ["r"]
        assert "dropped a step of a deposed scheduler" in (tmp_path / "worker.log").read_text()
    finally:
        w.kill()
        w.wait(10)
        log.close()
        bch.close()
        sch.close()
        ctx.destroy(linger=0)
