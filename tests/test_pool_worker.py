"""A pool member's own side (services/worker/pool.py), without a scheduler: what it reports while
it loads, fails and unloads, what its budget allows, and that every load of a model reports the
numeric mode its flags give (a rule, the same on every load: the scheduler's per-model check)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.common import messages as P  # noqa: E402
from zeroserve.common.config import EngineArgs  # noqa: E402
from zeroserve.services.worker.pool import PoolWorker  # noqa: E402
from tests.helpers import cached_model_dir  # noqa: E402


class Sent:
    """Stands in for the member's channel to the scheduler: keeps what it sends."""

    def __init__(self) -> None:
        self.msgs: list = []

    def send(self, msg) -> None:
        self.msgs.append(msg)


def _member(budget: int = 0, **engine) -> tuple[PoolWorker, Sent]:
    w = PoolWorker(EngineArgs(model=None, num_kv_blocks=engine.pop("num_kv_blocks", 32), **engine),
                   "tcp://127.0.0.1:1", memory_budget_bytes=budget, worker_id="m0")
    w.dealer_ch = Sent()
    return w, w.dealer_ch


def _phases(sent: Sent) -> list[str]:
    return [m.phase for m in sent.msgs if isinstance(m, P.LoadStatus)]


def test_load_reports_and_says_hello_for_the_model_then_unload_empties_it():
    w, sent = _member()
    try:
        h = w._hello()
        assert (h.pool, h.model, h.num_kv_blocks) == (True, "", 0)
        w._load(P.Load(load_id="l1", model="tiny", path=str(cached_model_dir("llama"))))
        assert _phases(sent) == ["loading", "loaded"] and w.runner is not None
        done = sent.msgs[-1]
        assert done.load_id == "l1" and done.memory.param_bytes > 0 and done.memory.kv_bytes > 0
        h = w._hello()
        assert (h.pool, h.model, h.num_kv_blocks, h.group) == (True, "tiny", 32, "g-m0")  # the catalog's name
        w.load_id = "u1"
        w._unload()
        assert _phases(sent)[-1] == "unloaded" and w.runner is None and w._hello().model == ""
    finally:
        w.ctx.term()


def test_a_corrupt_model_or_one_over_the_budget_fails_its_load_and_leaves_the_member_empty(tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(cached_model_dir("llama"), bad)
    for f in bad.glob("*.safetensors"):
        f.write_bytes(b"\x07" * 64)
    w, sent = _member()
    try:
        w._load(P.Load(load_id="l1", model="bad", path=str(bad)))
        assert _phases(sent) == ["loading", "failed"] and w.runner is None and w.model_name == ""
        assert sent.msgs[-1].error
    finally:
        w.ctx.term()
    w, sent = _member(budget=1000, num_kv_blocks=None)
    try:
        w._load(P.Load(load_id="l2", model="tiny", path=str(cached_model_dir("llama"))))
        assert _phases(sent) == ["loading", "failed"] and "--memory-budget is 1000" in sent.msgs[-1].error
    finally:
        w.ctx.term()


def test_every_load_reports_the_numeric_mode_of_the_member_flags():
    w, sent = _member(matmul_dtype="bfloat16")
    path = str(cached_model_dir("llama"))
    try:
        modes = []
        for k in range(2):
            w._load(P.Load(load_id=f"l{k}", model="tiny", path=path))
            h = w._hello()
            assert (h.pool, h.model) == (True, "tiny") and h.numeric_mode == w.runner.numeric_mode
            modes.append(h.numeric_mode)
            w._unload()
            assert w._hello().numeric_mode == ""  # empty: no model, no mode
        assert modes[0].startswith("bfloat16/") and modes[0] == modes[1]
        assert _phases(sent) == ["loading", "loaded", "unloaded"] * 2
    finally:
        w.ctx.term()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
