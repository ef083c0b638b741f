"""The scheduler's side of LoRA, on its pure state (tests/scheduler_sim.py's fake peers): adapter
requests go only to groups whose workers announced adapter slots, carry the adapter's directory
in their NewRequest (and again after a failover), never share prefix-cache blocks with the base
model, and a group runs at most its slots' worth of different adapters at once.
"""

from __future__ import annotations

import pytest

from tests.scheduler_sim import Net, group_of, make_cluster, prompt, reference
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


def test_bad_lora_settings_are_named(adapters):
    with pytest.raises(InvalidRequest, match="max_loras_per_batch must be an integer in 1..max_loras"):
        make_cluster(max_loras=2, max_loras_per_batch=3)
    with pytest.raises(InvalidRequest, match="is not NAME=PATH"):
        make_cluster(lora_modules=["just-a-path"])
    with pytest.raises(InvalidRequest, match="rank 4 is above --max-lora-rank 2"):
        make_cluster(lora_modules=[f"x={adapters['x']}"], max_lora_rank=2)
