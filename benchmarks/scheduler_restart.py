"""The pause a stream sees when the scheduler is SIGKILLed and `zeroserve up` restarts it, or
(--standby) its hot standby takes over.

Starts `zeroserve up` (one worker, a tiny random model unless --model), runs N concurrent
streams (half greedy, half seeded), SIGKILLs the scheduler once every stream has tokens (and
again, --kills), and checks every stream against an undisturbed run of the same requests on the
same cluster. The pause of a stream is the longest gap between two of its deltas around a kill
(the kill -> its next new token: tokens already on the wire when the scheduler died arrive
at once and do not end the pause). tests/chaos/test_scheduler_restart.py runs the same code.

    .venv/bin/python benchmarks/scheduler_restart.py                    # 24 streams, 2 kills
    .venv/bin/python benchmarks/scheduler_restart.py --streams 8 --kills 1 --json
    .venv/bin/python benchmarks/scheduler_restart.py --standby          # `up --standby`: the active one is killed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

KILL_AFTER = (0.05, 0.25)  # share of its max_tokens every stream has before the 1st, 2nd, ... kill


def params(i: int, max_tokens: int) -> dict:
    """Half greedy, half seeded sampling (a pure function of seed, position and logits); every
    sixth a seeded one under a regex (its grammar matcher must take the received tokens again)."""
    if i % 2 == 0:
        return {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    p = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
    if i % 6 == 5:  # longer than max_tokens can write: it ends by length, constrained all the way
        # fewer tokens: its steps come ~10x slower here, and on a restarted scheduler it waits for
        # the tokenizer and the grammar compiler (seconds) while the others go on
        p.update(structured_outputs={"regex": "[a-z]{2000}"}, max_tokens=max(max_tokens // 8, 8))
    return p


def prompt(i: int) -> list[int]:
    return [3 + i, 5 + (i * 7) % 50, 7, 11 + i % 5]


# ------------------------------------------------------------------------------- the cluster
def start_up(model_dir: str, port: int, gateway_port: int, log_path: Path, env: dict | None = None,
             extra: tuple[str, ...] = (), workers: int = 1) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "zeroserve.services.cli", "up", "--model", model_dir,
                                 "--port", str(port), "--gateway-port", str(gateway_port), "--workers", str(workers),
                                 "--threads", "1", "--num-kv-blocks", "512", *extra],
                                env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def standby_address(port: int) -> str:
    """Both schedulers of `up --standby --port PORT` (the standby on PORT + 4)."""
    return f"tcp://127.0.0.1:{port},tcp://127.0.0.1:{port + 4}"


def stop_up(up: subprocess.Popen) -> None:
    up.send_signal(signal.SIGTERM)
    try:
        up.wait(timeout=30)
    except subprocess.TimeoutExpired:
        up.kill()
        up.wait(timeout=10)


def child(up: subprocess.Popen, role: str = "scheduler") -> psutil.Process | None:
    """`up`'s child serving `role` (scheduler, worker, detokenizer); the first of several. Under
    `up --standby` the scheduler is the active one of the two."""
    procs = []
    for p in psutil.Process(up.pid).children():
        try:
            if role in p.cmdline():
                procs.append(p)
        except psutil.Error:
            continue
    if role == "scheduler" and len(procs) > 1:
        return next((p for p in procs if scheduler_role(p) == "active"), None)
    return procs[0] if procs else None


def scheduler_role(p: psutil.Process) -> str | None:
    """A scheduler process's role (active, standby; None: not answering) from its stats."""
    from zeroserve import Client

    try:
        argv = p.cmdline()
        port = argv[argv.index("--port") + 1]
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=1.0) as c:
            return c.stats().get("role")
    except Exception:  # noqa: BLE001 - starting, or gone
        return None


def wait_ready(address: str, up: subprocess.Popen, timeout: float, log_path: Path | None = None) -> None:
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
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.2)
        else:
            raise TimeoutError("the cluster was not ready")
    for other in address.split(",")[1:]:  # `up --standby`: and its standby follows the active one
        with Client(other, timeout_s=2.0) as c:
            while True:
                assert time.monotonic() < deadline, "the standby did not start"
                try:
                    if c.stats().get("role") == "standby":
                        break
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                time.sleep(0.2)


async def kill_and_wait_restart(up: subprocess.Popen, timeout: float = 60.0,
                                roles: tuple[str, ...] = ("scheduler",), gap_s: float = 0.0) -> float:
    """SIGKILL `up`'s children of `roles` (the scheduler by default), `gap_s` apart, wait until
    `up` started each again; returns the scheduler's kill time (the first kill's without it).
    Under `up --standby` the active scheduler is killed and this returns once the pair is whole
    again (the standby took over, the killed one came back as its standby). The look-ups run in a
    thread: the streams' arrival stamps are taken on this loop."""
    pair = len(schedulers(up)) > 1
    old = {r: await asyncio.to_thread(child, up, r) for r in roles}
    assert all(old.values()), f"no child for each of {roles}"
    at = {}
    for i, (r, p) in enumerate(old.items()):
        if i and gap_s:
            await asyncio.sleep(gap_s)
        at[r] = time.monotonic()
        p.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + timeout
    def restarted() -> bool:
        return all((new := child(up, r)) is not None and new.pid != p.pid and p_gone(p) for r, p in old.items())

    while not await asyncio.to_thread(restarted):
        assert time.monotonic() < deadline, f"up did not restart each of {roles}"
        await asyncio.sleep(0.05)
    while pair and sorted(await asyncio.to_thread(lambda: [str(scheduler_role(p)) for p in schedulers(up)])) != [
            "active", "standby"]:
        assert time.monotonic() < deadline, "the killed scheduler did not come back as the standby"
        await asyncio.sleep(0.2)
    return at.get("scheduler", min(at.values()))


def schedulers(up: subprocess.Popen) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(up.pid).children():
        try:
            if "scheduler" in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def p_gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


# ------------------------------------------------------------------------------- the streams
async def _after(delay_s: float, fn):
    await asyncio.sleep(delay_s)
    return fn()


async def streams_through_kills(address: str, up: subprocess.Popen, n: int, max_tokens: int, kills: int,
                                client_timeout_s: float = 30.0, roles: tuple[str, ...] = ("scheduler",),
                                gap_s: float = 0.0) -> dict:
    """The undisturbed run, then the same requests as streams with `kills` SIGKILLs of the
    scheduler (and the other `roles`: kill_and_wait_restart) -> {"ref": [(tokens, text)],
    "outs": [(tokens, text)], "kills": [t], "stamps": [[t]]}."""
    from zeroserve import AsyncClient

    async with AsyncClient(address, timeout_s=client_timeout_s) as c:
        ref = await asyncio.gather(*(c.generate(prompt(i), params(i, max_tokens)) for i in range(n)))
        stamps: list[list[float]] = [[] for _ in range(n)]  # arrival of each delta with tokens
        counts = [0] * n

        async def one(i: int) -> tuple[list[int], str]:
            toks, text = [], ""
            async for d in c.stream(prompt(i), params(i, max_tokens)):
                toks += d.token_ids
                text += d.text
                counts[i] = len(toks)
                if d.token_ids:
                    stamps[i].append(time.monotonic())
            return toks, text

        # constrained streams first: their grammar compiles in the scheduler's pool before they
        # start, so the others would be far ahead (or done) by the time they have tokens
        slow = [i for i in range(n) if "structured_outputs" in params(i, max_tokens)]
        tasks = {i: asyncio.ensure_future(one(i)) for i in slow}
        deadline = time.monotonic() + 120
        while slow and min(counts[i] for i in slow) < 1:
            assert time.monotonic() < deadline, "constrained streams got no token"
            await asyncio.sleep(0.02)
        tasks = [tasks.get(i) or asyncio.ensure_future(one(i)) for i in range(n)]
        at = []
        limits = [params(i, max_tokens)["max_tokens"] for i in range(n)]
        base = [0] * n  # tokens each stream had once the last restart was seen (its old outputs all in)
        fast = [i for i in range(n) if i not in slow]  # the constrained ones may still be re-attaching
        for share in KILL_AFTER[:kills]:
            deadline = time.monotonic() + 120
            # every stream has tokens (and went on after the last kill)
            while any(counts[i] < share * limits[i] or counts[i] <= base[i] for i in fast):
                assert time.monotonic() < deadline, f"streams stalled at {counts}"
                failed = [t.exception() for t in tasks if t.done() and t.exception()]
                assert not failed, failed
                await asyncio.sleep(0.02)
            assert all(counts[i] < limits[i] for i in fast), f"a stream ended before a kill: raise max_tokens ({counts})"
            # what each stream has once the outputs on the wire at the kill are in (not later: the
            # restart may take longer than the streams do, if the kill missed)
            snap = asyncio.ensure_future(_after(0.3 + gap_s * (len(roles) - 1), lambda: list(counts)))
            at.append(await kill_and_wait_restart(up, roles=roles, gap_s=gap_s))
            base = await snap
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 180)
    return {"ref": [(o.outputs[0].token_ids, o.outputs[0].text) for o in ref], "outs": outs, "kills": at,
            "stamps": stamps}


def pauses(stamps: list[list[float]], kills: list[float], k: int) -> list[float]:
    """Per stream, the longest gap between its deltas from kill `k` to the next kill (the first
    gap measured from the kill itself); a stream that had ended before the kill has none."""
    kill_at, until = kills[k], kills[k + 1] if k + 1 < len(kills) else float("inf")
    out = []
    for st in stamps:
        after = [t for t in st if kill_at <= t < until]
        if not after:
            continue
        ts = [kill_at, *after]
        out.append(max(b - a for a, b in zip(ts, ts[1:])))
    return out


def summary(p: list[float]) -> dict:
    p = sorted(p)
    return {"streams": len(p), "median_s": round(statistics.median(p), 3), "max_s": round(p[-1], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the tests' tiny random llama)")
    ap.add_argument("--streams", type=int, default=24)
    # --standby: 960 by default (and KV for all of them: 2048 blocks). Before the 2nd kill the pair
    # must be whole again (`up` restarts the killed one after 2 s, its start takes 1.5-3 s under
    # load): 480-token streams had sometimes ended by then
    ap.add_argument("--max-tokens", type=int, default=None, help="per stream (default 480; 960 with --standby)")
    ap.add_argument("--kills", type=int, default=2, choices=range(1, len(KILL_AFTER) + 1))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--standby", action="store_true", help="`up --standby`: kill the active scheduler, the standby "
                                                           "takes over (else `up` restarts it)")
    a = ap.parse_args()
    import tempfile

    from zeroserve.common.transport import free_port, free_port_block

    model = a.model
    if model is None:
        from tests.helpers import cached_model_dir

        model = str(cached_model_dir("llama"))
    port = free_port_block(8 if a.standby else 4)
    address = standby_address(port) if a.standby else f"tcp://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "up.log"
        up = start_up(model, port, free_port(), log_path,
                      extra=("--standby", "--num-kv-blocks", "2048") if a.standby else ())
        try:
            wait_ready(address, up, 300, log_path)
            max_tokens = a.max_tokens or (960 if a.standby else 480)
            r = asyncio.run(streams_through_kills(address, up, a.streams, max_tokens, a.kills))
        finally:
            stop_up(up)
    same = sum(o == ref for o, ref in zip(r["outs"], r["ref"]))
    for i, (o, ref) in enumerate(zip(r["outs"], r["ref"])):
        if o != ref:
            at = next((j for j, (x, y) in enumerate(zip(o[0], ref[0])) if x != y), min(len(o[0]), len(ref[0])))
            print(f"stream {i} differs: tokens from {at} ({len(o[0])} vs {len(ref[0])} undisturbed); text "
                  f"{'same' if o[1] == ref[1] else 'differs'}", file=sys.stderr)
    res = {"streams": a.streams, "standby": a.standby, "identical_to_undisturbed": same,
           "pauses": [summary(pauses(r["stamps"], r["kills"], k)) for k in range(len(r["kills"]))]}
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{same}/{a.streams} streams identical to the undisturbed run")
        for i, p in enumerate(res["pauses"], 1):
            print(f"kill {i}: SIGKILL -> next new token, median {p['median_s']:.2f} s, max {p['max_s']:.2f} s "
                  f"over {p['streams']} streams")
    return 0 if same == a.streams else 1


if __name__ == "__main__":
    sys.exit(main())
