"""MoE over a group of 2 shards (gloo on CPU): tensor parallelism (every expert sliced) and expert
parallelism (each shard holds half of the experts whole) both give the tp=1 logits.

The shards run as subprocesses of this file, like tests/test_tp.py (whose scenario they run:
two prefills, decodes, a mixed batch): each loads its slice, runs the steps, saves its logits.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import cached_model_dir, load_our_model, torch_single_thread  # noqa: F401,E402
from tests.test_tp import param_bytes, rank_cli, run_ranks, run_scenario  # noqa: E402

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
    def reference():
        out = {}
        for name, (d, _) in cases.items():
            cfg, model = load_our_model(d)
            out[name] = {"logits": run_scenario(model, cfg.vocab_size), "bytes": param_bytes(model), "cfg": cfg}
        return out

    ref, shards = run_ranks(__file__, TP, cases, tmp_path, reference, timeout=300)
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
    rank_cli(_worker)
