"""common/config.py: knobs defined once, and the flags, environment variables and child argv
generated from them.

* every flag and ZEROSERVE_* variable the docs and compose files use still exists, per command;
* an environment variable is a flag's default, the flag wins, a bad value names the variable;
* bools (`--no-prefix-caching`), repeatable flags (`--model`), flag names that differ from the
  field (`--heartbeat-timeout` -> heartbeat_timeout_s);
* `to_cli_args` -> parse -> `from_cli_args` gives the same config back, and `zeroserve up`'s
  children get exactly up's settings even when their environment says otherwise;
* the config module and the detokenizer start without torch.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from zeroserve.common.config import (
    WORKER_ENGINE_KNOBS,
    DetokenizerArgs,
    EngineArgs,
    SchedulerConfig,
    WorkerArgs,
    from_cli_args,
    knobs,
    to_cli_args,
)
from zeroserve.services.cli import build_parser

REPO = Path(__file__).resolve().parents[1]

# the flags of each command before the configs generated them (README, compose, tests use them)
LEGACY_FLAGS = {
    "up": "--model --host --port --workers --tp --demo --dtype --device --attention-backend --block-size "
          "--num-kv-blocks --kv-cache-memory-bytes --gpu-memory-utilization --max-model-len --threads --max-num-seqs "
          "--max-num-batched-tokens --max-queue-len --no-prefix-caching --heartbeat-timeout --step-timeout "
          "--client-timeout --drain-timeout --curve-keys",
    "scheduler": "--host --port --model --advertise-host --max-model-len --max-num-seqs --max-num-batched-tokens "
                 "--max-queue-len --no-prefix-caching --heartbeat-timeout --step-timeout --client-timeout "
                 "--drain-timeout --curve-keys",
    "worker": "--scheduler --model --group --tp-size --tp-rank --worker-id --dist-init-addr --advertise-host --dtype "
              "--device --attention-backend --block-size --num-kv-blocks --kv-cache-memory-bytes "
              "--gpu-memory-utilization --max-model-len --threads --curve-keys --curve-client",
    "detokenizer": "--scheduler --model --worker-id --curve-keys --curve-client",
    "status": "--address --json --timeout --curve-keys --curve-client",
    "generate": "--address --max-tokens --temperature --seed --stream --timeout --curve-keys --curve-client",
    "batch": "--model --max-tokens --temperature --seed --no-progress --dtype --device --attention-backend "
             "--block-size --num-kv-blocks --kv-cache-memory-bytes --gpu-memory-utilization --max-model-len --threads",
}
LEGACY_ENV = {
    "scheduler": "HOST PORT MODEL ADVERTISE_HOST MAX_NUM_SEQS MAX_NUM_BATCHED_TOKENS MAX_QUEUE_LEN NO_PREFIX_CACHING "
                 "CURVE_KEYS",
    "worker": "SCHEDULER MODEL GROUP TP_SIZE TP_RANK DEVICE ADVERTISE_HOST DTYPE BLOCK_SIZE KV_CACHE_MEMORY_BYTES "
              "GPU_MEMORY_UTILIZATION THREADS CURVE_KEYS CURVE_CLIENT",
    "detokenizer": "SCHEDULER MODEL CURVE_KEYS CURVE_CLIENT",
    "status": "ADDRESS CURVE_KEYS CURVE_CLIENT",
}


def _subparser(cmd: str):
    ap = build_parser()
    sub = next(a for a in ap._actions if a.dest == "cmd")
    return sub.choices[cmd]


@pytest.mark.parametrize("cmd", sorted(LEGACY_FLAGS))
def test_every_flag_of_before_is_there(cmd):
    flags = {s for a in _subparser(cmd)._actions for s in a.option_strings}
    missing = set(LEGACY_FLAGS[cmd].split()) - flags
    assert not missing, f"zeroserve {cmd} lost {sorted(missing)}"


@pytest.mark.parametrize("cmd", sorted(LEGACY_ENV))
def test_every_environment_variable_of_before_is_read(cmd):
    text = _subparser(cmd).format_help().replace("\n", " ").replace("  ", " ")
    for name in LEGACY_ENV[cmd].split():
        assert f"ZEROSERVE_{name}" in text.replace(" ", ""), f"zeroserve {cmd} does not read ZEROSERVE_{name}"


def test_flags_and_variables_are_unique_per_config():
    for cls in (EngineArgs, SchedulerConfig, WorkerArgs, DetokenizerArgs):
        ks = knobs(cls)
        assert len({k.flag for k in ks}) == len(ks), cls
        assert all(k.help for k in ks), cls


def test_environment_is_the_default_and_a_flag_wins(monkeypatch):
    monkeypatch.setenv("ZEROSERVE_MAX_NUM_SEQS", "64")
    monkeypatch.setenv("ZEROSERVE_HEARTBEAT_TIMEOUT", "2.5")
    monkeypatch.setenv("ZEROSERVE_NO_PREFIX_CACHING", "1")
    monkeypatch.setenv("ZEROSERVE_MODEL", "/a,/b")
    cfg = from_cli_args(SchedulerConfig, build_parser().parse_args(["scheduler"]))
    assert (cfg.max_num_seqs, cfg.heartbeat_timeout_s, cfg.enable_prefix_caching, cfg.models) == \
        (64, 2.5, False, ["/a", "/b"])
    ns = build_parser().parse_args(["scheduler", "--max-num-seqs", "8", "--model", "/c", "--model", "/d"])
    cfg = from_cli_args(SchedulerConfig, ns)
    assert cfg.max_num_seqs == 8 and cfg.models == ["/c", "/d"]
    # the names the scheduler's main reads today
    assert ns.no_prefix_caching is True and ns.heartbeat_timeout == 2.5 and ns.model == ["/c", "/d"]
    monkeypatch.setenv("ZEROSERVE_NO_PREFIX_CACHING", "0")
    assert from_cli_args(SchedulerConfig, build_parser().parse_args(["scheduler"])).enable_prefix_caching


def test_a_bad_environment_value_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("ZEROSERVE_BLOCK_SIZE", "sixteen")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker"])
    assert "$ZEROSERVE_BLOCK_SIZE" in capsys.readouterr().err
    monkeypatch.delenv("ZEROSERVE_BLOCK_SIZE")
    from zeroserve.services.cli import main

    assert main(["batch", "-", "--block-size", "17"]) == 2  # the engine args refuse it, in words
    assert "block_size must be a multiple of 16" in capsys.readouterr().err


def _roundtrip(cmd: str, obj, only=None, skip=()):
    return from_cli_args(type(obj), build_parser().parse_args([cmd, *to_cli_args(obj, only=only, skip=skip)]))


def test_to_cli_args_roundtrips():
    cfg = SchedulerConfig(host="0.0.0.0", port=9000, advertise_host="sched", models=["/m1", "/m2"], max_num_seqs=7,
                          max_model_len=512, enable_prefix_caching=False, heartbeat_timeout_s=1.5, curve_keys="/k")
    assert _roundtrip("scheduler", cfg) == cfg
    w = WorkerArgs(scheduler="tcp://h:1", group="g", tp_rank=1, worker_id="g-r1", threads=2, curve_client="w9",
                   heartbeat_interval_s=0.5, advertise_host="me", dist_init_addr="tcp://me:5")
    assert _roundtrip("worker", w) == w
    d = DetokenizerArgs(scheduler="tcp://h:1", models=["/m"], worker_id="d")
    assert _roundtrip("detokenizer", d) == d
    e = EngineArgs(model="/m", dtype="bfloat16", device="cuda:1", attention_backend="torch", block_size=32,
                   num_kv_blocks=9, gpu_memory_utilization=0.5, tp_size=2, max_model_len=100)
    got = from_cli_args(EngineArgs, build_parser().parse_args(["worker", *to_cli_args(e, only=WORKER_ENGINE_KNOBS)]))
    assert got == e


def test_up_children_get_ups_settings_whatever_their_environment(monkeypatch):
    from zeroserve.services.launcher import plan_children

    up = build_parser().parse_args(["up", "--workers", "2", "--tp", "2", "--max-num-seqs", "5", "--no-prefix-caching",
                                    "--num-kv-blocks", "33", "--max-model-len", "300", "--step-timeout", "9",
                                    "--threads", "1", "--block-size", "32", "--port", "7100"])
    children = plan_children(up, "/m")
    assert [c.name for c in children] == ["scheduler", "detokenizer", "worker g0 rank 0", "worker g0 rank 1",
                                          "worker g1 rank 0", "worker g1 rank 1"]
    # a child's environment says otherwise; its argv wins
    for var, val in (("MAX_NUM_SEQS", "99"), ("NUM_KV_BLOCKS", "1"), ("BLOCK_SIZE", "64"), ("TP_SIZE", "1"),
                     ("STEP_TIMEOUT", "1"), ("SCHEDULER", "tcp://elsewhere:1"), ("MODEL", "/other")):
        monkeypatch.setenv(f"ZEROSERVE_{var}", val)
    sched = from_cli_args(SchedulerConfig, build_parser().parse_args(children[0].argv[3:]))
    assert (sched.port, sched.models, sched.max_num_seqs, sched.enable_prefix_caching, sched.max_model_len,
            sched.step_timeout_s) == (7100, ["/m"], 5, False, 300, 9.0)
    detok = from_cli_args(DetokenizerArgs, build_parser().parse_args(children[1].argv[3:]))
    assert detok.scheduler == "tcp://127.0.0.1:7101" and detok.models == ["/m"]
    for i, c in enumerate(children[2:]):
        ns = build_parser().parse_args(c.argv[3:])
        w, e = from_cli_args(WorkerArgs, ns), from_cli_args(EngineArgs, ns)
        assert (w.scheduler, w.group, w.tp_rank, w.worker_id, w.threads) == \
            ("tcp://127.0.0.1:7101", f"g{i // 2}", i % 2, f"g{i // 2}-r{i % 2}", 1)
        assert (e.model, e.tp_size, e.num_kv_blocks, e.block_size, e.max_model_len) == ("/m", 2, 33, 32, 300)


def test_scheduler_config_matches_the_schedulers_own():
    """Until services/scheduler/service.py imports SchedulerConfig from zeroserve.common.config, both exist:
    they must have the same fields and defaults."""
    from zeroserve.services.scheduler import service

    if service.SchedulerConfig is SchedulerConfig:
        return
    ours = {f.name: f for f in dataclasses.fields(SchedulerConfig)}
    theirs = {f.name: f for f in dataclasses.fields(service.SchedulerConfig)}
    assert set(ours) == set(theirs)
    assert SchedulerConfig().__dict__ == {k: getattr(service.SchedulerConfig(), k) for k in ours}


@pytest.mark.parametrize("module", ["zeroserve.common.config", "zeroserve.services.cli", "zeroserve.services.backend_peer",
                                    "zeroserve.services.detokenizer.service"])
def test_starts_without_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {module} pulls in {out.stdout.strip()}"


def test_up_passes_the_gateway_its_nice_value():
    from zeroserve.common.config import GatewayArgs
    from zeroserve.services.launcher import plan_children

    up = build_parser().parse_args(["up", "--gateway-nice", "4", "--gateway-port", "8100"])
    gw = plan_children(up, "/m", gateway=True)[-1]
    assert gw.role == "gateway"
    got = from_cli_args(GatewayArgs, build_parser().parse_args(gw.argv[3:]))
    assert (got.nice, got.port) == (4, 8100)
    assert from_cli_args(GatewayArgs, build_parser().parse_args(
        plan_children(build_parser().parse_args(["up"]), "/m", gateway=True)[-1].argv[3:])).nice == 0


def test_up_with_a_catalog_starts_pool_workers(tmp_path):
    """`up --models-dir DIR`: the scheduler and the detokenizer get the catalog and no --model,
    every worker is a pool member (--pool, no model, no group); --model or --tp with it is refused."""
    from zeroserve.common.errors import InvalidRequest
    from zeroserve.services.launcher import main as up_main
    from zeroserve.services.launcher import plan_children

    up = build_parser().parse_args(["up", "--workers", "2", "--models-dir", str(tmp_path), "--keep-alive", "30s"])
    children = plan_children(up, "")
    sched = from_cli_args(SchedulerConfig, build_parser().parse_args(children[0].argv[3:]))
    assert (sched.models, sched.models_dir, sched.keep_alive) == ([], str(tmp_path.resolve()), "30s")
    detok = from_cli_args(DetokenizerArgs, build_parser().parse_args(children[1].argv[3:]))
    assert (detok.models, detok.models_dir) == ([], str(tmp_path.resolve()))
    for i, c in enumerate(children[2:]):
        ns = build_parser().parse_args(c.argv[3:])
        w, e = from_cli_args(WorkerArgs, ns), from_cli_args(EngineArgs, ns)
        assert (w.pool, w.group, w.worker_id, e.model) == (True, None, f"g{i}-r0", None)
    from zeroserve.common.config import GatewayArgs

    gw = plan_children(up, "", gateway=True)[-1]
    got = from_cli_args(GatewayArgs, build_parser().parse_args(gw.argv[3:]))
    assert (got.models, got.models_dir) == ([], str(tmp_path.resolve()))  # its tokenizers: the catalog's
    for extra in (["--model", str(tmp_path)], ["--tp", "2"]):
        with pytest.raises(InvalidRequest, match="pool members"):
            up_main(build_parser().parse_args(["up", "--models-dir", str(tmp_path), *extra]))


def test_up_gives_the_lora_flags_to_the_scheduler_and_every_worker():
    from zeroserve.services.launcher import plan_children

    up = build_parser().parse_args(["up", "--tp", "2", "--lora-modules", "sql=/a/sql", "--lora-modules", "chat=/a/c",
                                    "--max-loras", "3", "--max-lora-rank", "32"])
    children = plan_children(up, "/m")
    sched = from_cli_args(SchedulerConfig, build_parser().parse_args(children[0].argv[3:]))
    assert (sched.lora_modules, sched.max_loras, sched.max_lora_rank) == (["sql=/a/sql", "chat=/a/c"], 3, 32)
    for c in children[2:]:
        e = from_cli_args(EngineArgs, build_parser().parse_args(c.argv[3:]))
        assert e.lora_enabled and (e.max_loras, e.max_lora_rank) == (3, 32)
