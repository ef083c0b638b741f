"""The scheduler's side of LoRA, on its pure state (tests/scheduler_sim.py's fake peers): adapter
requests go only to groups whose workers announced adapter slots, carry the adapter's directory
in their NewRequest (and again after a failover or a scheduler restart), never share
prefix-cache blocks with the base model (kept KV adopted after a restart included), and a group
runs at most its slots' worth of different adapters at once.
"""

from __future__ import annotations

import pytest

import numpy as np

from tests.scheduler_sim import CLIENT_ID, Net, group_of, make_cluster, prompt, reference
from zeroserve.common import messages as P
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.services.worker.lora import write_random_adapter


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    cfg = next(iter(make_cluster().models.values())).cfg
    root = tmp_path_factory.mktemp("sched-loras")
    return {n: write_random_adapter(root / n, cfg, 4, seed=i) for i, n in enumerate(("x", "y", "z"))}


def _cluster(adapters, **over):
    c = make_cluster(enable_lora=True, lora_modules=[f"{n}={p}" for n, p in adapters.items()], **over)
    net = Net(c)
    net.join_detok("d")
    return c, net


def test_adapter_requests_route_to_groups_with_slots_and_keep_their_adapter(adapters):
    c, net = _cluster(adapters)
    net.join("lora", max_loras=2)
    p = prompt(40, 1)
    net.submit("base", p, 4)  # the base model's blocks of p, cached in group "lora"
    net.run(lambda: net.done("base"))
    net.join("plain")  # no --enable-lora: max_loras 0 in its HELLO, the lighter group now
    for i in range(2):
        net.submit(f"x{i}", p, 4, lora="x")
        assert group_of(c, f"x{i}") == "lora"
        net.run(lambda: net.done(f"x{i}"))
        assert net.got(f"x{i}")[0] == reference(p, 4)
    new = [n for n in net.workers["lora"][0].seen_new if n.params.lora == "x"]
    assert [n.lora_path for n in new] == [adapters["x"]] * 2
    # the first found none of the base model's blocks, the second its own predecessor's
    assert [n.num_computed_tokens for n in new] == [0, 32]
    assert not any(n.params.lora for n in net.workers["plain"][0].seen_new)
    with pytest.raises(InvalidRequest, match="'nope' is not served"):
        c.on_submit(b"cl", P.Submit(request_id="bad", prompt_token_ids=p,
                                    params=SamplingParams(max_tokens=2, lora="nope")), net.now)


def test_a_group_runs_at_most_its_slots_of_adapters(adapters):
    c, net = _cluster(adapters)
    net.join("lora", max_loras=2)
    for name in ("x", "y", "z"):
        net.submit(name, prompt(8, ord(name)), 6, lora=name)
    seen: list[set] = []
    orig = net.workers["lora"][0].run

    def run(step: P.Step) -> P.StepResult:
        w = net.workers["lora"][0]
        out = orig(step)
        running = {n.params.lora for n in w.seen_new if n.req_id in w.reqs}
        seen.append(running)
        return out

    net.workers["lora"][0].run = run
    net.run(lambda: all(net.done(n) for n in ("x", "y", "z")))
    assert max(len(s) for s in seen) == 2 and all(net.got(n)[0] == reference(prompt(8, ord(n)), 6)
                                                   for n in ("x", "y", "z"))


def test_a_reattached_adapter_request_keeps_its_adapter_and_its_kept_kv(adapters):
    """The scheduler restarts mid-request: the client's Reattach resolves the adapter again (its
    NewRequest carries the adapter's directory), and the KV the worker kept under that adapter
    (KeptSeq.lora_path) is reused by it and never by a base-model request with the same tokens."""
    p = prompt(37, 5)
    c, net = _cluster(adapters)
    net.join("lora", max_loras=2)
    net.submit("k", p, 40, lora="x")
    net.run(lambda: len(net.got("k")[0]) >= 20)
    toks, text, _, _ = net.got("k")
    first = next(m for m in net.clients[CLIENT_ID] if isinstance(m, P.Outputs)).items[0]
    seq = p + toks
    full = len(seq) // 16
    kept = P.KeptSeq(token_ids=np.asarray(seq[:full * 16], np.int32), block_ids=np.arange(3, 3 + full),
                     lora_path=adapters["x"])
    c2, net2 = _cluster(adapters)  # the restarted scheduler; the worker's cache holds blocks 3.. for "k"
    net2.join("lora", max_loras=2, kept=[kept])
    net2.submit("b", seq[:full * 16] + [7], 1)  # the same tokens on the base model: none of those blocks
    net2.run(lambda: net2.done("b"))
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, lora="x")
    net2.send(c2.on_reattach(CLIENT_ID, P.Reattach(
        submit=P.Submit(request_id="k~1", params=sp, prompt_token_ids=np.asarray(p, np.int32)),
        prompt_token_ids=first.prompt_token_ids, seed=first.seed,
        seqs=[P.ResumeSeq(index=0, token_ids=np.asarray(toks, np.int32), chars=len(text))]), net2.now))
    net2.run(lambda: net2.done("k~1"))
    more, _, reasons, errors = net2.got("k~1")
    assert not errors and toks + more == reference(p, 40)
    w = net2.workers["lora"][0]
    base_new = next(n for n in w.seen_new if n.params.lora is None)
    assert base_new.num_computed_tokens == 0 and not set(base_new.block_ids.tolist()) & set(range(3, 3 + full))
    new = next(n for n in w.seen_new if n.params.lora == "x")
    assert new.lora_path == adapters["x"]
    assert new.num_computed_tokens == full * 16, "the blocks kept under the adapter were not computed again"
    assert new.block_ids.tolist()[:full] == list(range(3, 3 + full))


def test_bad_lora_settings_are_named(adapters):
    with pytest.raises(InvalidRequest, match="max_loras_per_batch must be an integer in 1..max_loras"):
        make_cluster(max_loras=2, max_loras_per_batch=3)
    with pytest.raises(InvalidRequest, match="is not NAME=PATH"):
        make_cluster(lora_modules=["just-a-path"])
    with pytest.raises(InvalidRequest, match="rank 4 is above --max-lora-rank 2"):
        make_cluster(lora_modules=[f"x={adapters['x']}"], max_lora_rank=2)
