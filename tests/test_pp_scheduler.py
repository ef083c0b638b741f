"""Several steps in flight per pipeline group, in the scheduler's state (no processes): the
policy (services/scheduler/policy.py) and the groups (services/scheduler/groups.py) around fake
workers (tests/scheduler_sim.py) whose "model" continues a sequence the same way wherever it runs.

- a group of two (three) stages keeps two (three) steps in flight, over disjoint requests in even
  micro-batches, and its tokens are the reference's; a one-stage group (and `pp_steps_in_flight=1`) one;
- preemption never takes a request whose step is in flight, and block accounting stays whole;
- a group that dies with two steps in flight hands each of their requests over exactly once,
  and they finish elsewhere with the reference tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.scheduler_sim import Net, make_cluster, prompt, reference
from zeroserve.common.messages import StepResult
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.services.scheduler.block_manager import BlockManager
from zeroserve.services.scheduler.policy import Scheduler
from zeroserve.services.scheduler.request import Request, Status

N_REQ, MAX_TOKENS = 8, 12


def _watch(net: Net, group: str) -> list[list[str]]:
    """Record, every loop turn, the request ids of each step the group has in flight."""
    seen: list[list[str]] = []
    turn = net.turn

    def watched(**kw):
        turn(**kw)
        g = net.c.groups.get(group)
        if g is not None and len(g.flights) > 1:
            seen.append([f.step.req_ids() for f in g.flights])

    net.turn = watched
    return seen


def _serve(pp: int, **cfg) -> tuple[Net, list[list[list[str]]]]:
    net = Net(make_cluster(**cfg))
    net.answers_per_turn = 1  # a pipeline answers one step per turn: the rest stay in flight
    net.join("g0", pp=pp)
    net.join_detok("d0")
    seen = _watch(net, "g0")
    for i in range(N_REQ):
        net.submit(f"r{i}", prompt(20 + 3 * i, seed=i), MAX_TOKENS)
    net.run(lambda: all(net.done(f"r{i}") for i in range(N_REQ)))
    for i in range(N_REQ):
        toks, _, reasons, errors = net.got(f"r{i}")
        assert not errors and reasons == ["length"]
        assert toks == reference(prompt(20 + 3 * i, seed=i), MAX_TOKENS), f"r{i}"
    return net, seen


@pytest.mark.parametrize("pp", [2, 3])
def test_stages_keep_one_disjoint_even_step_each_in_flight(pp):
    net, seen = _serve(pp=pp)
    g = net.c.groups.get("g0")
    assert g.max_in_flight == pp and g.peak_in_flight == pp
    assert seen, "never several steps in flight"
    for flights in seen:
        ids = [r for f in flights for r in f]
        assert len(ids) == len(set(ids)), f"a request in two steps in flight: {flights}"
    # decoding, the eight requests run as pp micro-batches of sizes differing by at most one
    even = [f for f in seen if len(f) == pp and max(map(len, f)) - min(map(len, f)) <= 1 and sum(map(len, f)) == N_REQ]
    assert even, seen[-5:]
    st = next(x for x in net.c.stats(net.now)["groups"] if x["name"] == "g0")
    assert st["peak_steps_in_flight"] == pp
    assert g.policy.bm.num_used_blocks == 0 and not g.policy.in_flight


def test_one_stage_or_the_knob_keep_one_step_in_flight():
    for pp, cfg in ((1, {}), (2, {"pp_steps_in_flight": 1})):
        net, seen = _serve(pp, **cfg)
        g = net.c.groups.get("g0")
        assert g.max_in_flight == 1 and g.peak_in_flight == 1 and not seen, (pp, cfg)


# ---- the policy alone ---------------------------------------------------------------------------
BS = 16


def _req(rid: str, n: int, base: int) -> Request:
    p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    return Request(rid, list(range(base, base + n)), p, seed=0, max_model_len=1024)


def _answer(s: Scheduler, step, token: int = 7):
    ids = step.req_ids()
    done = [s.requests[r].num_computed_tokens == s.requests[r].num_tokens if r in s.requests else False for r in ids]
    return s.update(step, StepResult(seq=0, req_ids=ids, sampled_token_ids=np.asarray(
        [token if d else -1 for d in done], np.int32)))


def test_preemption_never_takes_a_request_in_flight():
    # 6 blocks of 16: four 24-token requests hold two blocks each once they decode past 32
    s = Scheduler(BlockManager(6, BS, True), 8, 256, 1024, eos_token_ids=[2])
    for i in range(3):
        s.add_request(_req(f"r{i}", 30, 100 * (i + 1)))
    a = s.schedule(parts=2)  # r0, r1
    b = s.schedule(parts=1)  # r2
    assert set(a.req_ids()).isdisjoint(b.req_ids()) and len(a.req_ids()) == 2 and b.req_ids() == ["r2"]
    assert s.in_flight == {"r0", "r1", "r2"}
    assert s.schedule(parts=1).empty  # everyone is in flight: nothing to run
    _answer(s, a)
    # r0 and r1 decode toward block 3 each; the pool runs dry: victims come from r0/r1, never r2
    for _ in range(4):
        c = s.schedule(parts=1)
        assert "r2" not in c.req_ids() and "r2" not in c.finished_req_ids
        assert s.requests["r2"].status == Status.RUNNING
        _answer(s, c)
    assert s.num_preemptions > 0, "the test should force a preemption"
    _answer(s, b)
    used = sum(len(r.block_ids) for r in s.running)
    assert s.bm.num_used_blocks == used, "blocks held must be the running requests' blocks"


def test_a_finish_while_in_flight_frees_the_request_once():
    s = Scheduler(BlockManager(16, BS, True), 8, 256, 1024, eos_token_ids=[2])
    for i in range(2):
        s.add_request(_req(f"r{i}", 20, 100 * (i + 1)))
    a = s.schedule(parts=2)
    s.finish_request(a.req_ids()[0], "abort")  # aborted while its step runs
    assert a.req_ids()[0] not in s.in_flight
    b = s.schedule(parts=1)
    assert a.req_ids()[0] in b.finished_req_ids  # the worker drops it after the step in flight
    _answer(s, a)
    _answer(s, b)
    assert not s.in_flight and s.bm.num_used_blocks == sum(len(r.block_ids) for r in s.running)


# ---- failover with two steps in flight ----------------------------------------------------------
def test_a_group_gone_with_two_steps_in_flight_hands_each_request_over_once():
    net = Net(make_cluster())
    net.answers_per_turn = 1
    net.join("g0", pp=2)
    net.join_detok("d0")
    for i in range(N_REQ):
        net.submit(f"r{i}", prompt(20 + 3 * i, seed=i), MAX_TOKENS)
    g0 = net.c.groups.get("g0")
    net.run(lambda: len(g0.flights) == 2 and g0.steps >= 3)
    held = {r for f in g0.flights for r in f.step.req_ids()}
    assert len(held) == N_REQ, "both micro-batches should be in flight"
    net.join("g1", pp=2)
    net.hung.add("g0")
    net.silent.add("g0")  # stage gone: no heartbeats, no answers
    requeued = net.c.metrics.totals["requeued"]
    net.run(lambda: g0.state.value == "gone")
    # each request lost one group, once: counted once and routed again once
    assert sorted(net.c.groups.failovers.values()) == [1] * N_REQ
    assert net.c.metrics.totals["requeued"] - requeued == N_REQ
    net.run(lambda: all(net.done(f"r{i}") for i in range(N_REQ)))
    for i in range(N_REQ):
        toks, _, reasons, errors = net.got(f"r{i}")
        assert not errors and reasons == ["length"]
        assert toks == reference(prompt(20 + 3 * i, seed=i), MAX_TOKENS), f"r{i}"
    # g1 got each request in full exactly once (with the tokens it had), nothing from g0 twice
    g1_new = sorted(n.req_id for n in net.workers["g1"][-1].seen_new)
    assert len(g1_new) == len(set(g1_new)) == N_REQ, g1_new
