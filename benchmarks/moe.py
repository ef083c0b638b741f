"""MoE decode step time: against a dense model with the same active parameters, and as the expert
count grows at a fixed top-2.

Models are built in memory with random weights (zeroserve.services.worker.model.build_model; no files):
Mixtral layout, hidden 512, 4 layers, 8 heads (4 KV heads, head_dim 64), vocab 8192, each
expert's MLP width --expert-inter (512). The dense twin has the same attention and an MLP of
width top_k * expert_inter, so a token multiplies the same number of weights in both (the
router's E x H is the only extra). fp32, the `cpu` op set, one decode token per request with
--context tokens already in the paged cache (random new tokens each step: new routes); the best
of --rounds interleaved rounds of the median over --steps steps.

    .venv/bin/python benchmarks/moe.py                  # ~1-2 min on 2 busy cores
    .venv/bin/python benchmarks/moe.py --experts 4 8 16 32 64 --batches 1 8 --json
    .venv/bin/python benchmarks/moe.py --quantization int8 --batches 1

Goals (issue 22): MoE / dense <= 1.5x at batch 1; step time nearly flat from 4 to 64 experts at
batch 1 (a decode token uses top_k experts per layer whatever E is). At larger batches more
distinct experts are active, so the step grows with E until every expert is busy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

import torch  # noqa: E402

from benchmarks.common import environment, json_line, loadavg, log, print_table  # noqa: E402


def _config(num_experts: int, top_k: int, expert_inter: int, layers: int):
    from zeroserve.common.model_config import ModelConfig

    hf = {"hidden_size": 512, "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 64, "vocab_size": 8192, "max_position_embeddings": 4096}
    if num_experts:
        hf.update(architectures=["MixtralForCausalLM"], intermediate_size=expert_inter,
                  num_local_experts=num_experts, num_experts_per_tok=top_k)
    else:  # dense twin: the active MLP width of the MoE model
        hf.update(architectures=["LlamaForCausalLM"], intermediate_size=top_k * expert_inter)
    return ModelConfig.from_hf_dict(hf)


def _decode_meta(batch: int, context: int, block_size: int):
    from zeroserve.kernels.metadata import AttentionMetadata

    per = -(-(context + 1) // block_size)
    tables = torch.arange(batch * per, dtype=torch.int32).view(batch, per)
    pos = torch.full((batch,), context, dtype=torch.int64)
    slots = tables[:, context // block_size].to(torch.int64) * block_size + context % block_size
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                             seq_lens=torch.full((batch,), context + 1, dtype=torch.int32),
                             query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
                             max_query_len=1, max_seq_len=context + 1)
    return pos, meta, batch * per


class _Bench:
    """One model with its decode batch and caches, timed in rounds (see main)."""

    def __init__(self, cfg, batch: int, context: int, backend: str, seed: int = 0, quantization: str = "none"):
        from zeroserve.kernels.dispatch import get_ops
        from zeroserve.services.worker.model import build_model

        self.cfg, self.batch = cfg, batch
        self.model = build_model(cfg, "cpu", torch.float32, get_ops(backend), init="random", seed=seed)
        if quantization != "none":  # as a load with --quantization int8|int4 packs the weights
            from zeroserve.services.worker.model import quantize as Q

            for pname, target in Q.int_targets(self.model, quantization).items():
                Q.quantize_module(pname, *target, self.model.device)
        self.pos, self.meta, blocks = _decode_meta(batch, context, 16)
        shape = (blocks, 16, self.model.num_kv_heads, self.model.head_dim)
        self.caches = [(torch.randn(shape) * 0.1, torch.randn(shape) * 0.1) for _ in range(self.model.num_layers)]
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def median_ms(self, steps: int) -> float:
        times = []
        for i in range(steps + 3):
            ids = torch.randint(3, self.cfg.vocab_size, (self.batch,), generator=self.gen)  # new routes
            t0 = time.perf_counter()
            self.model.compute_logits(self.model(ids, self.pos, self.caches, self.meta))
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-inter", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "torch"])
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                    help="pack the linears (the dense model then takes the compiled decode step, MoE does not)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    env = environment()
    log(f"threads {a.threads}, load average {loadavg()}")
    rows = []
    for b in a.batches:
        # every model built first, then timed in interleaved rounds (best median of --rounds):
        # neighbours on a shared box slow whole seconds, not one configuration
        benches = {e: _Bench(_config(e, a.top_k, a.expert_inter, a.layers), b, a.context, a.backend,
                             quantization=a.quantization)
                   for e in [0, *a.experts]}
        if a.quantization != "none":  # packed dense models take the compiled step; MoE cannot
            benches["layers"] = _Bench(_config(0, a.top_k, a.expert_inter, a.layers), b, a.context, a.backend,
                                       quantization=a.quantization)
            benches["layers"].model.set_cpu_step(False)
        best = {e: float("inf") for e in benches}
        for _ in range(a.rounds):
            for e, bench in benches.items():
                best[e] = min(best[e], bench.median_ms(a.steps))
        del benches
        dense = best.pop(0)
        rows.append({"model": f"dense (MLP {a.top_k * a.expert_inter})", "batch": b, "step_ms": round(dense, 2),
                     "vs_dense": 1.0})
        if "layers" in best:
            ms = best.pop("layers")
            rows.append({"model": "dense, per-layer path", "batch": b, "step_ms": round(ms, 2),
                         "vs_dense": round(ms / dense, 2)})
        for e, ms in best.items():
            rows.append({"model": f"moe E={e} top-{a.top_k}", "batch": b, "step_ms": round(ms, 2),
                         "vs_dense": round(ms / dense, 2)})
            log(f"batch {b} E={e}: {ms:.2f} ms ({ms / dense:.2f}x dense {dense:.2f} ms)")
    print_table(rows, ["model", "batch", "step_ms", "vs_dense"])
    if a.json:
        json_line({"bench": "moe", "rows": rows, "env": env, "args": vars(a)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
