"""The mixture-of-experts MLP block (Mixtral, Qwen3-MoE, OLMoE): router -> top-k -> experts.

    block = SparseMoeBlock(cfg, "model.layers.3.mlp", tp, ops, device, dtype, expert_parallel=False)
    y = block(x)                                    # x [T, H] -> [T, H], all-reduced over the group

Routing (zeroserve.kernels.moe.route): softmax over every expert in fp32, top k, renormalized (Mixtral;
Qwen3-MoE / OLMoE when `norm_topk_prob`) - as the three families' transformers routers do. The
router weight is replicated and kept float on every shard, so all shards route alike.

Experts are stacked: `w13` [E_local, 2*I_shard, H] (each expert's gate rows, then its up rows)
and `w2` [E_local, H, I_shard], the layout `ops.fused_moe` (torch twin / Triton grouped GEMM)
reads. Each expert is also an `ExpertMLP` module whose `gate_up_proj` / `down_proj` parameters
are *views* of its slice of those stacks: the loaders, the int8/int4 quantizer and the GGUF
packer see ordinary Column/RowParallelLinear weights named `mlp.experts.{e}.*` and fill them by
the same plan as a dense MLP, with no copy. Once the experts are packed (a GGUF's Q8_0/Q4_0, or
--quantization int8|int4) the stacks are dropped and the block runs each active expert's packed
matmuls (the same per-active-expert loop as the twin). A checkpoint holding transformers 5's
fused 3-D `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] fills the same
parameters from slices of those (`use_fused_experts`, `WeightSource.expert`).

Parallelism over a group of T shards (one all-reduce at the end either way):
- tensor parallel (default): every shard holds every expert, gate/up column-split and down
  row-split by the intermediate size; the shards' partial sums add up in the all-reduce;
- expert parallel (`--enable-expert-parallel`): shard r holds experts [r*E/T, (r+1)*E/T) whole
  and computes their contributions for all tokens; the all-reduce adds the shards' experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.model_config import ModelConfig
from zeroserve.kernels.moe import expert_groups, route, single_token_routes
from zeroserve.kernels.quant import QuantizedWeight
from zeroserve.services.worker.model.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPInfo,
    WeightSource,
    divide,
)

_NO_TP = TPInfo(0, 1, None)


def hf_expert_names(cfg: ModelConfig, prefix: str, e: int) -> tuple[str, str, str]:
    """The checkpoint names of expert e's gate, up and down weights (per-expert, as
    `save_pretrained` writes them and real checkpoints ship)."""
    if cfg.family == "mixtral":
        p = f"{prefix}.experts.{e}"
        return f"{p}.w1.weight", f"{p}.w3.weight", f"{p}.w2.weight"
    p = f"{prefix}.experts.{e}"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def moe_prefix(cfg: ModelConfig, layer_prefix: str) -> str:
    """Where a layer's MoE block lives in the checkpoint: Mixtral `block_sparse_moe`, else `mlp`."""
    return f"{layer_prefix}.block_sparse_moe" if cfg.family == "mixtral" else f"{layer_prefix}.mlp"


class Router(nn.Module):
    """The replicated router [E, H]; never packed (a rounding flip would change the expert). On a
    CPU it runs on the kernel's fp32 view of its weight in every numeric mode (set by
    services/worker/numerics.py): a token's experts must not depend on the batch."""

    kernel_weight: QuantizedWeight | None = None

    def __init__(self, num_experts: int, hidden: int, device, dtype):
        super().__init__()
        self.num_experts, self.hidden = num_experts, hidden
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_weight is not None:
            return self.kernel_weight.linear(x)
        return F.linear(x, self.weight)

    def sources(self, hf_name: str) -> list[WeightSource]:
        return [WeightSource(hf_name, (self.num_experts, self.hidden))]


class ExpertMLP(nn.Module):
    """One expert: fused gate/up (column-parallel) and down (row-parallel, reduced by the block)."""

    def __init__(self, hidden: int, inter: int, tp: TPInfo, w13: torch.Tensor, w2: torch.Tensor, device, dtype):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], tp, False, "meta", dtype,
                                                 part_names=["moe_intermediate_size", "moe_intermediate_size"])
        self.down_proj = RowParallelLinear(inter, hidden, tp, "meta", dtype, what="moe_intermediate_size")
        # views of the block's stacks (built on "meta" above: no throwaway allocation)
        self.gate_up_proj.weight = nn.Parameter(w13, requires_grad=False)
        self.down_proj.weight = nn.Parameter(w2, requires_grad=False)

    @property
    def quantized(self) -> bool:
        return self.gate_up_proj.quantized or self.down_proj.quantized

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        # down_proj.matmul, not forward: the block all-reduces once for all experts
        return self.down_proj.matmul(ops.silu_and_mul(self.gate_up_proj.matmul(x)))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, tp: TPInfo, ops, device, dtype, expert_parallel: bool = False):
        super().__init__()
        self.ops, self.prefix, self.cfg, self.tp = ops, prefix, cfg, tp
        self.fused_prefix = prefix.rsplit(".", 1)[0] + ".mlp"  # transformers 5 names every family's block `mlp`
        self.fused_checkpoint = False  # set by the safetensors loader (use_fused_experts)
        n, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.expert_parallel = expert_parallel and tp.size > 1
        if self.expert_parallel:
            self.num_local = divide_experts(n, tp.size)
            self.expert_start = tp.rank * self.num_local
            expert_tp, i_shard = _NO_TP, i
        else:
            self.num_local, self.expert_start = n, 0
            expert_tp, i_shard = tp, divide(i, tp.size, "moe_intermediate_size")
        self.gate = Router(n, h, device, dtype)
        w13 = torch.empty(self.num_local, 2 * i_shard, h, device=device, dtype=dtype)
        w2 = torch.empty(self.num_local, h, i_shard, device=device, dtype=dtype)
        # not kept here: a reference would keep the float stacks alive after the experts are
        # packed (their views popped); _float_stacks() re-derives them from the views' storage
        self._stacks: tuple[torch.Tensor, torch.Tensor] | None = None
        self.experts = nn.ModuleList(ExpertMLP(h, i, expert_tp, w13[e], w2[e], device, dtype)
                                     for e in range(self.num_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        # experts on the kernel (a CPU's numeric mode) run one by one like packed ones: the
        # stacked twin's torch GEMMs round a token's rows by how many others chose its expert
        on_kernel = self.experts[0].gate_up_proj.kernel_weight is not None
        stacks = None if on_kernel else self._float_stacks()
        if stacks is not None:
            out = self.ops.fused_moe(x, stacks[0], stacks[1], weights.to(x.dtype), ids, self.expert_start)
        elif x.shape[0] == 1:  # packed or on the kernel, one token (batch-1 decode): no gather / scatter
            out = torch.zeros_like(x)
            for e, w in single_token_routes(ids, weights.to(x.dtype), self.num_local, self.expert_start):
                out += self.experts[e](x, self.ops) * w
        else:  # packed (or kernel-routed) experts: each active expert's matmuls
            out = torch.zeros_like(x)
            flat_w = weights.reshape(-1).to(x.dtype)
            for e, slots, tok in expert_groups(ids, self.num_local, self.expert_start):
                y = self.experts[e](x.index_select(0, tok), self.ops)
                out.index_add_(0, tok, y * flat_w[slots].unsqueeze(1))
        return self.tp.all_reduce(out)

    def _float_stacks(self):
        """The stacked float weights [E, 2I, H] / [E, H, I] (views of the storage the experts'
        parameters share), or None once any expert is packed. The scan over every expert runs
        once (and again only if expert 0's state changes): per step it cost ~0.1 ms at 64."""
        probe = self.experts[0].quantized
        if getattr(self, "_probe", None) is not probe:
            self._probe, self._stacks = probe, None
            self._packed = any(ex.quantized for ex in self.experts)
        if self._packed:
            return None
        if self._stacks is None:
            self._stacks = (_stacked([ex.gate_up_proj.weight for ex in self.experts]),
                            _stacked([ex.down_proj.weight for ex in self.experts]))
        return self._stacks

    def weight_sources(self) -> dict[str, list[WeightSource]]:
        if self.fused_checkpoint:
            return _fused_expert_sources(self)
        out = {"gate.weight": self.gate.sources(f"{self.prefix}.gate.weight")}
        for local, ex in enumerate(self.experts):
            gate, up, down = hf_expert_names(self.cfg, self.prefix, self.expert_start + local)
            out[f"experts.{local}.gate_up_proj.weight"] = ex.gate_up_proj.sources([gate, up])
            out[f"experts.{local}.down_proj.weight"] = ex.down_proj.sources(down)
        return out


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a whole projection split across the shards (OLMoE's q/k norms: one norm over
    all heads, not per head). Each shard holds its slice of the vector and of the weight; the sum
    of squares is all-reduced so every shard divides by the full vector's RMS, as HF does."""

    def __init__(self, shard_size: int, full_size: int, eps: float, tp: TPInfo, device, dtype):
        super().__init__()
        self.shard_size, self.full_size, self.eps, self.tp = shard_size, full_size, eps, tp
        self.weight = nn.Parameter(torch.empty(shard_size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sq = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        normed = xf * torch.rsqrt(sq / self.full_size + self.eps)
        return self.weight * normed.to(x.dtype)

    def sources(self, hf_name: str) -> list[WeightSource]:
        return [WeightSource(hf_name, (self.full_size,), 0, self.tp.rank * self.shard_size, self.shard_size, 0)]


def _stacked(ws: list[torch.Tensor]) -> torch.Tensor:
    """[E, rows, cols] over the experts' weights: a view when they still are the consecutive
    slices of one stack they were built as, else (parameters replaced) a stacked copy."""
    w0 = ws[0]
    n = w0.numel()
    shared = all(w.untyped_storage().data_ptr() == w0.untyped_storage().data_ptr() and w.is_contiguous()
                 and w.storage_offset() == w0.storage_offset() + e * n and w.shape == w0.shape
                 for e, w in enumerate(ws))
    if not shared:
        return torch.stack(ws)
    return w0.as_strided((len(ws), *w0.shape), (n, *w0.stride()), w0.storage_offset())


def _fused_expert_sources(block: SparseMoeBlock) -> dict[str, list[WeightSource]]:
    """Sources from fused tensors: gate_up_proj [E, 2I, H] (gate rows, then up rows) and
    down_proj [E, H, I]; this shard's rows / columns of each of its experts."""
    cfg, p = block.cfg, f"{block.fused_prefix}.experts"
    n, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    out = {"gate.weight": block.gate.sources(f"{block.fused_prefix}.gate.weight")}
    for local, ex in enumerate(block.experts):
        e = block.expert_start + local
        shard = ex.down_proj.shard_in
        start = ex.down_proj.tp.rank * shard
        out[f"experts.{local}.gate_up_proj.weight"] = [
            WeightSource(f"{p}.gate_up_proj", (n, 2 * i, h), 1, start, shard, 0, expert=e),
            WeightSource(f"{p}.gate_up_proj", (n, 2 * i, h), 1, i + start, shard, shard, expert=e)]
        out[f"experts.{local}.down_proj.weight"] = [
            WeightSource(f"{p}.down_proj", (n, h, i), 2, start, shard, 0, expert=e)]
    return out


def divide_experts(n: int, shards: int) -> int:
    if n % shards:
        raise ModelLoadError(f"num_experts ({n}) is not divisible by tensor_parallel_size ({shards}) "
                             "for expert parallelism")
    return n // shards


def use_fused_experts(model, checkpoint_names) -> None:
    """Point every MoE block at the checkpoint's expert layout: per expert (what transformers'
    save_pretrained writes and real checkpoints ship) or fused 3-D `mlp.experts.gate_up_proj` /
    `down_proj` (transformers 5's own module parameters, e.g. a state dict saved as is)."""
    names = set(checkpoint_names)
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.fused_checkpoint = f"{layer.mlp.fused_prefix}.experts.gate_up_proj" in names
