"""The GPU benchmark script's CPU-side path (arg parsing, shapes, twins, interpreter checks)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "bench_kernels.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_parse_args_defaults():
    bk = _load()
    args = bk.parse_args(["--device", "cuda", "--ctx", "1024,4096", "--bandwidth-gbs", "3350"])
    assert args.ctx_list == [1024, 4096] and args.bandwidth_gbs == 3350 and not args.dry_run
    shapes = bk.setup_shapes(args)
    assert shapes["hq"] == 32 and shapes["hk"] == 8 and shapes["d"] == 128
    assert shapes["model"].hidden == 4096 and shapes["model"].vocab == 128256
    # 8B Llama 3: 8.03e9 parameters, minus the 0.53e9 embedding table (a decode step reads only
    # B rows of it) -> ~15 GB of bf16 weights read per decode step
    assert 14.5e9 < shapes["model"].weight_bytes(2) < 15.5e9
    assert bk.parse_args(["--dry-run"]).device == "cpu"


def test_dry_run_end_to_end(capsys):
    bk = _load()
    assert bk.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.count("PASS") >= 8
    assert "decode step" in out and "RESULT: PASS" in out


def test_dry_run_composed_model(capsys):
    bk = _load()
    assert bk.main(["--dry-run", "--skip-checks", "--skip-attention", "--model-impl",
                    "composed"]) == 0
    assert "composed model" in capsys.readouterr().out


def test_composed_step_shapes():
    import torch

    from zeroserve.kernels import torch_ops

    bk = _load()
    ms = bk.ModelShape(hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=48,
                       vocab=50, rope_theta=10000.0)
    m = bk.ComposedLlama(ms, torch_ops, "cpu", torch.float32, max_pos=64)
    _, kc, _, meta = bk.paged_batch([5, 9], [5, 2], 1, 1, 16, 16, torch.float32, "cpu")
    kv = [(torch.zeros_like(kc), torch.zeros_like(kc))]
    h = m(torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([0, 1, 2, 3, 4, 7, 8]), kv, meta)
    assert h.shape == (7, 32) and torch.isfinite(m.compute_logits(h)).all()
