"""Bounds at the scheduler's edges, on its state alone (fake messages, fake clock): a failover
cap per request, plausible KV capacities, the text-size cap, nonsense step results evicted."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.common import messages as P
from zeroserve.common.errors import InvalidRequest
from zeroserve.services.scheduler.admission import MAX_PROMPT_TEXT_BYTES, split_prompt
from zeroserve.services.scheduler.groups import GroupState
from tests.scheduler_sim import CLIENT_ID, MODEL, Net, group_of, make_cluster, prompt


def _hello(c, net, ident: bytes, **kw) -> P.Welcome:
    base = {"role": "worker", "worker_id": ident.decode(), "group": ident.decode(), "model": MODEL,
            "num_kv_blocks": 64, "block_size": 16}
    base.update(kw)
    net.send(c.on_hello(ident, P.Hello(**base), net.now))
    return net.backend[ident][-1]


def test_implausible_capacities_are_refused_with_a_reason():
    c = make_cluster(max_kv_blocks=1 << 62)  # the byte bound, not the count (below)
    net = Net(c)
    w = _hello(c, net, b"a", block_size=24)
    assert w.status == "refused" and "block_size 24" in w.detail
    mc = c.models[MODEL].cfg
    per_block = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 256
    w = _hello(c, net, b"b", num_kv_blocks=(64 << 40) // per_block + 1, block_size=256)
    assert w.status == "refused" and "TiB" in w.detail
    w = _hello(c, net, b"c", max_model_len=10**9)
    assert w.status == "refused" and "max_position_embeddings" in w.detail
    assert not c.groups.groups


def test_joining_groups_are_bounded():
    from zeroserve.services.scheduler import groups as G

    c = make_cluster()
    net = Net(c)
    for i in range(G.MAX_JOINING_GROUPS):
        assert _hello(c, net, f"j{i}".encode(), tp_size=2).status == "accepted"
    w = _hello(c, net, b"one-too-many", tp_size=2)
    assert w.status == "refused" and "waiting for their tensor-parallel shards" in w.detail


def test_text_prompts_are_capped_before_tokenizing():
    with pytest.raises(InvalidRequest, match="limit is 8388608 bytes"):
        split_prompt("é" * (MAX_PROMPT_TEXT_BYTES // 2 + 1))
    assert split_prompt("x" * 1000)[0]
    c = make_cluster()
    with pytest.raises(InvalidRequest, match="limit"):
        c.on_submit(CLIENT_ID, P.Submit(request_id="big", prompt="x" * (MAX_PROMPT_TEXT_BYTES + 1)), 0.0)
    with pytest.raises(InvalidRequest, match="conversation"):
        c.on_submit(CLIENT_ID, P.Submit(request_id="big", messages=[P.ChatMessage(
            role="user", content="x" * (MAX_PROMPT_TEXT_BYTES + 1))]), 0.0)
    assert not c.live


@pytest.mark.parametrize("bad", ["id_out_of_vocab", "wrong_order", "missing_sample"])
def test_a_nonsense_step_result_evicts_the_group_and_its_request_moves(bad):
    c = make_cluster()
    net = Net(c)
    net.join("g0")
    net.join("g1")
    net.join_detok("d")
    net.submit("r", prompt(20, 3), 6)
    net.submit("s", prompt(20, 4), 6)
    net.turn()
    g = c.groups.get(group_of(c, "r"))
    st = g.in_flight.step
    ids = st.req_ids()
    tok = np.full(len(ids), 5, np.int32)
    if bad == "id_out_of_vocab":
        tok[0] = 999999
    elif bad == "wrong_order":
        ids = ids[::-1] + ["ghost"]
        tok = np.full(len(ids), 5, np.int32)
    else:
        tok[0] = -1
    net.hung.add(g.name)
    net.send(c.on_step_result(g.shards[0].identity, P.StepResult(seq=st.seq, worker_id=g.shards[0].hello.worker_id,
                                                                 req_ids=ids, sampled_token_ids=tok), net.now))
    assert g.state == GroupState.GONE
    assert group_of(c, "r") not in (None, g.name)
    assert c.groups.failovers


def test_a_request_that_keeps_killing_groups_ends_after_max_failovers():
    c = make_cluster()
    net = Net(c)
    net.join_detok("d")
    net.submit("r", prompt(10, 1), 4)
    errors = []
    for i in range(c.cfg.max_failovers + 1):
        (w,) = net.join(f"g{i}")
        net.turn()
        g = c.groups.get(f"g{i}")
        assert group_of(c, "r") == g.name, i
        net.send(c.on_worker_error(w.ident, P.WorkerError(worker_id=w.worker_id, message="segfault"), net.now))
        errors = [m for m in net.clients[CLIENT_ID] if isinstance(m, P.Error)]
        del net.workers[f"g{i}"]
    assert len(errors) == 1 and "max-failovers" in errors[0].message and errors[0].request_id == "r"
    assert not c.live and not c.groups.failovers


def test_a_huge_kv_claim_costs_the_scheduler_little_and_is_released_when_the_group_leaves():
    """A worker may announce millions of blocks: the scheduler's tables follow what is used (a
    3,000,000-block claim took ~500 MB of lists before), and go with the group."""
    import gc
    import weakref

    import psutil

    proc = psutil.Process()
    c = make_cluster(max_kv_blocks=4_000_000)
    net = Net(c)
    net.join_detok("d")
    gc.collect()
    before = proc.memory_info().rss
    (w,) = net.join("big", blocks=3_000_000)
    net.submit("r", prompt(40, 5), 8)
    net.run(lambda: net.done("r"))
    grown = proc.memory_info().rss - before
    assert grown < 50 << 20, f"the claim cost {grown >> 20} MiB"
    g = c.groups.get("big")
    assert g.policy.bm.num_free_blocks == 3_000_000  # the request gave its blocks back
    bm = weakref.ref(g.policy.bm)
    net.send(c.on_goodbye(w.ident, P.Goodbye(worker_id=w.worker_id, reason="bye"), net.now))
    assert g.state == GroupState.GONE and g.policy is None
    gc.collect()
    assert bm() is None, "a gone group's block tables stayed alive"


def test_a_claim_above_max_kv_blocks_is_refused_with_the_knob_named():
    c = make_cluster()
    assert c.cfg.max_kv_blocks == 1 << 20
    net = Net(c)
    w = _hello(c, net, b"greedy", num_kv_blocks=3_000_000)
    assert w.status == "refused" and "--max-kv-blocks 1048576" in w.detail and "--num-kv-blocks" in w.detail
    assert _hello(c, net, b"fits", num_kv_blocks=1 << 20).status == "accepted"


@pytest.mark.parametrize("addr", ["tcp://:7001", "tcp://host", "tcp://*:7001", "tcp://h:0", "tcp://h:x1",
                                  "udp://h:7001", "h:7001", "tcp://[]:7001"])
def test_a_malformed_scheduler_address_is_refused_at_the_boundary(addr):
    from zeroserve.common.config import WorkerArgs, check_connect_address

    with pytest.raises(InvalidRequest, match="expected tcp://HOST:PORT"):
        WorkerArgs(scheduler=addr)
    for ok in ("tcp://10.0.0.5:7001", "tcp://sched.example:7001", "tcp://[::1]:7001", "tcp://0.0.0.0:7001",
               "ipc:///tmp/zs"):
        assert check_connect_address(ok, "--scheduler") == ok


def test_worker_with_an_empty_host_exits_with_the_reason_instead_of_saying_hello_forever():
    import subprocess

    r = subprocess.run([sys.executable, "-m", "zeroserve.services.cli", "worker", "--scheduler", "tcp://:7001"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--scheduler 'tcp://:7001': no host" in r.stderr
