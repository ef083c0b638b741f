"""Hostile and confused peers on a live cluster (one real worker group g0 and the detokenizer).

1. A fake worker joins the model with its own group and answers a step with sampled id 999999:
   the scheduler evicts its group, requeues its requests on g0, no client sees the id, the
   outputs equal a clean run, the real worker does not crash.
2. Raw DEALERs showing the real worker's, its heartbeat socket's and the detokenizer's routing
   ids send lifecycle messages and close: the backend ROUTER never reads them (one live
   connection per identity); nothing changes.
3. A second `zeroserve worker --worker-id g0-r0` gets a refusal naming the conflict and exits 2;
   the real one keeps serving.
4. The real worker SIGKILLed and started again gets back in (its old connections are gone).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.common import codec
from zeroserve.common import messages as P
from tests.cluster import LocalCluster, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir, tie_free, torch_single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("no_leftover_processes", "torch_single_thread")

VOCAB = 512
BAD_ID = 999999


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(cached_model_dir("llama"), workers=1, num_kv_blocks=256).running(timeout=240) as c:
        yield c


@pytest.fixture(scope="module")
def jobs():
    import random

    rng = random.Random(11)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(12)]
    max_tokens = [rng.randint(8, 16) for _ in range(12)]
    kept = tie_free(cached_model_dir("llama"), prompts, max_tokens, 8, num_kv_blocks=256)
    return [(prompts[i], {"temperature": 0.0, "max_tokens": max_tokens[i], "ignore_eos": True},
             list(o.outputs[0].token_ids)) for i, o in kept]


async def _run(address: str, jobs) -> list[list[int]]:
    from zeroserve import AsyncClient

    async def one(c, p, sp):
        toks = []
        async for d in c.stream(p, sp):
            toks += d.token_ids
        return toks

    async with AsyncClient(address, timeout_s=30.0) as c:
        return await asyncio.wait_for(asyncio.gather(*(one(c, p, sp) for p, sp, _ in jobs)), 120)


def _log(cluster: LocalCluster, name: str) -> str:
    return (cluster.logdir / f"{name}.log").read_text(errors="replace")


class HostileWorker(threading.Thread):
    """Joins as group "evil" for the cluster's model, acks probes, heartbeats, and answers every
    step with sampled id 999999 for every request."""

    def __init__(self, cluster: LocalCluster, model: str, numeric_mode: str) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.IDENTITY, b"evil-r0")
        self.dealer.connect(cluster.backend)
        self.model = model
        self.numeric_mode = numeric_mode  # it claims to compute as the real workers do
        self.steps = 0
        self.shutdown = threading.Event()
        self.welcome: P.Welcome | None = None
        self.stop = threading.Event()

    def send(self, msg) -> None:
        self.dealer.send_multipart(codec.encode(msg))

    def run(self) -> None:
        self.send(P.Hello(role="worker", worker_id="evil-r0", group="evil", model=self.model, device="cpu",
                          num_kv_blocks=256, block_size=16, max_model_len=2048, numeric_mode=self.numeric_mode))
        assert self.dealer.poll(10000)
        self.welcome = codec.decode(self.dealer.recv_multipart())
        if not self.welcome.accepted:
            return
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, codec.group_topic("evil"))
        sub.connect(self.welcome.step_addr)
        next_hb = 0.0
        try:
            while not self.stop.is_set():
                if time.monotonic() >= next_hb:
                    next_hb = time.monotonic() + 0.5
                    self.send(P.Heartbeat(worker_id="evil-r0"))
                if not sub.poll(100):
                    continue
                _topic, msg = codec.decode_pub(sub.recv_multipart())
                if isinstance(msg, P.Probe):
                    self.send(P.ProbeAck(worker_id="evil-r0", probe_id=msg.probe_id))
                elif isinstance(msg, P.Shutdown):
                    self.shutdown.set()
                elif isinstance(msg, P.Step) and not msg.empty:
                    self.steps += 1
                    ids = msg.req_ids()
                    self.send(P.StepResult(seq=msg.seq, worker_id="evil-r0", req_ids=ids,
                                           sampled_token_ids=np.full(len(ids), BAD_ID, np.int32)))
        finally:
            sub.close(linger=0)

    def close(self) -> None:
        self.stop.set()
        self.join(timeout=5)
        self.dealer.close(linger=0)
        self.ctx.term()


@pytest.mark.timeout(240)
def test_a_worker_answering_nonsense_is_evicted_and_its_requests_move(cluster, jobs):
    s = cluster.stats()
    evil = HostileWorker(cluster, s["models"][0], s["numeric_modes"][s["models"][0]])
    evil.start()
    try:
        deadline = time.monotonic() + 30
        while not any(g["name"] == "evil" and g["state"] == "ready" for g in cluster.stats()["groups"]):
            assert time.monotonic() < deadline, "the hostile worker's group never became ready"
            time.sleep(0.1)
        outs = asyncio.run(_run(cluster.address, jobs))
        assert evil.steps >= 1, "no request went to the hostile group"
        assert evil.shutdown.wait(5), "the hostile group was not ended"
    finally:
        evil.close()
    assert all(BAD_ID not in o for o in outs)
    assert outs == [ref for _, _, ref in jobs], "outputs differ from the clean run"
    log = _log(cluster, "scheduler")
    assert "bad step result" in log and "outside [0, 512)" in log, log[-3000:]
    assert "Traceback" not in log and "handler failed" not in log
    g0 = next(g for g in cluster.stats()["groups"] if g["name"] == "g0")
    assert g0["state"] == "ready" and g0["workers"][0]["pid"] == cluster.children["g0-r0"].proc.pid
    assert cluster.children["g0-r0"].alive()


@pytest.mark.timeout(120)
def test_routing_id_hijacks_of_worker_and_detokenizer_change_nothing(cluster, jobs):
    s = cluster.stats()
    detok_id = s["detokenizer"]["worker_id"]
    seen = len(_log(cluster, "scheduler"))
    ctx = zmq.Context()
    try:
        for ident, msg in ((b"g0-r0", P.Goodbye(worker_id="g0-r0", reason="hijack")),
                           (b"g0-r0", P.WorkerError(worker_id="g0-r0", seq=1, message="hijack")),
                           (b"g0-r0-hb", P.Drain(worker_id="g0-r0")),
                           (detok_id.encode(), P.Goodbye(worker_id=detok_id, reason="hijack")),
                           (detok_id.encode(), P.DetokOutputs(seq=1, req_ids=["0#0"], text_deltas=["boo"],
                                                              stop_strs=[None]))):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, ident)
            sock.connect(cluster.backend)
            sock.send_multipart(codec.encode(msg))
            time.sleep(0.3)
            sock.close(linger=0)
    finally:
        ctx.term()
    time.sleep(1.0)
    outs = asyncio.run(_run(cluster.address, jobs[:3]))
    assert outs == [ref for _, _, ref in jobs[:3]]
    log = _log(cluster, "scheduler")[seen:]
    assert "group gone" not in log and "group draining" not in log and "detokenizer joined" not in log, log[-3000:]
    s2 = cluster.stats()
    assert s2["detokenizer"]["connected"] and s2["detokenizer"]["worker_id"] == detok_id
    g0 = next(g for g in s2["groups"] if g["name"] == "g0")
    assert g0["state"] == "ready" and g0["workers"][0]["pid"] == cluster.children["g0-r0"].proc.pid


@pytest.mark.timeout(120)
def test_a_duplicate_worker_id_is_refused_and_the_real_worker_keeps_serving(cluster, jobs):
    real_pid = cluster.children["g0-r0"].proc.pid
    dup = cluster._start("dup-g0-r0", cluster._cmd(
        "worker", "--scheduler", cluster.backend, "--model", cluster.model, "--group", "g0", "--worker-id", "g0-r0",
        "--num-kv-blocks", "64", "--threads", "1"))
    code = dup.proc.wait(timeout=90)
    out = _log(cluster, "dup-g0-r0")
    assert code == 2, out[-3000:]
    assert "another live connection already uses the identity 'g0-r0'" in out, out[-3000:]
    outs = asyncio.run(_run(cluster.address, jobs[:2]))
    assert outs == [ref for _, _, ref in jobs[:2]]
    g0 = next(g for g in cluster.stats()["groups"] if g["name"] == "g0")
    assert g0["state"] == "ready" and g0["workers"][0]["pid"] == real_pid


@pytest.mark.timeout(180)
def test_a_restarted_worker_gets_back_in(cluster, jobs):
    import signal

    cluster.kill("g0-r0", signal.SIGKILL)
    cluster.wait_exit("g0-r0")
    new_pid = cluster.start_worker("g0").proc.pid
    deadline = time.monotonic() + 120
    while True:  # until g0 is ready again with the new process (the old entry times out first)
        g0 = next((g for g in cluster.stats()["groups"] if g["name"] == "g0"), None)
        if g0 is not None and g0["state"] == "ready" and g0["workers"][0]["pid"] == new_pid:
            break
        assert time.monotonic() < deadline, f"the restarted worker did not get back in: {g0}"
        time.sleep(0.2)
    outs = asyncio.run(_run(cluster.address, jobs[:2]))
    assert outs == [ref for _, _, ref in jobs[:2]]
