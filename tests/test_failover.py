"""Failure handling of the real cluster (docs/architecture.md, "The cluster").

One module-scoped cluster (scheduler, detokenizer, groups g0 and g1, tp=1) goes through the
failures in order; each test leaves it serving for the next one:

1. SIGKILL a worker while 64 streamed greedy requests run: all complete with the reference
   tokens and text; no stream repeats or skips a token.
2. A worker started while requests run joins and takes requests.
3. SIGKILL the detokenizer mid-run and start a new one: streams go on without loss or repeats.
4. SIGTERM a worker mid-run: it drains (its requests complete), exits 0, its group leaves stats.
5. SIGKILL the scheduler: client calls (and in-flight streams) fail with ClusterUnavailable
   within the client's timeout; a scheduler restarted on the same port gets the worker and the
   detokenizer back by themselves and requests succeed again.

The reference for every request is the in-process engine (`zeroserve.LLM`) on the same model
(greedy + ignore_eos, so outputs do not depend on batching or on which group ran them).
"Final" outputs: a quarter of the requests use the non-streaming `generate` (the assembled
RequestOutput); the others are streams whose joined deltas must equal the reference exactly
(equal length and content: a repeated or skipped token would shift or lengthen the sequence).
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import LocalCluster
from tests.helpers import cached_model_dir, tie_free, torch_single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

N_REQUESTS = 64
VOCAB = 512


# ---------------------------------------------------------------------------------- workload

@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    ref_tokens: list[list[int]] = field(default_factory=list)
    ref_text: list[str] = field(default_factory=list)

    def params(self, i: int):
        from zeroserve import SamplingParams

        return SamplingParams(max_tokens=self.max_tokens[i], temperature=0.0, ignore_eos=True)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    reasons: list = field(default_factory=list)  # finish_reason of each delta
    streamed: bool = True
    error: BaseException | None = None


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(model_dir):
    with LocalCluster(model_dir, workers=2, num_kv_blocks=256).running(groups=2) as c:
        yield c


@pytest.fixture(scope="module")
def workload(model_dir) -> Workload:
    """64 seeded requests (prompts 2-90 tokens, 16-32 output tokens) and their reference outputs."""
    rng = random.Random(1234)
    n_draw = N_REQUESTS + 16  # a recompute on another group must not meet a near-tie
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 90))] for _ in range(n_draw)]
    max_tokens = [rng.randint(16, 32) for _ in range(n_draw)]
    kept = tie_free(model_dir, prompts, max_tokens, N_REQUESTS, num_kv_blocks=256)
    wl = Workload([prompts[i] for i, _ in kept], [max_tokens[i] for i, _ in kept])
    wl.ref_tokens = [list(o.outputs[0].token_ids) for _, o in kept]
    wl.ref_text = [o.outputs[0].text for _, o in kept]
    assert all(len(t) == n for t, n in zip(wl.ref_tokens, wl.max_tokens))
    return wl


# ---------------------------------------------------------------------------------- harness

class Run:
    """Runs requests concurrently through one AsyncClient and calls `action` once after
    `threshold` tokens were streamed in total (the action runs on the client's loop: keep it short)."""

    def __init__(self, cluster: LocalCluster, wl: Workload, indices=None, threshold: int | None = None,
                 action=None, timeout_s: float = 60.0) -> None:
        self.cluster, self.wl = cluster, wl
        self.indices = list(range(N_REQUESTS)) if indices is None else list(indices)
        self.threshold, self.action = threshold, action
        self.timeout_s = timeout_s
        self.streamed = 0
        self.fired_at: int | None = None
        self.results: dict[int, Result] = {}

    def _progress(self, n: int) -> None:
        self.streamed += n
        if self.action is not None and self.fired_at is None and self.streamed >= self.threshold:
            self.fired_at = self.streamed
            self.action()

    async def _one(self, c, i: int) -> None:
        res = self.results[i] = Result(streamed=i % 4 != 3)
        try:
            if res.streamed:
                async for d in c.stream(self.wl.prompts[i], self.wl.params(i)):
                    res.tokens += d.token_ids
                    res.text += d.text
                    res.reasons.append(d.finish_reason)
                    self._progress(len(d.token_ids))
            else:
                out = await c.generate(self.wl.prompts[i], self.wl.params(i))
                res.tokens = list(out.outputs[0].token_ids)
                res.text = out.outputs[0].text
                res.reasons = [out.outputs[0].finish_reason]
                self._progress(len(res.tokens))
        except Exception as e:  # noqa: BLE001 - checked by the caller
            res.error = e

    async def _main(self) -> None:
        from zeroserve import AsyncClient

        async with AsyncClient(self.cluster.address, timeout_s=self.timeout_s) as c:
            await asyncio.gather(*(self._one(c, i) for i in self.indices))

    def run(self) -> Run:
        asyncio.run(self._main())
        return self

    @property
    def total(self) -> int:
        return sum(self.wl.max_tokens[i] for i in self.indices)

    def check(self, text: bool = True) -> None:
        """Every request finished once, with exactly the reference tokens (and text)."""
        errs = []
        for i in self.indices:
            r, ref = self.results[i], self.wl.ref_tokens[i]
            kind = "stream" if r.streamed else "generate"
            if r.error is not None:
                errs.append(f"req {i} ({kind}): {type(r.error).__name__}: {r.error}")
                continue
            if r.tokens != ref:
                errs.append(f"req {i} ({kind}): tokens differ from the reference: got {len(r.tokens)} "
                            f"{_diff(r.tokens, ref)}")
            elif text and r.text != self.wl.ref_text[i]:
                errs.append(f"req {i} ({kind}): text differs: {r.text!r} != {self.wl.ref_text[i]!r}")
            if r.reasons[-1:] != ["length"] or any(x is not None for x in r.reasons[:-1]):
                errs.append(f"req {i} ({kind}): finish reasons {r.reasons}")
        assert not errs, (f"{len(errs)} of {len(self.indices)} requests wrong:\n" + "\n".join(errs[:12])
                          + "\n" + self.cluster.logs())


def _diff(got: list[int], ref: list[int]) -> str:
    k = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    return f"(first difference at {k}: got {got[k:k + 4]} want {ref[k:k + 4]}; ref len {len(ref)})"


def _groups(cluster: LocalCluster) -> dict[str, dict]:
    return {g["name"]: g for g in cluster.stats()["groups"]}


def _wait(pred, timeout: float, what: str, cluster: LocalCluster, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - scheduler briefly unreachable
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last {last!r}\n{cluster.logs()}")


# ---------------------------------------------------------------------------------- tests

def test_baseline_no_failure(cluster, workload):
    run = Run(cluster, workload).run()
    run.check()
    groups = _groups(cluster)
    assert groups["g0"]["tokens"] > 0 and groups["g1"]["tokens"] > 0, "both groups should have served"


def test_worker_sigkill_midrun(cluster, workload):
    run = Run(cluster, workload, threshold=N_REQUESTS * 3, action=lambda: cluster.kill("g0-r0", signal.SIGKILL))
    run.run()
    assert run.fired_at is not None and run.fired_at < run.total, "the kill should land mid-run"
    run.check()
    assert cluster.wait_exit("g0-r0", timeout=10) == -signal.SIGKILL
    groups = _groups(cluster)
    assert "g0" not in groups and groups["g1"]["state"] == "ready", groups


def test_worker_started_midrun_takes_requests(cluster, workload):
    """Requests keep flowing (waves over the one remaining group) while a new g0 starts; once it
    is ready, the requests that follow are spread over both groups."""
    cluster.start_worker("g0")
    t0 = time.monotonic()
    waves = 0
    while True:
        ready = _groups(cluster).get("g0", {}).get("state") == "ready"
        run = Run(cluster, workload, indices=range(waves % 4, N_REQUESTS, 4)).run()
        run.check()
        waves += 1
        if ready:
            break
        assert time.monotonic() - t0 < 180, "the new worker did not join\n" + cluster.logs()
    g0 = _groups(cluster)["g0"]
    assert g0["steps"] > 0 and g0["tokens"] > 0, g0
    assert waves >= 2, "the worker should have joined while requests were running"


_DETOK_RUN: dict[str, Run] = {}


def test_detokenizer_restart_midrun(cluster, workload):
    """Token streams go on without loss or repeats across a detokenizer restart (the texts are
    checked by the next test)."""
    def swap():
        cluster.kill("detokenizer", signal.SIGKILL)
        cluster.start_detokenizer("detokenizer2")

    run = Run(cluster, workload, threshold=N_REQUESTS * 3, action=swap).run()
    _DETOK_RUN["run"] = run
    assert run.fired_at is not None and run.fired_at < run.total
    run.check(text=False)
    st = cluster.stats()
    assert st["detokenizer"]["connected"] and st["detokenizer"]["worker_id"], st["detokenizer"]
    # and it keeps working for new requests
    Run(cluster, workload, indices=range(0, N_REQUESTS, 8)).run().check()


def test_detokenizer_restart_texts(cluster, workload):
    run = _DETOK_RUN.get("run")
    if run is None:
        pytest.skip("the detokenizer restart run did not happen")
    run.check(text=True)


def test_sigterm_drains_worker(cluster, workload):
    victim = {}

    def drain():
        groups = _groups(cluster)  # a blocking Client on its own thread: fine from the Run's loop
        busy = [g for g in groups.values() if g["state"] == "ready" and g["running"] > 0] or list(groups.values())
        name = busy[0]["name"]
        victim.update(name=name, running=busy[0]["running"], tokens=busy[0]["tokens"])
        cluster.kill(f"{name}-r0", signal.SIGTERM)

    sched_log = cluster.logdir / "scheduler.log"
    log_start = sched_log.stat().st_size
    run = Run(cluster, workload, threshold=N_REQUESTS * 3, action=drain).run()
    assert run.fired_at is not None and run.fired_at < run.total
    run.check()
    name = victim["name"]
    assert victim["running"] > 0, f"the drained group should have had requests in flight: {victim}"
    assert cluster.wait_exit(f"{name}-r0", timeout=60) == 0, cluster.logs()
    _wait(lambda: name not in _groups(cluster), 30, f"group {name} to leave the stats", cluster)
    with open(sched_log, "rb") as f:
        f.seek(log_start)
        log = f.read().decode(errors="replace")
    gone = [line for line in log.splitlines() if "group gone" in line]
    assert len(gone) == 1 and f"group={name}" in gone[0] and "reason=drained" in gone[0], log


def test_scheduler_restart(cluster, workload):
    from zeroserve import ClusterUnavailable

    left = _groups(cluster)
    assert len(left) == 1
    # in-flight streams when the scheduler dies fail with ClusterUnavailable within their timeout
    run = Run(cluster, workload, indices=range(0, N_REQUESTS, 2), threshold=N_REQUESTS, timeout_s=4.0,
              action=lambda: cluster.kill("scheduler", signal.SIGKILL))
    t0 = time.monotonic()
    run.run()
    elapsed = time.monotonic() - t0
    assert run.fired_at is not None
    failed = [i for i, r in run.results.items() if r.error is not None]
    assert failed, "some requests should have been in flight when the scheduler died"
    for i in failed:
        assert isinstance(run.results[i].error, ClusterUnavailable), run.results[i].error
    assert elapsed < 4.0 + 15.0, elapsed
    cluster.wait_exit("scheduler", timeout=10)

    # a fresh call fails within its timeout as well
    with cluster.client(timeout_s=3.0) as c:
        t0 = time.monotonic()
        with pytest.raises(ClusterUnavailable):
            c.generate(workload.prompts[0], workload.params(0))
        assert time.monotonic() - t0 < 3.0 + 3.0
        with pytest.raises(ClusterUnavailable):
            c.stats()

    # restart on the same port: the worker and the detokenizer come back by themselves
    sched_log = cluster.logdir / "scheduler.log"
    log_start = sched_log.stat().st_size
    cluster.start_scheduler()
    cluster.wait_ready(groups=1, timeout=120)
    assert set(_groups(cluster)) == set(left)
    t0 = time.monotonic()
    Run(cluster, workload, indices=range(1, N_REQUESTS, 2)).run().check()
    with open(sched_log, "rb") as f:
        f.seek(log_start)
        _RESTART.update(run_s=time.monotonic() - t0, log=f.read().decode(errors="replace"))


_RESTART: dict = {}


def test_scheduler_restart_rejoin_is_prompt(cluster):
    if not _RESTART:
        pytest.skip("the scheduler restart test did not get that far")
    joins = [line for line in _RESTART["log"].splitlines() if "detokenizer joined" in line]
    assert len(joins) == 1 and _RESTART["run_s"] < 10.0, (
        f"{len(joins)} detokenizer joins after the restart; 32 requests took {_RESTART['run_s']:.1f}s:\n"
        + "\n".join(joins[:5]))
