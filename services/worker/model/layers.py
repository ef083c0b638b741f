"""Building blocks of the decoder: tensor-parallel linears, vocab-parallel embedding / LM head,
RMSNorm and rotary embedding. Numerics go through the `ops` namespace (zeroserve.kernels.dispatch.get_ops) so the
same module runs the torch twins on CPU and the Triton kernels on GPU.

Tensor parallelism (Megatron style): column-parallel layers hold a slice of the output rows and
need no communication; row-parallel layers hold a slice of the input columns and all-reduce
their partial sums; the embedding and LM head split the (padded) vocabulary into equal shards.
Parameters are created empty (or random) on the target device; the loader fills each one with
exactly this shard's slice of the checkpoint tensor.

Quantized weights: every linear (and the embedding / LM head) is a `QuantizableWeight`: it holds
either the float `weight` parameter or, after `set_quantized(qw)`, a packed
`zeroserve.kernels.quant.QuantizedWeight` of the same shard (the float parameter is dropped). The matmul
then reads the packed bytes through `QuantizedWeight.linear` (the compiled kernel on CPU,
dequantize-then-matmul elsewhere). On a CPU a float weight is read by the same kernel too (its
"f32" format, a view of the parameter), and in the bf16 numeric mode every linear computes in
the bf16 regime at any row count: the worker sets both once (services/worker/numerics.py), so a
row's arithmetic never depends on the batch it came in. A
quantized embedding looks its rows up by dequantizing only
the gathered rows, so a tied LM head and the embedding share one packed copy. Vocab shards keep
only their real rows packed; the LM head pads the logits of a shard's padding rows with zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zeroserve.common.errors import ModelLoadError
from zeroserve.kernels.quant import QuantizedWeight


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup (None = default group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[N, c] on each rank -> [N, size*c] ordered by rank."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


def divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ModelLoadError(f"{what} ({n}) is not divisible by tensor_parallel_size ({tp})")
    return n // tp


def _param(shape: tuple[int, ...], device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


@dataclass(frozen=True)
class WeightSource:
    """One piece of a parameter: `hf_name[src_slice along src_dim]` -> `param[dst_start:... along dim 0]`.

    `full_shape` is the shape the checkpoint tensor must have (checked before reading)."""

    hf_name: str
    full_shape: tuple[int, ...]
    src_dim: int = 0
    src_start: int = 0
    src_len: int | None = None  # None = the whole dim
    dst_start: int = 0  # offset along the param's dim `src_dim` where this piece goes
    # fused MoE tensors [E, rows, cols]: read expert `expert` of dim 0 first (src_dim counts the
    # 3-D tensor's dims; the 2-D param's dim is src_dim - 1)
    expert: int | None = None


# --------------------------------------------------------------------------- quantized weights
class QuantizableWeight(nn.Module):
    """A module whose `weight` [rows, cols] may be replaced by a packed QuantizedWeight."""

    qweight: QuantizedWeight | None = None
    # the float weight in the compiled kernel's "f32" format (a view of the parameter, set by
    # services/worker/numerics.py on CPUs): torch's float GEMM rounds a row differently by batch
    # size, the kernel does not
    kernel_weight: QuantizedWeight | None = None
    bf16_matmul: bool = False  # the bf16 regime (x and w rounded to bf16, fp32 sums) at every row count

    @property
    def quantized(self) -> bool:
        return self.qweight is not None

    def packed_shape(self) -> tuple[int, int]:
        """The shape a packed weight of this shard has: the parameter's (vocab shards: real rows only)."""
        rows, cols = self.weight.shape if self.qweight is None else (self._packed_rows, self.qweight.shape[1])
        return getattr(self, "real_rows", rows), cols

    def set_quantized(self, qw: QuantizedWeight) -> None:
        """Hold `qw` (this shard's weight) instead of the float parameter, which is dropped."""
        want = self.packed_shape()
        if tuple(qw.shape) != want or want[0] == 0:
            raise ValueError(f"{type(self).__name__}: quantized weight {list(qw.shape)} does not fit {list(want)}")
        self._parameters.pop("weight", None)
        self.qweight = qw
        self._packed_rows = want[0]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias) in the model's numeric mode: one code path whatever the row count."""
        w = self.qweight if self.qweight is not None else self.kernel_weight
        if w is None:
            return F.linear(x, self.weight, bias)
        return w.linear_bf16(x, bias) if self.bf16_matmul else w.linear(x, bias)

    def float_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as floats: the parameter itself, or the packed weight dequantized."""
        if self.qweight is None:
            return self.weight if dtype is None else self.weight.to(dtype)
        return self.qweight.dequantize(dtype or torch.float32)


# --------------------------------------------------------------------------- linears
class ColumnParallelLinear(QuantizableWeight):
    """y = x @ W_shard^T (+ b_shard); W_shard holds this rank's slice of each merged output part.

    `part_sizes` are the full output sizes of the parts merged into one matmul (e.g. q, k, v or
    gate, up); each part is split evenly across ranks and the shard concatenates its slices."""

    def __init__(self, in_features: int, part_sizes: list[int], tp: TPInfo, bias: bool, device, dtype,
                 part_names: list[str] | None = None):
        super().__init__()
        names = part_names or [f"part{i}" for i in range(len(part_sizes))]
        self.tp = tp
        self.in_features = in_features
        self.full_part_sizes = list(part_sizes)
        self.shard_part_sizes = [divide(p, tp.size, f"output size of {n}") for p, n in zip(part_sizes, names)]
        out = sum(self.shard_part_sizes)
        self.weight = _param((out, in_features), device, dtype)
        self.bias = _param((out,), device, dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def sources(self, hf_names: list[str], what: str = "weight") -> list[WeightSource]:
        """Checkpoint pieces for `weight` or `bias`, one per merged part (HF names given per part)."""
        out, dst = [], 0
        for name, full, shard in zip(hf_names, self.full_part_sizes, self.shard_part_sizes):
            shape = (full, self.in_features) if what == "weight" else (full,)
            out.append(WeightSource(name, shape, 0, self.tp.rank * shard, shard, dst))
            dst += shard
        return out


    def fused_sources(self, hf_name: str) -> list[WeightSource]:
        """Checkpoint pieces when the parts are stored fused in one tensor `hf_name` (Phi-3's
        qkv_proj / gate_up_proj): part i's rows start at the sum of the parts before it, and
        this rank reads its slice of each part, so the shard equals the unfused layout's."""
        out, dst, base = [], 0, 0
        full_rows = sum(self.full_part_sizes)
        for full, shard in zip(self.full_part_sizes, self.shard_part_sizes):
            out.append(WeightSource(hf_name, (full_rows, self.in_features), 0, base + self.tp.rank * shard, shard, dst))
            dst += shard
            base += full
        return out


class RowParallelLinear(QuantizableWeight):
    """y = all_reduce(x_shard @ W[:, shard]^T): input features split across ranks."""

    def __init__(self, in_features: int, out_features: int, tp: TPInfo, device, dtype, what: str = "input size",
                 bias: bool = False):
        super().__init__()
        self.tp = tp
        self.full_in = in_features
        self.out_features = out_features
        self.shard_in = divide(in_features, tp.size, what)
        self.weight = _param((out_features, self.shard_in), device, dtype)
        self.bias = _param((out_features,), device, dtype) if bias else None  # added once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias

    def sources(self, hf_name: str) -> list[WeightSource]:
        return [WeightSource(hf_name, (self.out_features, self.full_in), 1,
                             self.tp.rank * self.shard_in, self.shard_in, 0)]

    def bias_sources(self, hf_name: str) -> list[WeightSource]:
        return [WeightSource(hf_name, (self.out_features,))]


# --------------------------------------------------------------------------- vocab
class VocabParallelEmbedding(QuantizableWeight):
    """Embedding whose rows are split across ranks; the vocab is padded up to a multiple of
    tp_size (padding rows are zero and never looked up / cut from the logits). Quantized, it
    holds only the shard's real rows and dequantizes the rows it looks up."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo, device, dtype):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden = hidden
        padded = -(-vocab_size // tp.size) * tp.size
        self.shard_size = padded // tp.size
        self.start = tp.rank * self.shard_size
        self.end = self.start + self.shard_size
        self.real_rows = max(0, min(self.end, vocab_size) - self.start)
        self.dtype = dtype
        self.weight = _param((self.shard_size, hidden), device, dtype)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return F.embedding(ids, self.weight)
        rows = self.qweight.select_rows(ids.reshape(-1)).dequantize(self.dtype)
        return rows.reshape(*ids.shape, self.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        in_shard = (ids >= self.start) & (ids < self.end)
        local = torch.where(in_shard, ids - self.start, torch.zeros_like(ids))
        out = self._lookup(local)
        out = out * in_shard.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)

    def sources(self, hf_name: str) -> list[WeightSource]:
        real = max(0, min(self.end, self.vocab_size) - self.start)
        return [WeightSource(hf_name, (self.vocab_size, self.hidden), 0, self.start, real, 0)]


class ParallelLMHead(QuantizableWeight):
    """logits = hidden @ W^T with W's vocab rows split across ranks; gathered to the full vocab.
    Tied, it uses the embedding's weight (float or packed)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo, device, dtype,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden = hidden
        padded = -(-vocab_size // tp.size) * tp.size
        self.shard_size = padded // tp.size
        self.start = tp.rank * self.shard_size
        self.end = self.start + self.shard_size
        self.real_rows = max(0, min(self.end, vocab_size) - self.start)
        self.tied = tied_to is not None
        if tied_to is not None:
            self._embed = [tied_to]  # a list keeps it out of this module's parameters
        else:
            self.weight = _param((self.shard_size, hidden), device, dtype)

    def get_weight(self) -> torch.Tensor:
        return self.weight_module().float_weight()

    def weight_module(self) -> QuantizableWeight:
        """The module that holds the LM head's weight: the embedding when tied, else this."""
        return self._embed[0] if self.tied else self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.weight_module().matmul(hidden).float()
        if logits.shape[-1] < self.shard_size:  # packed vocab shard: real rows only
            logits = F.pad(logits, (0, self.shard_size - logits.shape[-1]))
        logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]

    def sources(self, hf_name: str) -> list[WeightSource]:
        real = max(0, min(self.end, self.vocab_size) - self.start)
        return [WeightSource(hf_name, (self.vocab_size, self.hidden), 0, self.start, real, 0)]


# --------------------------------------------------------------------------- norm / rope
class RMSNorm(nn.Module):
    """RMSNorm scaled by `offset + weight` (offset 1: Gemma's HF checkpoints store w - 1)."""

    def __init__(self, size: int, eps: float, ops, device, dtype, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.size = size
        self.offset = offset
        self.weight = _param((size,), device, dtype)

    def scale(self) -> torch.Tensor:
        return self.weight if not self.offset else self.weight + self.offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.scale(), self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.scale(), self.eps)

    def sources(self, hf_name: str) -> list[WeightSource]:
        return [WeightSource(hf_name, (self.size,))]


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [rot_dim/2] in fp32 (plain RoPE, or Llama-3.1 scaled)."""
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    inv_freq = 1.0 / (theta ** exponents)
    if not scaling:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "longrope":  # the short factors; RotaryEmbedding adds the long table
        return 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta ** exponents)
    if scaling["rope_type"] != "llama3":
        raise ModelLoadError(f"unsupported rope scaling type {scaling['rope_type']!r}")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    low_wavelen = orig / low  # longer waves than this: fully interpolated (divided by factor)
    high_wavelen = orig / high  # shorter waves than this: untouched
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    # in between: blend the interpolated and original frequency linearly in orig/wavelen
    blend = (orig / wavelen - low) / (high - low)
    mixed = (1 - blend) * scaled / factor + blend * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, mixed, scaled)


def build_cos_sin_cache(max_pos: int, rot_dim: int, theta: float, scaling: dict | None,
                        device) -> torch.Tensor:
    """[max_pos, rot_dim] fp32, row p = [cos(p * f) | sin(p * f)]."""
    inv_freq = rope_inv_freq(rot_dim, theta, scaling)
    pos = torch.arange(max_pos, dtype=torch.int64).float()
    table = _cos_sin(pos, inv_freq)
    if scaling and scaling["rope_type"] == "longrope":
        # rows [max_pos, 2 max_pos): the long factors (a token whose request is past
        # original_max_position_embeddings reads them, see RotaryEmbedding.rope_positions);
        # both scaled by the attention factor, as transformers scales cos and sin
        exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
        long_freq = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta ** exponents)
        table = torch.cat((table, _cos_sin(pos, long_freq))) * scaling["attention_factor"]
    return table.to(device)


def _cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    angles = pos[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the fp32 cos/sin table. It is a plain attribute, not a buffer, so `module.to(dtype)`
    can never round it to half precision; it follows the inputs' device on first use."""

    def __init__(self, rot_dim: int, max_pos: int, theta: float, scaling: dict | None, ops, device):
        super().__init__()
        self.ops = ops
        self.rot_dim = rot_dim
        self.max_pos = max_pos
        self.scaling = scaling
        self.cos_sin_cache = build_cos_sin_cache(max_pos, rot_dim, theta, scaling, device)

    def rope_positions(self, positions: torch.Tensor, meta) -> torch.Tensor:
        """Rows of the table each token reads: its position, or (LongRoPE) position + max_pos
        when its request holds more than original_max_position_embeddings tokens after this
        step. transformers picks the factors per forward by the longest position in it, so one
        request prefilled in one piece, then decoded, reads exactly what HF reads."""
        if self.scaling is None or self.scaling["rope_type"] != "longrope":
            return positions
        qsl = meta.query_start_loc.long()
        per_req = meta.seq_lens.long() > self.scaling["original_max_position_embeddings"]
        flag = torch.zeros(positions.shape[0], dtype=torch.long, device=positions.device)
        n = int(qsl[-1])
        flag[:n] = torch.repeat_interleave(per_req.long(), qsl[1:] - qsl[:-1], output_size=n)
        return positions + flag * self.max_pos

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.cos_sin_cache.device != q.device:
            self.cos_sin_cache = self.cos_sin_cache.to(q.device)
        return self.ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
