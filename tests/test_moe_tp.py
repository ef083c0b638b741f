"""MoE over a group of 2 shards (gloo on CPU): tensor parallelism (every expert sliced) and expert
parallelism (each shard holds half of the experts whole) both give the tp=1 logits.

The shards run as subprocesses of this file, like tests/test_tp.py (whose scenario they run:
two prefills, decodes, a mixed batch): each loads its slice, runs the steps, saves its logits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import cached_model_dir, load_our_model, torch_single_thread  # noqa: F401,E402
from tests.test_tp import _free_port, param_bytes, run_scenario  # noqa: E402

TP = 2
CASES = {
    # name -> (arch, expert parallel, GGUF type or None for safetensors)
    "mixtral_tp": ("mixtral", False, None),
    "qwen3moe_tp": ("qwen3moe", False, None),  # a dense layer among the sparse ones
    "olmoe_tp": ("olmoe", False, None),  # whole-projection q/k norms across shards
    "mixtral_ep": ("mixtral", True, None),
    "olmoe_ep": ("olmoe", True, None),
    "mixtral_q8_tp": ("mixtral", False, "Q8_0"),  # packed experts, sliced (block-aligned) per shard
    "qwen3moe_q4_ep": ("qwen3moe", True, "Q4_0"),  # packed experts, half of them per shard
    "mixtral_fused_tp": ("mixtral", False, "fused"),  # 3-D experts.gate_up_proj: rows of each expert
    "olmoe_fused_ep": ("olmoe", True, "fused"),  # 3-D: whole experts of this shard
}

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _worker(rank: int, world: int, port: int, cases: dict, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        results = {}
        for name, (d, ep) in cases.items():
            cfg, model = load_our_model(d, tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD,
                                        expert_parallel=ep)
            moe = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts"))
            results[name] = {"logits": run_scenario(model, cfg.vocab_size), "bytes": param_bytes(model),
                             "packed": moe._stacks is None,
                             "experts": (moe.expert_start, moe.num_local),
                             "w13": tuple(moe.experts[0].gate_up_proj.packed_shape())}
        torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


def test_moe_tp2_and_ep2_match_tp1(tmp_path):
    from tests.gguf_export import export_hf_dir

    from tests.helpers import make_model_dir
    from tests.test_moe import _fuse_experts

    cases = {}
    for name, (arch, ep, qtype) in CASES.items():
        d = cached_model_dir(arch)
        if qtype == "fused":
            d = make_model_dir(tmp_path / name, arch)
            _fuse_experts(d, arch)
        elif qtype is not None:
            d = export_hf_dir(d, tmp_path / f"{name}.gguf", qtype=qtype)
        cases[name] = (str(d), ep)
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = []
    for rank in range(TP):
        cmd = [sys.executable, __file__, "--rank", str(rank), "--world", str(TP), "--port", str(port),
               "--cases", json.dumps(cases), "--out", str(tmp_path / f"rank{rank}.pt")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    ref = {}
    for name, (d, _) in cases.items():
        cfg, model = load_our_model(d)
        ref[name] = {"logits": run_scenario(model, cfg.vocab_size), "bytes": param_bytes(model), "cfg": cfg}
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed (rc={p.returncode}):\n{out[-4000:]}"
    shards = [torch.load(tmp_path / f"rank{r}.pt") for r in range(TP)]
    for name, (_, ep, qtype) in CASES.items():
        want, cfg = ref[name]["logits"], ref[name]["cfg"]
        for r in range(TP):
            got = shards[r][name]
            err = (got["logits"] - want).abs().max().item()
            assert err <= 2e-4, f"{name} rank {r}: max |tp2 - tp1| = {err}"
            e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
            if ep:  # half of the experts, whole
                assert got["experts"] == (r * e // TP, e // TP) and got["w13"] == (2 * i, h)
            else:  # every expert, half of its intermediate rows
                assert got["experts"] == (0, e) and got["w13"] == (2 * i // TP, h)
            assert got["packed"] == (qtype not in (None, "fused"))
            if got["packed"]:
                continue  # packed weights are not parameters: param_bytes does not see them
            full, part = ref[name]["bytes"], got["bytes"]
            # the router is replicated: a few KiB over an exact half
            assert abs(part["sharded"] * TP - full["sharded"]) <= 0.03 * full["sharded"], (name, part, full)
        assert torch.equal(shards[0][name]["logits"].argmax(-1), want.argmax(-1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    _worker(a.rank, a.world, a.port, json.loads(a.cases), a.out)
