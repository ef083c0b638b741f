"""A cluster over several hosts, the hosts being network namespaces (tests/netns.py), CURVE on.

    sched   10.N.0.2  scheduler (bound to 0.0.0.0, advertising 10.N.0.2) + detokenizer
    tpa     10.N.0.3  group "gtp" rank 0 (--advertise-host 10.N.0.3)
    tpb     10.N.0.4  group "gtp" rank 1 (no --advertise-host: the route to rank 0 decides)
    edge    10.N.0.5  group "g1": a worker host added by hand, with its own CURVE worker key
    client  10.N.0.6  the client (tests/netns_client.py)

Every host's name resolves to 127.0.1.1 there, so a tensor-parallel group whose shards let gloo
bind by host name never forms (issue 24 item 7); the worker binds its collectives to the
interface that carries its address. Checked: the greedy tokens equal the in-process engine's
(a single-host run); with "edge" cut off (its bridge port down) requests the scheduler still
routes there finish on "gtp" with the same tokens; after the link heals, "edge" rejoins and
its worker says the scheduler gave its group up, not that it restarted (item 8).
A second test puts the two pipeline stages of one group on hosts of their own (sched, ppa, ppb,
client): their greedy tokens equal the single-host run's.
Skips where namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import no_leftover_processes  # noqa: F401,E402 (fixture)
from tests.helpers import cached_model_dir, random_prompt  # noqa: E402
from tests.netns import NetnsHosts  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

HOSTS = ["sched", "tpa", "tpb", "edge", "client"]
PORT = 7100  # a fixed port is free: every host has its own network namespace
MAX_TOKENS = 16
HEARTBEAT_TIMEOUT_S = 3


def _client(hosts: NetnsHosts, keys: Path, name: str, wait_s: float, **spec) -> dict:
    """Run tests/netns_client.py on the client host; returns what it wrote."""
    p = hosts.start("client", name, ["tests.netns_client", _spec(hosts, keys, name, spec)])
    try:
        rc = p.wait(timeout=wait_s)
    except Exception:
        p.kill()
        raise AssertionError(f"client {name} did not finish in {wait_s}s\n{hosts.logs()}") from None
    assert rc == 0, f"client {name} exited {rc}\n{hosts.logs()}"
    return json.loads((hosts.logdir / f"{name}.json").read_text())


def _worker(hosts: NetnsHosts, host: str, name: str, model: str, keys: Path, key_name: str, *extra: str) -> None:
    hosts.start(host, name, ["zeroserve.services.cli", "worker", "--scheduler", f"tcp://{hosts.addr('sched')}:{PORT + 1}",
                             "--model", model, "--worker-id", name, "--num-kv-blocks", "128", "--threads", "1",
                             "--curve-keys", str(keys), "--curve-client", key_name, *extra])


def _scheduler_host(hosts: NetnsHosts, model: str, keys: Path) -> None:
    """The scheduler (all interfaces, advertising its address) and the detokenizer on "sched"."""
    sched = hosts.addr("sched")
    hosts.start("sched", "scheduler", [
        "zeroserve.services.cli", "scheduler", "--host", "0.0.0.0", "--advertise-host", sched, "--port", str(PORT),
        "--model", model, "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--curve-keys", str(keys)])
    hosts.start("sched", "detokenizer", ["zeroserve.services.cli", "detokenizer", "--scheduler", f"tcp://{sched}:{PORT + 1}",
                                         "--model", model, "--curve-keys", str(keys)])


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> dict:
    """The single-host run: the in-process engine's greedy tokens."""
    from zeroserve import LLM, SamplingParams

    prompts = [random_prompt(n, 512, seed=300 + i) for i, n in enumerate((5, 19, 33, 40, 8, 27))]
    llm = LLM(str(model_dir), num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return {"prompts": prompts, "tokens": [list(map(int, o.outputs[0].token_ids)) for o in outs]}


def test_tp_across_hosts_partition_failover_and_rejoin(model_dir, reference, tmp_path):
    from zeroserve.common.curve import create_curve_keys

    keys = tmp_path / "keys"  # one directory stands in for the files copied to each host
    create_curve_keys(keys, workers=["tp", "edge"])
    model = str(model_dir)
    with NetnsHosts(HOSTS) as hosts:
        _scheduler_host(hosts, model, keys)
        tp = ("--group", "gtp", "--tp-size", "2")
        _worker(hosts, "tpa", "gtp-r0", model, keys, "tp", *tp, "--tp-rank", "0", "--advertise-host", hosts.addr("tpa"))
        _worker(hosts, "tpb", "gtp-r1", model, keys, "tp", *tp, "--tp-rank", "1")
        _worker(hosts, "edge", "g1-r0", model, keys, "edge", "--group", "g1")
        _client(hosts, keys, "ready", 90, mode="ready", groups=2, timeout=80)

        # item 7: each shard bound its collectives to its own host's eth0, not to what its name resolves to
        for name, why in (("gtp-r0", "advertised address"), ("gtp-r1", "route to the rendezvous")):
            line = next(ln for ln in hosts.log(name).splitlines() if "collectives bound" in ln)
            assert "ifname=eth0" in line and why in line, line

        got = _client(hosts, keys, "generate", 60, mode="generate", prompts=reference["prompts"])
        assert got["tokens"] == reference["tokens"]

        # partition "edge": the scheduler routes to it until the heartbeat timeout, then moves the requests
        spec = {"armed": str(hosts.logdir / "armed"), "go": str(hosts.logdir / "go")}
        part = hosts.start("client", "partition", ["tests.netns_client", _spec(hosts, keys, "partition", {
            "mode": "partition", "prompts": reference["prompts"], "watch": "g1", "timeout": 60, **spec})])
        _wait_file(hosts, spec["armed"], 30)
        hosts.link_down("edge")
        Path(spec["go"]).touch()
        hosts.wait_log("scheduler", "group gone", timeout=HEARTBEAT_TIMEOUT_S + 15)
        hosts.link_up("edge")
        try:
            assert part.wait(timeout=60) == 0, hosts.logs()
        except Exception:
            part.kill()
            raise
        res = json.loads((hosts.logdir / "partition.json").read_text())
        assert res["tokens"] == reference["tokens"]  # the requests cut off with "edge" finished on "gtp"
        assert res["requeued"] >= 1, res
        assert res["ready"] == ["g1", "gtp"]
        edge = hosts.wait_log("g1-r0", "joining again", timeout=10)
        # which side notices first depends on timing: the worker's own view after the heal ("gave our
        # group up (it did not restart)") or the scheduler's end-of-group message reaching it once the
        # link is back; either way it must not blame a scheduler restart (issue 24 item 8)
        assert ("gave our group up (it did not restart)" in edge or "the scheduler ended our group" in edge), edge
        assert "restarted;" not in edge, edge
        assert "restarted?" not in edge


def test_pp_stages_on_two_hosts(model_dir, reference, tmp_path):
    """A group of two pipeline stages, each on its own host with its own CURVE worker key: stage 0
    advertises its address (it proposes the rendezvous), stage 1 does not (the route to stage 0
    decides where its collectives and its stage link listen). Greedy tokens equal the
    single-host run's; each stage bound its collectives (and so its stage link) to its own eth0."""
    from zeroserve.common.curve import create_curve_keys

    keys = tmp_path / "keys"
    create_curve_keys(keys, workers=["stage0", "stage1"])
    model = str(model_dir)
    with NetnsHosts(["sched", "ppa", "ppb", "client"]) as hosts:
        _scheduler_host(hosts, model, keys)
        pp = ("--group", "gpp", "--pp-size", "2")
        _worker(hosts, "ppa", "gpp-s0", model, keys, "stage0", *pp, "--pp-rank", "0", "--advertise-host", hosts.addr("ppa"))
        _worker(hosts, "ppb", "gpp-s1", model, keys, "stage1", *pp, "--pp-rank", "1")
        ready = _client(hosts, keys, "ready", 90, mode="ready", groups=1, timeout=80)
        g = next(g for g in ready["stats"]["groups"] if g["name"] == "gpp")
        assert g["pp_size"] == 2 and [(w["worker_id"], w["stage"]) for w in g["workers"]] == [("gpp-s0", 0), ("gpp-s1", 1)]
        for name in ("gpp-s0", "gpp-s1"):
            line = next(ln for ln in hosts.log(name).splitlines() if "collectives bound" in ln)
            assert "ifname=eth0" in line, line
        got = _client(hosts, keys, "generate", 60, mode="generate", prompts=reference["prompts"])
        assert got["tokens"] == reference["tokens"]


def _spec(hosts: NetnsHosts, keys: Path, name: str, spec: dict) -> str:
    path = hosts.logdir / f"{name}.spec.json"
    path.write_text(json.dumps({"address": f"tcp://{hosts.addr('sched')}:{PORT}", "curve_keys": str(keys),
                                "out": str(hosts.logdir / f"{name}.json"), "max_tokens": MAX_TOKENS, **spec}))
    return str(path)


def _wait_file(hosts: NetnsHosts, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        assert time.monotonic() < deadline, f"{path} never appeared\n{hosts.logs()}"
        time.sleep(0.02)


def test_without_root_or_ip_the_test_skips_saying_why(monkeypatch):
    from tests import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "need root" in netns.why_not()
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda _: None)
    assert "no `ip` command" in netns.why_not()
