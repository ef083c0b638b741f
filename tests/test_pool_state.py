"""The model pool's policy (services/scheduler/pool.py) in the scheduler's pure state, no sockets.

Fake pool members answer Load with LoadStatus "loaded" and a HELLO for the model (then probe
acks and steps, as tests/scheduler_sim.py's fake workers do), and Unload with "unloaded" and an
empty HELLO; a fake clock drives keep_alive and liveness. What the policy must hold:

* a request for a model no member holds waits while an idle member loads it;
* with every member busy holding other models, the least recently used idle model is evicted,
  never a pinned one, never one with requests, and a model's second copy before another model;
* keep_alive unloads an idle model, never a pinned one;
* a failed load fails that model's waiting requests with ModelLoadError, marks it failed, and
  leaves the other models alone; a member silent during its load is dropped and its load given
  to another member;
* a member whose load computes in another numeric mode than the model's fails that load the same
  way, frees the model and stays in the pool.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.common import messages as P  # noqa: E402
from zeroserve.common.catalog import FOREVER, CatalogEntry  # noqa: E402
from zeroserve.common.config import SchedulerConfig  # noqa: E402
from zeroserve.common.model_config import ModelConfig  # noqa: E402
from zeroserve.common.sampling_params import SamplingParams  # noqa: E402
from zeroserve.services.scheduler.cluster import Cluster, ModelInfo  # noqa: E402
from tests.scheduler_sim import VOCAB, FakeWorker, Net, prompt, reference  # noqa: E402


def _cfg(name: str) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
                       head_dim=32, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=2048,
                       eos_token_ids=[2], name=name)


def make_pool_cluster(entries: dict[str, dict], **over) -> Cluster:
    kw = {"heartbeat_timeout_s": 1.0, "step_timeout_s": 2.0, "client_timeout_s": 1000.0, "no_worker_timeout_s": 50.0,
          "probe_interval_s": 0.1, "stats_interval_s": 1e9}
    kw.update(over)
    catalog = {n: CatalogEntry(n, f"/models/{n}", config=_cfg(n), **e) for n, e in entries.items()}
    models = {n: ModelInfo(n, e.config) for n, e in catalog.items()}
    return Cluster(SchedulerConfig(**kw), models, "sched-test", "tcp://sched:7002", {}, now=100.0, catalog=catalog)


class PoolNet(Net):
    """Net plus pool members that load, unload and fail as told."""

    def __init__(self, c: Cluster) -> None:
        super().__init__(c)
        self.members: dict[str, FakeWorker] = {}
        self.broken: set[str] = set()  # models whose load fails
        self.stopped: set[str] = set()  # members that stopped answering (killed)
        self.slow: set[str] = set()  # members that heartbeat but leave their messages unread (a long load)
        self.modes: dict[str, str] = {}  # member -> the numeric mode its loads report (default MODE)
        self.loads: list[tuple[str, str]] = []  # (member, model) in order
        self.unloads: list[tuple[str, str]] = []

    def add_member(self, wid: str) -> None:
        self.members[wid] = FakeWorker(wid)
        self._hello(wid, "")

    def _hello(self, wid: str, model: str) -> None:
        w = self.members[wid]
        h = P.Hello(role="worker", worker_id=wid, group=f"g-{wid}", pool=True, model=model,
                    num_kv_blocks=64 if model else 0, block_size=16 if model else 0, max_model_len=2048,
                    numeric_mode=self.modes.get(wid, MODE) if model else "")
        self.send(self.c.on_hello(w.ident, h, self.now))
        last = self.backend[w.ident][-1]  # welcomed, or told to unload what it holds
        assert isinstance(last, P.Unload) or last.status == "accepted", last

    def turn(self, detok: bool = True) -> None:
        for wid, w in self.members.items():
            if wid in self.stopped:
                continue
            if wid in self.slow:
                self.send(self.c.on_heartbeat(w.ident, P.Heartbeat(worker_id=wid), self.now))
                continue
            inbox, self.backend[w.ident] = self.backend[w.ident], []
            for m in inbox:
                if isinstance(m, P.Load):
                    self.loads.append((wid, m.model))
                    if m.model in self.broken:
                        self.send(self.c.on_load_status(w.ident, P.LoadStatus(
                            worker_id=wid, load_id=m.load_id, phase="failed", error="truncated weights"), self.now))
                        self._hello(wid, "")
                        continue
                    self.send(self.c.on_load_status(w.ident, P.LoadStatus(
                        worker_id=wid, load_id=m.load_id, phase="loaded", model=m.model, elapsed_s=0.5), self.now))
                    self._hello(wid, m.model)
                    if not isinstance(self.backend[w.ident][-1], P.Unload):
                        self.workers[f"g-{wid}"] = [w]
                elif isinstance(m, P.Unload):
                    self.unloads.append((wid, self.c.pool.members[wid].model))
                    self.workers.pop(f"g-{wid}", None)
                    w.reqs.clear()
                    self.send(self.c.on_load_status(w.ident, P.LoadStatus(
                        worker_id=wid, load_id=m.load_id, phase="unloaded"), self.now))
                    self._hello(wid, "")
            if f"g-{wid}" not in self.workers:  # idle members heartbeat too
                self.send(self.c.on_heartbeat(w.ident, P.Heartbeat(worker_id=wid), self.now))
        probes = [(g, m) for g, m in self.published if isinstance(m, P.Probe)]
        for g, m in probes[-len(self.members):]:
            for w in self.workers.get(g, []):
                self.send(self.c.on_probe_ack(w.ident, P.ProbeAck(worker_id=w.worker_id, probe_id=m.probe_id),
                                              self.now))
        for wid in self.stopped:
            self.workers.pop(f"g-{wid}", None)
        super().turn(detok)

    def ask(self, rid: str, model: str, n: int = 4, seed: int = 1) -> list[int]:
        p = prompt(8, seed)
        params = SamplingParams(model=model, temperature=0.0, max_tokens=n, ignore_eos=True)
        self.send(self.c.on_submit(b"client-1", P.Submit(request_id=rid, prompt_token_ids=np.asarray(p, np.int32),
                                                         params=params), self.now))
        return p

    def got_all(self, rid: str):
        return self.got(rid, b"client-1")

    def finished(self, rid: str) -> bool:
        toks, _, reasons, errors = self.got_all(rid)
        return bool(reasons or errors)

    def holding(self) -> dict[str, str]:
        return {w: m.model for w, m in self.c.pool.members.items() if m.state.value == "serving"}


MODE = "float32/cpu-avx512/kv-float32/weights-auto"


def _net(entries: dict[str, dict], members: int = 2, **over) -> PoolNet:
    c = make_pool_cluster(entries, **over)
    net = PoolNet(c)
    net.join_detok("detok")
    for k in range(members):
        net.add_member(f"m{k}")
    return net


def _serve(net: PoolNet, rid: str, model: str, seed: int = 1) -> None:
    p = net.ask(rid, model, seed=seed)
    net.run(lambda: net.finished(rid))
    toks, _, _, errors = net.got_all(rid)
    assert not errors and toks == reference(p, 4), (errors, toks)


def test_a_request_waits_while_an_idle_member_loads_its_model():
    net = _net({"a": {}, "b": {}})
    p = net.ask("r1", "a")
    card = next(m for m in net.c._models_reply().models if m.id == "a")
    assert card.state == "available" and card.waiting == 1  # queued, its position visible
    net.run(lambda: net.finished("r1"))
    assert net.got_all("r1")[0] == reference(p, 4)
    assert net.loads == [("m1", "a")] and net.holding() == {"m1": "a"}
    assert next(m for m in net.c._models_reply().models if m.id == "a").state == "loaded"


def test_lru_idle_model_is_evicted_never_a_pinned_one():
    net = _net({"pinned": {"pinned": True, "keep_alive_s": FOREVER}, "b": {}, "c": {}, "d": {}})
    net.run(lambda: "pinned" in net.holding().values())  # pinned: loaded while a member is free
    _serve(net, "r-b", "b")
    net.now += 5
    _serve(net, "r-c", "c")  # every member busy holding another model: b (not pinned) goes
    assert ("m0", "b") in net.unloads or ("m1", "b") in net.unloads
    assert sorted(net.holding().values()) == ["c", "pinned"]
    _serve(net, "r-d", "d")
    assert sorted(net.holding().values()) == ["d", "pinned"]
    assert not any(model == "pinned" for _, model in net.unloads)
    assert net.c.pool.evictions["b"] == 1 and net.c.pool.evictions["c"] == 1
    net.c.metrics.refresh(net.c, net.now)  # Prometheus: loads, load seconds, evictions, unloads by why
    text = net.c.metrics.text()
    for line in ('zeroserve:model_loads_total{model_name="b"} 1.0', 'zeroserve:model_load_seconds_total{model_name="b"} 0.5',
                 'zeroserve:model_evictions_total{model_name="c"} 1.0',
                 'zeroserve:model_unloads_total{model_name="b",reason="evicted"} 1.0',
                 'zeroserve:pool_members{state="serving"} 2.0'):
        assert line in text, line
    assert "pinned" not in "".join(x for x in text.splitlines() if x.startswith("zeroserve:model_evictions"))


def test_a_model_with_running_requests_is_not_evicted():
    net = _net({"b": {}, "c": {}, "d": {}})
    _serve(net, "r-b", "b")
    _serve(net, "r-c", "c", seed=2)
    net.ask("long", "b", n=60)  # b runs; c is idle: only c may go for d
    net.turn()
    net.ask("r-d", "d", seed=3)
    net.run(lambda: net.finished("r-d"))
    assert ("b" in net.holding().values()) and not net.finished("long")
    assert [m for _, m in net.unloads] == ["c"]
    net.run(lambda: net.finished("long"))
    assert not net.got_all("long")[3]


def test_a_queued_model_gets_a_free_member_before_an_idle_model_keeps_a_second_copy():
    net = _net({"b": {"max_groups": 2}, "c": {}, "old": {}}, members=3, max_num_seqs=1)
    _serve(net, "r-old", "old", seed=4)  # the least recently used, so LRU alone would evict it
    net.now += 5
    for k in range(3):  # one runs, two queue behind it: b gets a second member
        net.ask(f"b{k}", "b", n=20, seed=10 + k)
    net.run(lambda: sorted(net.holding().values()) == ["b", "b", "old"])
    net.run(lambda: all(net.finished(f"b{k}") for k in range(3)))
    _serve(net, "r-c", "c", seed=5)
    assert [m for _, m in net.unloads] == ["b"], net.unloads  # b's extra copy, not the older "old"
    assert sorted(net.holding().values()) == ["b", "c", "old"]


def test_keep_alive_unloads_idle_models_but_never_pinned_ones():
    net = _net({"p": {"pinned": True, "keep_alive_s": 0.5}, "b": {"keep_alive_s": 2.0}})
    _serve(net, "r-p", "p")
    _serve(net, "r-b", "b")
    assert sorted(net.holding().values()) == ["b", "p"]
    for _ in range(50):  # 0.5 s of idle turns: nothing yet
        net.turn()
    assert sorted(net.holding().values()) == ["b", "p"]
    net.now += 2.0
    net.run(lambda: bool(net.unloads) and all(m.state.value in ("idle", "serving") for m in net.c.pool.members.values()))
    assert [m for _, m in net.unloads] == ["b"] and list(net.holding().values()) == ["p"]
    assert next(m for m in net.c._models_reply().models if m.id == "b").state == "available"


def test_a_failed_load_fails_only_its_model_and_marks_it_failed():
    from zeroserve.common.errors import ModelLoadError

    net = _net({"bad": {}, "good": {}})
    net.broken.add("bad")
    net.ask("x1", "bad")
    net.ask("x2", "bad", seed=2)
    p = net.ask("ok", "good", seed=3)
    net.run(lambda: all(net.finished(r) for r in ("x1", "x2", "ok")))
    for rid in ("x1", "x2"):
        (err,) = net.got_all(rid)[3]
        assert err.code == "model_load" and "truncated weights" in err.message and "'bad'" in err.message
    assert net.got_all("ok")[0] == reference(p, 4)
    card = next(m for m in net.c._models_reply().models if m.id == "bad")
    assert card.state == "failed" and "truncated weights" in card.reason
    with pytest.raises(ModelLoadError, match="failed to load"):
        net.c.on_submit(b"client-1", P.Submit(request_id="x3", prompt_token_ids=np.asarray([5, 6], np.int32),
                                              params=SamplingParams(model="bad")), net.now)
    assert set(net.c.pool.members) == {"m0", "m1"}  # both members still in the pool
    net.c.metrics.refresh(net.c, net.now)
    assert 'zeroserve:model_load_failures_total{model_name="bad"} 1.0' in net.c.metrics.text()
    net.broken.clear()  # fixed: POST /v1/models/load clears the failure and loads it
    net.send(net.c.on_models_control(b"client-1", P.ModelsControl(action="load", model="bad"), net.now))
    net.run(lambda: "bad" in net.holding().values())


def test_a_member_silent_during_its_load_is_dropped_and_the_load_moves():
    net = _net({"a": {}}, members=2)
    net.stopped.add("m1")  # the pool's pick (highest id) never answers its Load
    p = net.ask("r", "a")
    net.turn()
    assert net.c.pool.members["m1"].state.value == "loading"
    net.now += 1.5  # past heartbeat_timeout_s
    net.run(lambda: net.finished("r"))
    assert net.got_all("r")[0] == reference(p, 4)
    assert set(net.c.pool.members) == {"m0"} and net.holding() == {"m0": "a"}


def test_a_requests_keep_alive_holds_for_its_model_as_in_ollama():
    """keep_alive 0.5 s on a request: its model unloads 0.5 s after it is idle, not after the
    catalog's 100 s; a later request's -1 keeps it loaded for good."""
    net = _net({"b": {"keep_alive_s": 100.0}}, members=1)
    p = net.ask("r1", "b")
    net.c.pool.requested("b", None)  # a request without keep_alive changes nothing
    assert net.c.pool.keep_alive_s("b") == 100.0
    net.send(net.c.on_submit(b"client-1", P.Submit(request_id="r2", prompt_token_ids=np.asarray(p, np.int32),
                                                   params=SamplingParams(model="b", max_tokens=2, keep_alive=0.5)),
                             net.now))
    net.run(lambda: net.finished("r1") and net.finished("r2"))
    assert net.c.pool.keep_alive_s("b") == 0.5
    net.now += 0.6
    net.run(lambda: bool(net.unloads) and not net.holding())
    assert net.unloads == [("m0", "b")] and net.c.pool.unloads[("b", "keep_alive")] == 1
    net.send(net.c.on_submit(b"client-1", P.Submit(request_id="r3", prompt_token_ids=np.asarray(p, np.int32),
                                                   params=SamplingParams(model="b", max_tokens=2, keep_alive=-1)),
                             net.now))
    net.run(lambda: net.finished("r3"))
    net.now += 1000
    for _ in range(30):
        net.turn()
    assert net.holding() == {"m0": "b"} and net.c.stats(net.now)["pool"]["models"]["b"]["keep_alive_s"] is None


def test_a_member_that_comes_back_holding_a_model_serves_it_without_a_load():
    """After a scheduler restart a member says HELLO with the model it holds: the pool takes it
    as SERVING and its group serves at once (no Load, no eviction)."""
    net = _net({"a": {}, "b": {}}, members=0)
    net.members["m0"] = FakeWorker("m0")
    net._hello("m0", "a")
    net.workers["g-m0"] = [net.members["m0"]]
    assert net.holding() == {"m0": "a"}
    _serve(net, "r", "a")
    assert net.loads == [] and net.unloads == []


def test_a_load_past_its_timeout_is_unloaded_and_tried_again():
    net = _net({"a": {}}, members=1, model_load_timeout_s=5.0)
    net.slow.add("m0")  # gets the Load, heartbeats, answers nothing
    p = net.ask("r", "a")
    for _ in range(3):
        net.turn()
    assert net.c.pool.members["m0"].state.value == "loading"
    net.now += 6.0
    net.turn()
    assert net.c.pool.members["m0"].state.value == "unloading"
    assert [type(m).__name__ for m in net.backend[b"m0"]] == ["Welcome", "Load", "Unload"]
    net.backend[b"m0"] = [m for m in net.backend[b"m0"] if isinstance(m, P.Unload)]  # the load never finished
    net.slow.clear()
    net.run(lambda: net.finished("r"))
    assert net.got_all("r")[0] == reference(p, 4) and net.c.pool.unloads[("a", "timeout")] == 1
    assert [m for _, m in net.loads] == ["a"] and net.holding() == {"m0": "a"}  # planned again, loaded


def test_a_pool_hello_naming_a_live_workers_id_from_another_connection_is_refused():
    """An empty pool HELLO ends the group of a member that came back without its model; one from
    another connection that names a live worker's id (any group's) is refused and ends nothing."""
    net = _net({"a": {}}, members=1)
    _serve(net, "r", "a")
    g = net.c.groups.group_of("m0")
    net.send(net.c.on_hello(b"rogue", P.Hello(role="worker", worker_id="m0", pool=True), net.now))
    assert net.backend[b"rogue"][-1].status == "refused" and "another connection" in net.backend[b"rogue"][-1].detail
    assert net.c.groups.group_of("m0") is g and g.state.value == "ready" and net.holding() == {"m0": "a"}
    # a worker started with --model (not a pool member): its id is no pool member's to take either
    net.send(net.c.on_hello(b"fixed", P.Hello(role="worker", worker_id="fixed", group="gf", model="a",
                                              num_kv_blocks=64, block_size=16, numeric_mode=MODE), net.now))
    gf = net.c.groups.get("gf")
    net.send(net.c.on_hello(b"rogue2", P.Hello(role="worker", worker_id="fixed", pool=True), net.now))
    assert net.backend[b"rogue2"][-1].status == "refused" and "already connected" in net.backend[b"rogue2"][-1].detail
    assert gf.state.value != "gone" and "fixed" not in net.c.pool.members


def test_a_model_goes_to_a_member_whose_budget_holds_it_or_fails_naming_the_budget():
    from zeroserve.common.errors import ModelLoadError

    net = _net({"big": {"weight_bytes": 5000}, "small": {"weight_bytes": 100}}, members=0)
    for wid, budget in (("m-small", 1000), ("m-zzz", 1000)):
        net.members[wid] = FakeWorker(wid)
        net.send(net.c.on_hello(wid.encode(), P.Hello(role="worker", worker_id=wid, pool=True,
                                                      memory_budget_bytes=budget), net.now))
    p = net.ask("s", "small")
    net.ask("b", "big", seed=2)
    net.run(lambda: net.finished("s") and net.finished("b"))
    assert net.got_all("s")[0] == reference(p, 4)
    (err,) = net.got_all("b")[3]
    assert err.code == "model_load" and "no pool member's --memory-budget" in err.message and "1000" in err.message
    with pytest.raises(ModelLoadError, match="memory-budget"):
        net.c.on_submit(b"client-1", P.Submit(request_id="b2", prompt_token_ids=np.asarray([5, 6], np.int32),
                                              params=SamplingParams(model="big")), net.now)
    net.add_member("m-large")  # no budget: holds anything; POST /v1/models/load tries again
    net.send(net.c.on_models_control(b"client-1", P.ModelsControl(action="load", model="big"), net.now))
    net.run(lambda: "big" in net.holding().values())
    assert net.holding()["m-large"] == "big"


def test_a_member_that_says_goodbye_leaves_the_pool_and_its_model_moves_at_once():
    net = _net({"a": {}}, members=2)
    _serve(net, "r1", "a")
    (holder,) = net.holding()
    net.send(net.c.on_goodbye(holder.encode(), P.Goodbye(worker_id=holder, reason="drained"), net.now))
    net.workers.pop(f"g-{holder}")
    del net.members[holder]
    assert holder not in net.c.pool.members and net.c.groups.group_of(holder) is None
    p = net.ask("r2", "a", seed=2)
    net.run(lambda: net.finished("r2"), turns=60)  # well within the heartbeat timeout
    assert net.got_all("r2")[0] == reference(p, 4) and list(net.holding()) == [w for w in ("m0", "m1") if w != holder]


def test_a_member_loading_a_model_in_another_numeric_mode_fails_that_load_and_stays_in_the_pool():
    net = _net({"a": {}, "b": {}}, members=2)
    _serve(net, "r0", "a")  # m1 loads a: a's numeric mode is fixed
    assert net.c.groups.model_modes["a"] == MODE
    net.send(net.c.on_models_control(b"client-1", P.ModelsControl(action="unload", model="a"), net.now))
    net.run(lambda: not net.holding())
    net.modes["m1"] = "bfloat16/cpu-avx512/kv-float32/weights-auto"  # restarted with --matmul-dtype bfloat16
    net.ask("r1", "a", seed=2)
    net.run(lambda: net.finished("r1"))
    (err,) = net.got_all("r1")[3]
    assert err.code == "model_load" and "numeric mode" in err.message and "'a'" in err.message
    card = next(m for m in net.c._models_reply().models if m.id == "a")
    assert card.state == "failed" and "bfloat16" in card.reason
    net.run(lambda: net.c.pool.members["m1"].state.value == "idle")  # it freed the model it loaded
    assert net.unloads == [("m1", "a")] * 2 and set(net.c.pool.members) == {"m0", "m1"}
    assert net.c.groups.model_modes["a"] == MODE and not net.holding()
    _serve(net, "r2", "b", seed=3)  # the member serves other models
