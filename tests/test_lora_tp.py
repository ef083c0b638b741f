"""LoRA under tensor parallelism: 2 gloo shards with adapters sharded like the base weights
(column-parallel linears keep their rows of B, row-parallel ones their columns of A) give the
tp=1 logits for a batch that mixes two adapters and the base model, through prefill and decode.

The shards run as subprocesses of this file (tests/test_tp.py's run_ranks / rank_cli).
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

from tests.helpers import (  # noqa: E402,F401 (torch_single_thread is a fixture)
    PagedKV,
    cached_model_dir,
    load_our_model,
    random_prompt,
    run_step,
    torch_single_thread,
)
from tests.test_tp import rank_cli, run_ranks  # noqa: E402

TP = 2
pytestmark = pytest.mark.usefixtures("torch_single_thread")


@torch.no_grad()
def scenario(model_dir: str, adapters: dict[str, str], **tp) -> torch.Tensor:
    """Requests a (adapter x), b (base), c (adapter y): prefill, three decodes, a mixed step."""
    from zeroserve.common.model_config import ModelConfig
    from zeroserve.kernels.dispatch import get_ops
    from zeroserve.services.worker.lora import LoRAManager

    cfg, model = load_our_model(model_dir, **tp)
    lora = LoRAManager(model, cfg, get_ops("torch"), 2, 8, "cpu", torch.float32)
    slot = {None: -1, **{name: lora.acquire(name, path) for name, path in adapters.items()}}
    owner = {"a": slot.get("x", -1), "b": -1, "c": slot.get("y", -1)}
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    kv = PagedKV(model, num_blocks=16, block_size=16)

    def step(items, all_rows=False):
        lora.set_batch([owner[rid] for rid, toks in items for _ in toks])
        return run_step(model, kv, items, all_rows=all_rows)

    pa, pb, pc = (random_prompt(n, vocab, seed=s) for n, s in ((19, 1), (7, 2), (5, 3)))
    out = [step([("a", pa), ("b", pb)], all_rows=True)]
    nxt = out[-1][[len(pa) - 1, -1]].argmax(-1).tolist()
    for _ in range(3):
        out.append(step([("a", [nxt[0]]), ("b", [nxt[1]])]))
        nxt = out[-1].argmax(-1).tolist()
    out.append(step([("c", pc), ("a", [nxt[0]])], all_rows=True))
    return torch.cat(out)


def _worker(rank: int, world: int, port: int, payload: dict, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        torch.save(scenario(payload["model"], payload["adapters"], tp_rank=rank, tp_size=world,
                            tp_group=dist.group.WORLD), out_path)
    finally:
        dist.destroy_process_group()


def test_tp2_lora_matches_tp1(tmp_path):
    from tests.lora_ref import make_adapter

    base = cached_model_dir("llama")
    adapters = {"x": str(make_adapter(tmp_path / "x", base, rank=8, seed=11)),
                "y": str(make_adapter(tmp_path / "y", base, rank=4, seed=12, targets=["k_proj", "o_proj", "up_proj",
                                                                                      "down_proj"]))}
    payload = {"model": str(base), "adapters": adapters}
    ref, shards = run_ranks(__file__, TP, payload, tmp_path, lambda: scenario(str(base), adapters), timeout=180)
    no_lora = scenario(str(base), {})
    assert (ref - no_lora).abs().max() > 1e-2  # the adapters change the logits
    for r in range(TP):
        err = (shards[r] - ref).abs().max().item()
        assert err <= 2e-4, f"rank {r}: max |tp2 - tp1| = {err}"
    assert torch.equal(shards[0].argmax(-1), ref.argmax(-1))


if __name__ == "__main__":
    rank_cli(_worker)
