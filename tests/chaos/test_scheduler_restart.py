"""SIGKILL the scheduler under `zeroserve up` while 24 streams run (greedy, seeded, seeded under
a regex), twice in a row.

`up` restarts it at once; the client notices the new scheduler by the next Pong (it names
another scheduler_id) and re-attaches its open requests with what they received
(services/scheduler/adoption.py); the worker and the detokenizer rejoin. Every stream pauses
and goes on: greedy and seeded streams end with the tokens and text of an undisturbed run, none
lost or repeated, no error. The pause each stream saw (SIGKILL -> its next new token) is printed.
The streams, kills and pause figures are benchmarks/scheduler_restart.py's (its numbers go to
docs/benchmarks.md). The scheduler killed right after the detokenizer, or right after a worker
(while its group fails over): the streams end the same. The same through the gateway: its SSE
streams go on and end with the text of an undisturbed run.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.scheduler_restart import (
    params,
    prompt,
    pauses,
    start_up,
    stop_up,
    streams_through_kills,
    summary,
    wait_ready,
)
from zeroserve.common.transport import free_port, free_port_block
from tests.cluster import SESSION_ENV, SESSION_TAG, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

STREAMS, MAX_TOKENS = 24, 480


@pytest.mark.timeout(300)
def test_scheduler_sigkilled_twice_under_24_streams_loses_nothing(tmp_path):
    port = free_port_block(4)
    address = f"tcp://127.0.0.1:{port}"
    up = start_up(str(cached_model_dir("llama")), port, free_port(), tmp_path / "up.log", {SESSION_ENV: SESSION_TAG})
    try:
        wait_ready(address, up, 180, tmp_path / "up.log")
        r = asyncio.run(streams_through_kills(address, up, STREAMS, MAX_TOKENS, kills=2))
    finally:
        stop_up(up)
    assert len(r["outs"]) == STREAMS and len(r["kills"]) == 2
    for i, (got, want) in enumerate(zip(r["outs"], r["ref"])):
        assert len(want[0]) == params(i, MAX_TOKENS)["max_tokens"]
        if "structured_outputs" in params(i, MAX_TOKENS):  # its grammar held through both restarts
            assert want[1].isalpha() and want[1].islower()
        assert got[0] == want[0], f"stream {i}'s tokens differ from the undisturbed run"
        assert got[1] == want[1], f"stream {i}'s text differs from the undisturbed run"
    for k in range(2):
        p = pauses(r["stamps"], r["kills"], k)
        # every unconstrained stream was running at each kill and went on after it (a constrained one
        # may still be waiting for the new scheduler's grammar compiler at the next kill)
        assert len(p) >= STREAMS - sum("structured_outputs" in params(i, MAX_TOKENS) for i in range(STREAMS))
        print(f"\nkill {k + 1}: SIGKILL -> next new token {summary(p)}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("roles, gap_s", [
    (("detokenizer", "scheduler"), 0.3),  # killed while the detokenizer restarts
    (("worker", "scheduler"), 0.3),  # killed while a worker group fails over (its requests requeued)
], ids=["with-detokenizer", "during-worker-failover"])
def test_scheduler_sigkilled_while_another_part_restarts(tmp_path, roles, gap_s):
    """Two workers; another child of `up` is SIGKILLed, then the scheduler 0.3 s later: both come
    back, and 12 streams end as an undisturbed run's."""
    port = free_port_block(4)
    address = f"tcp://127.0.0.1:{port}"
    up = start_up(str(cached_model_dir("llama")), port, free_port(), tmp_path / "up.log", {SESSION_ENV: SESSION_TAG},
                  workers=2)
    try:
        wait_ready(address, up, 180, tmp_path / "up.log")
        r = asyncio.run(streams_through_kills(address, up, 12, MAX_TOKENS, kills=1, roles=roles, gap_s=gap_s))
    finally:
        stop_up(up)
    for i, (got, want) in enumerate(zip(r["outs"], r["ref"])):
        assert got == want, f"stream {i} differs from the undisturbed run"
    print(f"\n{'+'.join(roles)}: SIGKILL -> next new token {summary(pauses(r['stamps'], r['kills'], 0))}")


SSE_STREAMS, SSE_TOKENS = 8, 240


@pytest.mark.timeout(240)
def test_gateway_sse_streams_go_on_through_a_scheduler_restart(tmp_path):
    """The gateway is an AsyncClient: its SSE streams pause through the restart and end with the
    text of an undisturbed run, no error event."""
    import openai

    from benchmarks.scheduler_restart import kill_and_wait_restart

    port, gw = free_port_block(4), free_port()
    address = f"tcp://127.0.0.1:{port}"
    up = start_up(str(cached_model_dir("llama")), port, gw, tmp_path / "up.log", {SESSION_ENV: SESSION_TAG})
    try:
        wait_ready(address, up, 180, tmp_path / "up.log")

        async def run():
            ac = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw}/v1", api_key="unused", max_retries=0,
                                    timeout=120.0)
            model = (await ac.models.list()).data[0].id

            def body(i: int) -> dict:
                p = params(i, SSE_TOKENS)
                return {"model": model, "prompt": prompt(i), "max_tokens": SSE_TOKENS, "temperature": p["temperature"],
                        "seed": p.get("seed"), "extra_body": {"ignore_eos": True}}

            ref = await asyncio.gather(*(ac.completions.create(**body(i)) for i in range(SSE_STREAMS)))
            counts = [0] * SSE_STREAMS

            async def one(i: int) -> tuple[str, str | None]:
                text, reason = "", None
                async for ch in await ac.completions.create(**body(i), stream=True):
                    if ch.choices:
                        text += ch.choices[0].text
                        reason = ch.choices[0].finish_reason or reason
                        counts[i] += 1
                return text, reason

            tasks = [asyncio.ensure_future(one(i)) for i in range(SSE_STREAMS)]
            deadline = asyncio.get_running_loop().time() + 120
            while min(counts) < 8:
                assert asyncio.get_running_loop().time() < deadline, f"streams stalled at {counts}"
                await asyncio.sleep(0.02)
            assert not any(t.done() for t in tasks), "a stream ended before the kill"
            await kill_and_wait_restart(up)
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            await ac.close()
            return [(r.choices[0].text, r.choices[0].finish_reason) for r in ref], outs

        ref, outs = asyncio.run(run())
    finally:
        stop_up(up)
    for i, (got, want) in enumerate(zip(outs, ref)):
        assert want[1] == "length" and got == want, f"SSE stream {i} differs from the undisturbed run"
