"""A pool member's own side (services/worker/pool.py), without a scheduler: what it reports while
it loads, fails and unloads, what its budget allows, and that a reload keeps the matmul decision
its first load measured (no second probe, the same numerics)."""

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
from zeroserve.kernels import bf16, cpu_native  # noqa: E402
from zeroserve.services.worker import matmul_probe  # noqa: E402
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


def test_a_reload_reuses_the_matmul_decision_of_the_first_load(monkeypatch):
    monkeypatch.setenv("ZEROSERVE_CPU_BF16", "1")
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    probes = []

    def measure(runner):
        probes.append(1)
        return {1: (1.0, 2.0), 8: (1.0, 0.5), 256: (9.0, 3.0)}, {"x_ms": 1.0}

    monkeypatch.setattr(matmul_probe, "measure", measure)
    w, sent = _member(matmul_dtype="auto")
    path = str(cached_model_dir("llama"))
    try:
        for k in range(2):
            w._load(P.Load(load_id=f"l{k}", model="tiny", path=path))
            assert w.runner.matmul_dtype == "bfloat16 from 8 rows" and bf16.min_rows(w.runner.model) == 8
            w._unload()
        assert len(probes) == 1, "the second load probed again"
        assert _phases(sent) == ["loading", "loaded", "unloaded"] * 2
    finally:
        w.ctx.term()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
