"""Tensor parallelism on CPU: 2 processes over gloo must give the tp=1 logits, and each shard
must hold about half of the model's parameter bytes.

The shards run as subprocesses of this file (`python tests/test_tp.py --rank R ...`): they join
a gloo group on a free loopback port, load their slices from safetensors, run the same steps
(prefill, decode, a mixed batch) and write their logits and parameter sizes to a result file.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import (  # noqa: F401 (torch_single_thread is a fixture)
    PagedKV,
    cached_model_dir,
    load_our_model,
    random_prompt,
    run_step,
    torch_single_thread,
)

TP = 2
CASES = {
    # name -> (arch, config overrides); vocab 515 is not divisible by 2 (padded vocab shards)
    "llama_odd_vocab": ("llama", {"vocab_size": 515}),
    "qwen2_bias": ("qwen2", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
    # dense families: OLMo 2's q/k norm spans all heads (sum of squares all-reduced), Gemma 2's
    # sliding window + soft-caps + sandwich norms, Phi-3's fused checkpoints sliced per rank
    "olmo2": ("olmo2", {}),
    "gemma2": ("gemma2", {}),
    "phi3_fused": ("phi3", {}),
}

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@torch.no_grad()
def run_scenario(model, vocab: int) -> torch.Tensor:
    """Prefill two requests, decode a few steps, then a mixed batch; all logits stacked."""
    kv = PagedKV(model, num_blocks=16, block_size=16)
    pa, pb, pc = random_prompt(19, vocab, seed=1), random_prompt(7, vocab, seed=2), random_prompt(5, vocab, seed=3)
    out = [run_step(model, kv, [("a", pa), ("b", pb)], all_rows=True)]
    nxt = out[-1][[len(pa) - 1, -1]].argmax(-1).tolist()
    for _ in range(3):
        out.append(run_step(model, kv, [("a", [nxt[0]]), ("b", [nxt[1]])]))
        nxt = out[-1].argmax(-1).tolist()
    out.append(run_step(model, kv, [("c", pc), ("a", [nxt[0]])], all_rows=True))
    return torch.cat(out)


def param_bytes(model) -> dict[str, int]:
    sizes = {"norms": 0, "sharded": 0}
    for name, p in model.named_parameters():
        key = "norms" if name.endswith("norm.weight") else "sharded"
        if model.cfg.qk_norm_full and name.endswith(("q_norm.weight", "k_norm.weight")):
            key = "sharded"  # OLMo 2: the norm's weight spans the projection, sliced like it
        sizes[key] += p.numel() * p.element_size()
    return sizes


def run_ranks(script: str, world: int, payload, tmp_path: Path, meanwhile, timeout: float):
    """Run `script` as `world` gloo ranks (`--rank R --world W --port P --payload JSON --out F`,
    see rank_cli), call `meanwhile()` while they work, wait for them (killed on any failure) ->
    (what meanwhile returned, each rank's torch.save'd results)."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = []
    for rank in range(world):
        cmd = [sys.executable, script, "--rank", str(rank), "--world", str(world), "--port", str(port),
               "--payload", json.dumps(payload), "--out", str(tmp_path / f"rank{rank}.pt")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        here = meanwhile()
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed (rc={p.returncode}):\n{out[-4000:]}"
    return here, [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def rank_cli(worker) -> None:
    """A rank's entry point (run_ranks' command line): worker(rank, world, port, payload, out)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--payload", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    worker(a.rank, a.world, a.port, json.loads(a.payload), a.out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, dirs: dict[str, str], out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        results = {}
        for name, d in dirs.items():
            cfg, model = load_our_model(d, tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD)
            assert model.num_kv_heads == cfg.num_kv_heads // world
            results[name] = {"logits": run_scenario(model, cfg.vocab_size), "bytes": param_bytes(model)}
        torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


def test_tp2_matches_tp1(tmp_path):
    dirs = {name: str(cached_model_dir(arch, **ov)) for name, (arch, ov) in CASES.items()}
    # the tp=1 reference runs here while the shards work
    def reference():
        out = {}
        for name, d in dirs.items():
            cfg, model = load_our_model(d)
            out[name] = {"logits": run_scenario(model, cfg.vocab_size), "bytes": param_bytes(model)}
        return out

    ref, shards = run_ranks(__file__, TP, dirs, tmp_path, reference, timeout=180)
    for name in CASES:
        want = ref[name]["logits"]
        for r in range(TP):
            got = shards[r][name]["logits"]
            assert got.shape == want.shape
            err = (got - want).abs().max().item()
            assert err <= 2e-4, f"{name} rank {r}: max |tp2 - tp1| = {err}"
        # same greedy tokens, and every rank sees the full gathered vocab
        assert torch.equal(shards[0][name]["logits"].argmax(-1), want.argmax(-1))
        full = ref[name]["bytes"]
        for r in range(TP):
            part = shards[r][name]["bytes"]
            assert part["norms"] == full["norms"]  # norms are replicated
            assert abs(part["sharded"] * TP - full["sharded"]) <= 0.01 * full["sharded"], (name, part, full)


def test_tp_rank_range_checked():

    from zeroserve.common.model_config import ModelConfig
    from zeroserve.kernels.dispatch import get_ops
    from zeroserve.services.worker.model import build_model

    cfg = ModelConfig.from_dir(cached_model_dir("llama"))
    with pytest.raises(ValueError, match="tp_rank 2 out of range"):
        build_model(cfg, "cpu", torch.float32, get_ops("torch", "cpu"), tp_rank=2, tp_size=2)


if __name__ == "__main__":
    rank_cli(_worker)
