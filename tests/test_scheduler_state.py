"""The scheduler's state (services/scheduler/cluster.py, groups.py, delivery.py) without sockets.

Fake messages in, outboxes out, a fake clock (tests/scheduler_sim.py): groups join and probe,
requests are routed and stepped by fake workers, groups die in every way the scheduler
notices, detokenizers rejoin, groups drain, and the clients must get every token exactly once.
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
from zeroserve.common.errors import InvalidRequest, Overloaded  # noqa: E402
from zeroserve.common.sampling_params import SamplingParams  # noqa: E402
from zeroserve.services.scheduler.groups import GroupState  # noqa: E402
from zeroserve.services.scheduler.outbox import Outbox  # noqa: E402
from tests.scheduler_sim import (  # noqa: E402
    CLIENT_ID,
    MODEL,
    VOCAB,
    FakeDetok,
    FakeWorker,
    Net,
    fake_embedding,
    group_of,
    make_cluster,
    prompt,
    reference,
    text_of,
)


# ================================================================== joining


def test_a_group_joins_probes_and_serves_a_request():
    c = make_cluster()
    net = Net(c)
    w = FakeWorker("g0-r0")
    h = P.Hello(role="worker", worker_id="g0-r0", group="g0", model=MODEL, num_kv_blocks=64, block_size=16)
    net.send(c.on_hello(w.ident, h, net.now))
    welcome = net.backend[w.ident][-1]
    assert welcome.status == "accepted" and welcome.group == "g0" and welcome.step_addr == "tcp://sched:7002"
    g = c.groups.get("g0")
    assert g.state == GroupState.PROBING
    net.now += 0.2
    net.send(c.tick(net.now))
    probes = [m for grp, m in net.published if grp == "g0" and isinstance(m, P.Probe)]
    assert len(probes) == 1
    net.send(c.on_probe_ack(w.ident, P.ProbeAck(worker_id="g0-r0", probe_id="not-it"), net.now))
    assert g.state == GroupState.PROBING
    net.send(c.on_probe_ack(w.ident, P.ProbeAck(worker_id="g0-r0", probe_id=probes[0].probe_id), net.now))
    assert g.state == GroupState.READY and g.policy is not None
    net.workers["g0"] = [w]
    net.join_detok("detok-1")

    p = prompt(20, 1)
    net.submit("r1", p, 8)
    assert group_of(c, "r1") == "g0"
    net.run(lambda: net.done("r1"))
    toks, text, reasons, errors = net.got("r1")
    assert toks == reference(p, 8) and text == text_of(toks) and reasons == ["length"] and not errors
    steps = [m for grp, m in net.published if isinstance(m, P.Step)]
    assert [s.seq for s in steps] == list(range(1, len(steps) + 1)) and all(s.group == "g0" for s in steps)
    first = next(m for m in net.clients[CLIENT_ID] if isinstance(m, P.Outputs)).items[0]
    assert first.prompt_token_ids.tolist() == p
    assert not c.live and not c.delivery.seq_index and c.stats(net.now)["requests"] == 0
    assert g.in_flight is None or g.in_flight.step.finished_req_ids  # only the drop of the finished one


def test_a_model_keeps_the_numeric_mode_of_its_first_group():
    """Groups of one model must compute alike (failover exactness): a shard reporting another
    numeric mode is refused with the reason, which `status` lists; the mode stays fixed after
    every group has left."""
    c = make_cluster()
    net = Net(c)
    fp32, bf16 = "float32/cpu-avx512/kv-float32/weights-auto", "bfloat16/cpu-avx512-vdpbf16ps/kv-float32/weights-auto"

    def hello(wid, mode, model=MODEL):
        w = FakeWorker(wid)
        net.send(c.on_hello(w.ident, P.Hello(role="worker", worker_id=wid, group=wid, model=model, num_kv_blocks=64,
                                             block_size=16, numeric_mode=mode), net.now))
        return net.backend[w.ident][-1]

    assert hello("a", fp32).status == "accepted"
    assert hello("b", fp32).status == "accepted"
    refused = hello("c", bf16)
    assert refused.status == "refused" and fp32 in refused.detail and bf16 in refused.detail
    assert hello("d", "").status == "refused"  # a worker that does not say is not assumed alike
    st = c.stats(net.now)
    assert st["numeric_modes"] == {MODEL: fp32}
    assert [r["worker_id"] for r in st["refused"]] == ["c", "d"] and "numeric mode" in st["refused"][0]["reason"]
    assert {g["name"]: g["numeric_mode"] for g in st["groups"]} == {"a": fp32, "b": fp32}
    for wid in ("a", "b"):
        c.groups.gone(c.groups.get(wid), "test", Outbox())
    assert hello("e", bf16).status == "refused"  # still fixed: requests waiting would change tokens


def test_tp_ranks_wait_for_rank_0_and_get_its_dist_address():
    c = make_cluster()
    net = Net(c)
    h1 = P.Hello(role="worker", worker_id="t-r1", group="t", tp_rank=1, tp_size=2, model=MODEL, num_kv_blocks=64,
                 block_size=16)
    net.send(c.on_hello(b"t-r1", h1, net.now))
    assert not net.backend[b"t-r1"], "rank 1 needs rank 0's torch.distributed address first"
    h0 = P.Hello(role="worker", worker_id="t-r0", group="t", tp_rank=0, tp_size=2, model=MODEL, num_kv_blocks=48,
                 block_size=16, dist_init_addr="tcp://r0:29500")
    net.send(c.on_hello(b"t-r0", h0, net.now))
    for ident in (b"t-r0", b"t-r1"):
        (w,) = net.backend[ident]
        assert w.status == "accepted" and w.dist_init_addr == "tcp://r0:29500" and w.group == "t"
    g = c.groups.get("t")
    assert g.state == GroupState.PROBING
    net.now += 0.2
    net.send(c.tick(net.now))
    probe = next(m for _, m in net.published if isinstance(m, P.Probe))
    net.send(c.on_probe_ack(b"t-r0", P.ProbeAck(worker_id="t-r0", probe_id=probe.probe_id), net.now))
    assert g.state == GroupState.PROBING, "every shard must see the topic"
    net.send(c.on_probe_ack(b"t-r1", P.ProbeAck(worker_id="t-r1", probe_id=probe.probe_id), net.now))
    assert g.state == GroupState.READY and g.policy.bm.num_blocks == 48  # the smallest shard's capacity
    net.workers["t"] = [FakeWorker("t-r0"), FakeWorker("t-r1")]
    net.join_detok("d")
    net.submit("r", prompt(10, 2), 4)
    net.turn()
    st = g.in_flight
    with pytest.raises(InvalidRequest, match="only rank 0"):
        c.on_step_result(b"t-r1", P.StepResult(seq=st.seq, worker_id="t-r1"), net.now)
    assert g.in_flight is st


def test_bad_hellos_are_refused_in_words_and_leave_no_group():
    c = make_cluster()
    net = Net(c)
    net.join("g0")

    def hello(ident: bytes, **kw) -> P.Welcome:
        base = {"role": "worker", "worker_id": "w-x", "group": "g9", "model": MODEL, "num_kv_blocks": 64,
                "block_size": 16}
        base.update(kw)
        net.send(c.on_hello(ident, P.Hello(**base), net.now))
        return net.backend[ident][-1]

    w = hello(b"other-conn", worker_id="g0-r0")  # the real worker's id from another connection
    assert w.status == "refused" and "already connected from another connection" in w.detail
    w = hello(b"x1", protocol_version=1)
    assert w.status == "refused" and "protocol version" in w.detail
    w = hello(b"x2", model="some-other-model")
    assert w.status == "refused" and "some-other-model" in w.detail
    w = hello(b"x3", num_kv_blocks=0)
    assert w.status == "refused" and "KV capacity" in w.detail
    w = hello(b"x4", group="g0", worker_id="impostor")  # rank 0 of g0 is taken
    assert w.status == "refused" and "already connected" in w.detail
    w = hello(b"x5", role="detokenizer", protocol_version=3)
    assert w.status == "refused" and "protocol version" in w.detail
    assert sorted(c.groups.groups) == ["g0"] and c.groups.get("g0").state == GroupState.READY
    assert c.delivery.detok is None

    # messages naming g0-r0 from another connection change nothing
    for m in (P.Goodbye(worker_id="g0-r0"), P.Drain(worker_id="g0-r0"), P.WorkerError(worker_id="g0-r0"),
              P.ProbeAck(worker_id="g0-r0", probe_id="x")):
        handler = c.backend_handlers()[type(m)]
        with pytest.raises(InvalidRequest, match="another connection"):
            handler(b"other-conn", m, net.now)
    assert c.groups.get("g0").state == GroupState.READY
    # the heartbeat thread's own connection counts; an unknown worker is told to say HELLO again
    net.send(c.on_heartbeat(b"g0-r0-hb", P.Heartbeat(worker_id="g0-r0"), net.now))
    net.send(c.on_heartbeat(b"ghost", P.Heartbeat(worker_id="ghost"), net.now))
    assert net.backend[b"ghost"][-1].status == "rejoin"
    # a late result from a worker nobody knows: ignored
    assert not net.send(c.on_step_result(b"ghost", P.StepResult(seq=5, worker_id="ghost"), net.now))


def test_a_repeated_hello_while_joining_is_answered_again():
    """A worker whose WELCOME got lost says HELLO again on the same connection: welcomed again."""
    c = make_cluster()
    net = Net(c)
    h = P.Hello(role="worker", worker_id="j-r0", group="j", tp_size=2, model=MODEL, num_kv_blocks=8, block_size=16)
    net.send(c.on_hello(b"conn-1", h, net.now))
    net.send(c.on_hello(b"conn-1", h, net.now + 1))
    assert [w.status for w in net.backend[b"conn-1"]] == ["accepted", "accepted"]
    assert c.groups.shard("j-r0").last_seen == net.now + 1 and c.groups.get("j").state == GroupState.JOINING


# ================================================================== routing


def test_routing_prefers_prefix_hits_then_the_least_loaded():
    c = make_cluster()
    net = Net(c)
    net.join("g0")
    net.join("g1")
    net.join_detok("d")
    a = prompt(40, 3)  # two full blocks and a bit
    net.submit("a", a, 2)
    ga = group_of(c, "a")
    net.run(lambda: net.done("a"))
    gb = "g1" if ga == "g0" else "g0"

    # unrelated requests go to the less loaded group until the prefix's group is the busier one
    k = 0
    while c.groups.get(ga).load() <= c.groups.get(gb).load():
        before = {n: c.groups.get(n).load() for n in (ga, gb)}
        net.submit(f"u{k}", prompt(20, 100 + k), 50)
        assert group_of(c, f"u{k}") == min(before, key=lambda n: (before[n], n != ga)), before
        k += 1
    follower = a[:32] + prompt(7, 50)
    assert c.groups.get(ga).policy.bm.num_cached_prefix_tokens(follower) == 32
    net.submit("f", follower, 2)
    assert group_of(c, "f") == ga, "a prefix hit wins over a lighter load"
    net.submit("v", prompt(20, 60), 2)
    assert group_of(c, "v") == gb, "without a hit the least loaded group wins"
    net.run(lambda: all(net.done(r) for r in ("f", "v", *(f"u{i}" for i in range(k)))))
    assert net.got("f")[0] == reference(follower, 2)
    assert c.groups.get(ga).policy.bm.hits >= 32


def test_requests_wait_for_a_group_then_time_out_without_one():
    c = make_cluster()
    net = Net(c, dt=0.5)
    net.join_detok("d")
    net.submit("early", prompt(8, 4), 3)
    assert c.pending and group_of(c, "early") is None
    net.turn()
    net.join("g0")  # the pending request moves to the new group
    assert not c.pending and group_of(c, "early") == "g0"
    net.run(lambda: net.done("early"))
    assert net.got("early")[0] == reference(prompt(8, 4), 3)

    c2 = make_cluster()
    net2 = Net(c2, dt=0.5)
    net2.submit("lonely", prompt(8, 5), 3)
    net2.run(lambda: net2.done("lonely"), turns=20)
    (err,) = net2.got("lonely")[3]
    assert err.code == "timeout" and "no worker serving model" in err.message and not c2.live


# ================================================================== failover


def _failover(kill: str):
    """Two groups; r runs on one, which dies mid-stream in the way `kill` says."""
    c = make_cluster()
    net = Net(c, dt=0.05)
    net.join("g0")
    net.join("g1")
    net.join_detok("d")
    p = prompt(30, 7)
    net.submit("r", p, 24)
    dead = group_of(c, "r")
    alive = "g1" if dead == "g0" else "g0"
    net.run(lambda: len(net.got("r")[0]) >= 5)
    (w,) = net.workers[dead]
    if kill == "goodbye":
        net.send(c.on_goodbye(w.ident, P.Goodbye(worker_id=w.worker_id, reason="missed step 9"), net.now))
    elif kill == "worker_error":
        net.send(c.on_worker_error(w.ident, P.WorkerError(worker_id=w.worker_id, message="CUDA error"), net.now))
    elif kill == "heartbeat":
        net.silent.add(dead)
        net.hung.add(dead)
    elif kill == "hung_step":
        net.hung.add(dead)  # heartbeats go on: only the step timeout notices
    net.run(lambda: c.groups.get(dead).state == GroupState.GONE, turns=100)
    assert any(g == dead and isinstance(m, P.Shutdown) for g, m in net.published)
    assert group_of(c, "r") == alive
    net.hung.discard(dead)
    stale = net.steps.pop(dead, [])
    for st in stale:  # a late answer from the group we gave up on changes nothing
        assert not net.send(c.on_step_result(w.ident, w.run(st), net.now))
    del net.workers[dead]
    net.run(lambda: net.done("r"))
    toks, text, reasons, errors = net.got("r")
    assert toks == reference(p, 24), "tokens lost or repeated across the failover"
    assert text == text_of(toks) and reasons == ["length"] and not errors
    moved = next(n for n in net.workers[alive][0].seen_new if n.req_id == "0#0")
    kept = moved.token_ids.tolist()[len(p):]
    assert moved.num_prompt_tokens == len(p) and kept == toks[:len(kept)] and len(kept) >= 5, "tokens kept"
    return c, net


@pytest.mark.parametrize("kill", ["goodbye", "worker_error", "heartbeat", "hung_step"])
def test_a_dead_groups_requests_move_with_their_tokens(kill):
    c, net = _failover(kill)
    assert not c.live and sorted(g.name for g in c.groups.values() if g.state != GroupState.GONE) == \
        sorted(net.workers)


def test_a_reconnecting_worker_ends_its_old_group():
    c = make_cluster()
    net = Net(c)
    (w,) = net.join("g0")
    net.join("g1")
    net.join_detok("d")
    p = prompt(12, 8)
    net.submit("r", p, 10)
    net.run(lambda: len(net.got("r")[0]) >= 3)
    assert group_of(c, "r") == "g0"  # equal groups: the first one wins the tie
    h = P.Hello(role="worker", worker_id="g0-r0", group="g0", model=MODEL, num_kv_blocks=64, block_size=16)
    net.send(c.on_hello(w.ident, h, net.now))  # it restarted: same id, same connection identity
    assert c.groups.get("g0").state == GroupState.PROBING and group_of(c, "r") == "g1"
    del net.workers["g0"]
    net.steps.pop("g0", None)
    net.run(lambda: net.done("r"))
    assert net.got("r")[0] == reference(p, 10)


# ================================================================== detokenizer


def test_detokenizer_rejoin_replays_live_sequences():
    c = make_cluster()
    net = Net(c)
    net.join("g0")
    d1 = net.join_detok("detok-a")
    p = prompt(16, 9)
    net.submit("r", p, 20)
    net.run(lambda: len(net.got("r")[0]) >= 4)
    for _ in range(3):  # detok-a goes quiet: tokens pile up, one batch unanswered
        net.turn(detok=False)
    assert c.delivery.detok_inflight
    delivered, text, _, _ = net.got("r")
    net.now += 0.5  # silent past the "alive" window (half the heartbeat timeout): a successor gets in
    d2 = net.join_detok("detok-b")
    net.send(c.flush())
    _welcome, replay, rest = net.backend[d2.ident]
    (new,) = replay.items
    assert new.req_id == "0#0" and new.output_token_ids.tolist() == delivered
    assert new.text_offset == len(text) and new.prompt_token_ids.tolist() == p
    assert rest.req_ids == ["0#0"] and rest.token_ids.tolist() == reference(p, 20)[len(delivered):len(delivered) + len(rest.token_ids)]
    assert len(rest.token_ids) > 0, "the tokens sent to the old detokenizer and never answered follow at once"
    # the old detokenizer's late answer is not taken
    late = [m for m in net.backend[d1.ident] if isinstance(m, P.DetokTokens)]
    out = d1.handle(late[0])
    with pytest.raises(InvalidRequest, match="not the detokenizer"):
        c.on_detok_outputs(d1.ident, out, net.now)
    net.run(lambda: net.done("r"))
    toks, text, reasons, _ = net.got("r")
    assert toks == reference(p, 20) and text == text_of(toks) and reasons == ["length"]
    assert c.stats(net.now)["detokenizer"] == {"connected": True, "worker_id": "detok-b"}


def test_a_second_detokenizer_does_not_take_over_a_live_one():
    c = make_cluster()
    net = Net(c)
    net.join("g0")
    d1 = net.join_detok("detok-a")
    net.submit("r", prompt(8, 3), 12)
    net.turn()
    intruder = FakeDetok("detok-x")
    net.send(c.on_hello(intruder.ident, P.Hello(role="detokenizer", worker_id="detok-x"), net.now))
    assert not net.backend[intruder.ident]  # no answer: it says HELLO again, and waits
    assert c.delivery.detok.worker_id == "detok-a"
    net.run(lambda: net.done("r"))  # every token still goes through detok-a
    assert net.got("r")[0] == reference(prompt(8, 3), 12) and net.detok is d1
    assert not any(isinstance(m, P.DetokNew) for m in net.backend[intruder.ident])
    # the live one goes silent (died): the waiting one is welcomed at the next tick, no new HELLO needed
    net.now += 0.6
    net.send(c.tick(net.now + 0.6))
    assert net.backend[intruder.ident][-1].status == "accepted" and c.delivery.detok.worker_id == "detok-x"


def test_detokenizer_silence_and_goodbye_leave_streams_waiting():
    c = make_cluster()
    net = Net(c, dt=0.3)
    net.join("g0")
    d = net.join_detok("d")
    net.submit("r", prompt(8, 10), 30)
    net.turn()
    for _ in range(5):
        net.turn(detok=False)  # the detokenizer sends nothing: after heartbeat_timeout it is given up
    assert c.delivery.detok is None
    net.join_detok("d2")
    net.run(lambda: net.done("r"))
    assert net.got("r")[0] == reference(prompt(8, 10), 30)
    net.send(c.on_goodbye(b"d2", P.Goodbye(worker_id="d2"), net.now))
    assert c.delivery.detok is None and d.worker_id == "d"


def test_an_unsent_detok_batch_goes_out_again():
    c = make_cluster()
    net = Net(c)
    (w,) = net.join("g0")
    net.join_detok("d")
    p = prompt(8, 11)
    net.submit("r", p, 12)
    net.run(lambda: len(net.got("r")[0]) >= 2)
    (st,) = net.steps.pop("g0")  # a result arrives, then sending its tokens fails: the shell calls on_fail
    net.send(c.on_step_result(w.ident, w.run(st), net.now))
    ob = c.flush()
    (unsent,) = ob.of(P.DetokTokens)
    assert unsent.msg.seq in c.delivery.detok_inflight
    for it in ob:
        it.on_fail()
    assert unsent.msg.seq not in c.delivery.detok_inflight and c.delivery.detok_tokens["0#0"].count == 1
    net.run(lambda: net.done("r"))
    assert net.got("r")[0] == reference(p, 12) and net.got("r")[1] == text_of(reference(p, 12))


def test_a_stop_string_ends_the_sequence_in_its_group():
    c = make_cluster()
    net = Net(c)
    (w,) = net.join("g0")
    net.join_detok("d", stop_after={"0#0": 5})
    p = prompt(10, 12)
    net.submit("r", p, 40)
    net.run(lambda: net.done("r"))
    toks, text, reasons, _ = net.got("r")
    # the output ends on the token that completed the stop string, however many tokens the
    # detokenizer got in that batch
    assert reasons == ["stop"] and toks == reference(p, 40)[:5] and text == text_of(toks)
    final = [o for m in net.clients[CLIENT_ID] if isinstance(m, P.Outputs) for o in m.items if o.finish_reason]
    assert final[0].stop_reason == "STOP"
    assert not c.groups.get("g0").policy.requests
    net.run(lambda: "0#0" in w.finished)  # the worker is told to drop it


# ================================================================== drain


def test_a_draining_group_takes_nothing_new_finishes_then_is_told_drained():
    c = make_cluster()
    net = Net(c)
    (w0,) = net.join("g0")
    (w1,) = net.join("g1")
    net.join_detok("d")
    p1 = prompt(10, 13)
    net.submit("r1", p1, 8)
    assert group_of(c, "r1") == "g0"
    net.turn()
    net.send(c.on_drain(w0.ident, P.Drain(worker_id="g0-r0"), net.now))
    assert c.groups.get("g0").state == GroupState.DRAINING
    net.submit("r2", prompt(10, 14), 4)
    assert group_of(c, "r2") == "g1"
    net.run(lambda: net.done("r1") and net.done("r2"))
    net.run(lambda: c.groups.get("g0").state == GroupState.GONE)
    assert [m.status for m in net.backend[w0.ident]][-1] == "drained"
    assert net.got("r1")[0] == reference(p1, 8)
    assert not any(n.req_id == "0#0" for n in w1.seen_new), "r1 finished where it ran"
    assert [g for g, m in net.published if isinstance(m, P.Shutdown)] == ["g0"]


def test_a_drain_that_overruns_moves_the_rest_elsewhere():
    c = make_cluster(drain_timeout_s=1.0)
    net = Net(c, dt=0.05)
    (w0,) = net.join("g0")
    net.join("g1")
    net.join_detok("d")
    p = prompt(10, 15)
    net.submit("long", p, 200)
    assert group_of(c, "long") == "g0"
    net.run(lambda: len(net.got("long")[0]) >= 3)
    net.send(c.on_drain(w0.ident, P.Drain(worker_id="g0-r0"), net.now))
    net.run(lambda: c.groups.get("g0").state == GroupState.GONE, turns=60)
    assert net.backend[w0.ident][-1].status == "drained" and group_of(c, "long") == "g1"
    del net.workers["g0"]
    net.steps.pop("g0", None)
    net.run(lambda: net.done("long"), turns=600)
    assert net.got("long")[0] == reference(p, 200)


# ================================================================== clients


def test_deadlines_silent_clients_and_aborts():
    c = make_cluster(client_timeout_s=2.0)
    net = Net(c, dt=0.25)
    net.join("g0")
    net.join_detok("d")
    net.hung.add("g0")  # nothing finishes
    net.submit("t", prompt(8, 16), 50, timeout_s=0.5)
    net.submit("q", prompt(8, 17), 50, client=b"quiet-client")
    net.submit("a", prompt(8, 18), 50)
    net.send(c.on_abort(CLIENT_ID, P.Abort(request_id="a"), net.now))
    net.send(c.flush())
    _, _, reasons, _ = net.got("a")
    assert reasons == ["abort"]
    free = [m for m in net.backend[b"d"] if isinstance(m, P.DetokFree)]
    assert free and free[0].req_ids == ["2#0"]
    for _ in range(12):
        net.send(c.on_ping(CLIENT_ID, P.Ping(nonce=1), net.now))  # client-1 stays alive; quiet-client does not
        net.turn()
    (err,) = net.got("t")[3]
    assert err.code == "timeout" and net.got("t")[2] == ["abort"]
    assert net.got("q", client=b"quiet-client")[2] == ["abort"]
    pol = c.groups.get("g0").policy  # None once the hung group is given up (its tables go with it)
    assert not c.live and (pol is None or not pol.requests)


def test_client_requests_are_checked_before_anything_is_kept():
    c = make_cluster(max_queue_len=1)
    net = Net(c)
    with pytest.raises(InvalidRequest, match="not served"):
        c.on_submit(CLIENT_ID, P.Submit(request_id="x", prompt_token_ids=np.asarray([5], np.int32),
                                        params=SamplingParams(model="nope")), net.now)
    net.submit("bad", [5, VOCAB + 3], 4)
    assert str(VOCAB) in net.got("bad")[3][0].message
    net.submit("one", [5, 6], 4)
    with pytest.raises(InvalidRequest, match="already running"):
        net.submit("one", [5, 6], 4)
    with pytest.raises(Overloaded):
        net.submit("two", [5, 6], 4)
    (models,) = [m.msg for m in c.on_models_request(CLIENT_ID, P.ModelsRequest(), net.now)]
    assert models.models[0].id == MODEL and models.models[0].groups == 0


def test_text_prompts_go_to_the_tokenizer_pool():
    c = make_cluster()
    ob = c.on_submit(CLIENT_ID, P.Submit(request_id="t", prompt="hello there"), 100.0)
    (job,) = ob.tokenize
    assert (job.model, job.text) == (MODEL, "hello there") and not ob.items
    ob = c.on_tokenized(job.key, None, RuntimeError("boom"), 100.0)
    (item,) = ob.items
    assert item.msg.request_id == "t" and "could not be tokenized" in item.msg.message and not c.live
    assert not c.on_tokenized(job.key, [1, 2], None, 100.0)  # aborted meanwhile: nothing


# ================================================================== the shell's send rule


def test_a_peer_that_refuses_one_message_gets_none_of_the_rest():
    from zeroserve.services.scheduler.service import SchedulerService

    class FakeChannel:
        def __init__(self, refuse: set[bytes]) -> None:
            self.refuse, self.sent = refuse, []

        def try_send(self, msg, to) -> bool:
            if to in self.refuse:
                return False
            self.sent.append((to, type(msg).__name__))
            return True

        send = try_send

    svc = SchedulerService.__new__(SchedulerService)
    svc.term = 1  # stamped into what it sends (common/failover.py)
    svc.client_ch, svc.backend_ch = FakeChannel(set()), FakeChannel({b"full"})
    svc.steps_ch, svc.events_ch = FakeChannel(set()), FakeChannel(set())
    failed = []
    ob = Outbox()
    ob.to_backend(b"full", P.DetokNew(), on_fail=lambda: failed.append("new"))
    ob.to_backend(b"ok", P.DetokFree())
    ob.to_backend(b"full", P.DetokFree(), on_fail=lambda: failed.append("tokens"))
    ob.to_client(b"full", P.Pong(nonce=1))  # another socket: not the same peer
    ob.publish("g0", P.Probe(probe_id="p"))
    svc._send(ob)
    assert failed == ["new", "tokens"]
    assert svc.backend_ch.sent == [(b"ok", "DetokFree")] and svc.client_ch.sent == [(b"full", "Pong")]
    assert svc.steps_ch.sent == [(b"g0\x00", "Probe")]


# ================================================================== embeddings


def test_an_embedding_is_a_prefill_that_frees_its_blocks_without_the_detokenizer():
    c = make_cluster(max_num_batched_tokens=16)
    net = Net(c)
    (w,) = net.join("g0")
    d = net.join_detok("detok-1")
    p = prompt(40, 3)
    net.submit("e1", p, 8, kind="embed", pooling="mean")
    net.submit("e2", p, 8, kind="embed")  # the model's pooling: last (no sentence-transformers config)
    net.submit("r1", prompt(20, 1), 4)
    net.run(lambda: all(net.done(r) for r in ("e1", "e2", "r1")))
    outs = {o.request_id: o for m in net.clients[CLIENT_ID] if isinstance(m, P.Outputs) for o in m.items
            if o.embedding is not None}
    np.testing.assert_array_equal(outs["e1"].embedding, fake_embedding(p, "mean"))
    np.testing.assert_array_equal(outs["e2"].embedding, fake_embedding(p, "last"))
    for rid in ("e1", "e2"):
        toks, text, reasons, errors = net.got(rid)
        assert toks == [] and text == "" and reasons == ["stop"] and not errors
        assert outs[rid].prompt_token_ids.tolist() == p
    assert net.got("r1")[0] == reference(prompt(20, 1), 4)  # a generation beside them is untouched
    # prefill only, in chunks of the budget, never from the prefix cache (e2 repeats e1's prompt)
    assert sorted(str(n.pooling) for n in w.seen_new) == ["None", "last", "mean"]
    assert all(n.num_computed_tokens == 0 for n in w.seen_new)
    gen = [n.req_id for n in w.seen_new if n.pooling is None]
    assert [n.req_id for n in d.new] == gen  # the detokenizer saw only the generation
    net.run(lambda: c.groups.get("g0").policy.bm.num_used_blocks == 0)
    assert not c.live and not w.reqs


def test_embeddings_in_a_step_result_are_checked():
    c = make_cluster()
    net = Net(c)
    (w,) = net.join("g0")
    net.join_detok("detok-1")
    net.submit("r1", prompt(10, 2), 4)
    run = w.run

    def lying(step):  # an embedding for a generation request: the group is not trusted again
        out = run(step)
        out.embed_req_ids, out.embeddings = out.req_ids[:1], np.zeros((1, 64), np.float32)
        return out

    w.run = lying
    net.turn()
    net.turn()
    assert c.groups.get("g0") is None or c.groups.get("g0").state == GroupState.GONE
    with pytest.raises(ValueError, match="embedding request takes a prompt"):  # checked where it is built
        P.Submit(request_id="x", messages=[P.ChatMessage(role="user", content="hi")], kind="embed")
