"""GGUF -> our model, reading and dequantizing only this tensor-parallel shard's slice.

The model's parameters declare their checkpoint pieces as HF tensor names plus slices
(`CausalLM.weight_sources()`, the same plan the safetensors loader follows); here each HF name
is mapped to its GGUF name and the slice is cut from the memory-mapped quantized data:

- row slices (column-parallel q/k/v, gate/up, vocab shards): quant blocks run along a row, so
  the shard's rows are cut from the raw bytes and only those rows are dequantized;
- column slices (row-parallel o_proj/down_proj): cut from the bytes when the slice starts and
  ends on a block boundary, else the rows are dequantized in chunks and the columns kept.

Rows are dequantized in chunks of ~16M values straight into the parameter, so no full float
copy of a big tensor (or of any other tensor) is ever held. llama.cpp stores Llama q/k rows
permuted for its interleaved RoPE; `unpermute_rows` undoes that per head.

With quantization "auto" (the default) a weight whose pieces are all Q8_0 / Q4_0 / Q4_1 / Q4_K
(one type per module) is not dequantized: its shard's bytes become a `QuantizedWeight` (row
slices, block-aligned column slices, q/k rows re-ordered with `select_rows`, fused parts stacked
with `cat`) that the module multiplies by directly (services/worker/model/quantize.py).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.gguf_config import GGUFFile, GGUFTensor, open_gguf
from zeroserve.common.log import get_logger
from zeroserve.kernels.quant import QuantizedWeight
import zeroserve.services.worker.model.quantize as Q
from zeroserve.services.worker.model.layers import WeightSource
from zeroserve.services.worker.model.loader import _slice_index, _zero_vocab_padding

log = get_logger("worker.model.gguf")

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
CHUNK_VALUES = 1 << 24  # dequantize at most this many values at once (64 MiB of fp32)

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # MoE routers (Mixtral's block is `block_sparse_moe`); experts: _EXPERT_RE below
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    # Phi-3's fused checkpoints: llama.cpp keeps them fused (ffn_up holds gate then up)
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
# llama.cpp stacks each layer's experts into one 3-D tensor per projection [E, rows, cols]
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                        r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# families whose layers normalize block outputs (Gemma 2, OLMo 2): llama.cpp calls their norms
# post_attention_norm / ffn_norm (the pre-MLP norm) / post_ffw_norm
_POST_NORM_NAMES = dict(_LAYER_NAMES, **{
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
})


def gguf_name(hf_name: str, post_norm: bool = False) -> str:
    """The GGUF tensor name llama.cpp's converter gives an HF checkpoint tensor
    (`post_norm`: the model has Gemma 2 / OLMo 2 style output norms)."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    names = _POST_NORM_NAMES if post_norm else _LAYER_NAMES
    m = _LAYER_RE.fullmatch(hf_name)
    if m and m.group(2) in names:
        return f"blk.{m.group(1)}.{names[m.group(2)]}"
    ex = expert_gguf_name(hf_name)
    if ex is not None:
        return ex[0]
    raise KeyError(f"no GGUF name for checkpoint tensor {hf_name!r}")


def expert_gguf_name(hf_name: str) -> tuple[str, int] | None:
    """(stacked GGUF tensor, expert index) for one expert's HF weight, else None."""
    m = _EXPERT_RE.fullmatch(hf_name)
    if m is None:
        return None
    return f"blk.{m.group(1)}.{_EXPERT_NAMES[m.group(3)]}.weight", int(m.group(2))


def unpermute_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute` (convert_hf_to_gguf.py) on whole heads of rows:
    GGUF row 2*j + i of a head is HF row i*(head_dim/2) + j."""
    rows = w.shape[0]
    return w.reshape(rows // head_dim, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_rows(raw: np.ndarray, type_name: str) -> torch.Tensor:
    """[rows, bytes] of one GGML type -> float tensor [rows, values] (fp32, or the file's fp16/bf16)."""
    import gguf

    if type_name in ("F32", "F16", "BF16"):  # a copy: the memory map is read-only
        view = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}[type_name]
        out = torch.from_numpy(np.array(raw, copy=True).view(view))
        return out.view(torch.bfloat16) if type_name == "BF16" else out
    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(gguf.quants.dequantize(np.ascontiguousarray(raw), qtype))


def _check_type(t: GGUFTensor, path: Path) -> str:
    name = t.type_name
    if name not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"{path.name}: tensor {t.name!r} has quantization type {name}, which zeroserve cannot "
            f"dequantize; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    return name


class _Piece:
    """One WeightSource resolved against the GGUF file: which bytes to read, how to cut them."""

    def __init__(self, pname: str, src: WeightSource, raw: np.ndarray, type_name: str,
                 permute_head_dim: int | None):
        import gguf

        self.pname, self.src, self.type_name = pname, src, type_name
        self.permute_head_dim = permute_head_dim
        self.block, self.block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
        self.ndim = len(src.full_shape)
        _, self.length = _slice_index(src, self.ndim)
        self.cols = raw.shape[1] // self.block_bytes * self.block
        self.raw = raw
        self.cut = None  # (dim, start, length) still to cut after dequantizing
        if self.ndim == 1:  # norms and biases: small, read whole
            self.cut = (0, src.src_start, self.length)
        elif src.src_dim == 0:
            self.raw = raw[src.src_start: src.src_start + self.length]
        else:
            start, end = src.src_start, src.src_start + self.length
            if start % self.block == 0 and end % self.block == 0:  # whole blocks: cut the bytes
                self.raw = raw[:, start // self.block * self.block_bytes: end // self.block * self.block_bytes]
            else:
                self.cut = (1, start, self.length)
        self.nbytes = int(self.raw.shape[0] * self.raw.shape[1])

    def packed(self) -> QuantizedWeight:
        """This piece's bytes as a QuantizedWeight in HF row order (a view where it can be)."""
        rows, k = self.raw.shape[0], self.raw.shape[1] // self.block_bytes * self.block
        qw = QuantizedWeight.from_gguf(self.raw, self.type_name, (rows, k))
        if self.permute_head_dim:
            qw = qw.select_rows(unpermute_rows(torch.arange(rows), self.permute_head_dim))
        return qw

    @torch.no_grad()
    def load_into(self, param: torch.Tensor) -> None:
        src = self.src
        if self.length == 0:  # a shard made only of vocab padding
            return
        dst = param.data.narrow(src.src_dim, src.dst_start, self.length)
        if self.ndim == 1:
            vals = dequantize_rows(self.raw, self.type_name).reshape(-1).narrow(0, self.cut[1], self.cut[2])
            if self.permute_head_dim:
                vals = unpermute_rows(vals, self.permute_head_dim)
            dst.copy_(vals.to(param.dtype))
            return
        step = max(1, CHUNK_VALUES // self.cols)
        if self.permute_head_dim:  # chunks of whole heads, so each can be un-permuted alone
            step = max(self.permute_head_dim, step // self.permute_head_dim * self.permute_head_dim)
        rows = self.raw.shape[0]
        for r in range(0, rows, step):
            n = min(step, rows - r)
            vals = dequantize_rows(self.raw[r: r + n], self.type_name)
            if self.cut is not None:
                vals = vals.narrow(1, self.cut[1], self.cut[2])
            if self.permute_head_dim:
                vals = unpermute_rows(vals, self.permute_head_dim)
            dst.narrow(0, r, n).copy_(vals.to(param.dtype))


def plan_gguf_pieces(model, gf: GGUFFile) -> list[_Piece]:
    """Resolve every parameter's sources against the file; all checks before any read."""
    path, tensors = gf.path, gf.tensors
    params = dict(model.named_parameters())
    sources = model.weight_sources()
    missing_params = sorted(set(params) - set(sources))
    if missing_params:  # a bug in the model code, not in the file
        raise RuntimeError(f"no checkpoint source for parameters {missing_params}")
    # llama.cpp permutes q/k rows for the archs its converter derives from LlamaModel
    permute = model.cfg.family in ("llama", "mixtral", "granite")
    post_norm = model.cfg.norm_layout != "pre"
    pieces = []
    for pname, srcs in sources.items():
        for src in srcs:
            name = gguf_name(src.hf_name, post_norm)
            t = tensors.get(name)
            expert = expert_gguf_name(src.hf_name)
            if t is None and expert is not None:  # llama.cpp before 2024-04: one 2-D tensor per expert
                legacy = name.replace("_exps.weight", f".{expert[1]}.weight")
                if legacy in tensors:
                    name, t, expert = legacy, tensors[legacy], None
            if t is None:
                raise ModelLoadError(
                    f"{path.name} is missing tensor {name!r} (for {src.hf_name}, needed by {model.cfg.architecture})"
                )
            want = tuple(src.full_shape) if expert is None else (model.cfg.num_experts, *src.full_shape)
            if t.shape != want:
                raise ModelLoadError(
                    f"tensor {name!r} in {path.name} has shape {list(t.shape)}, expected "
                    f"{list(want)} from the file's metadata"
                )
            type_name = _check_type(t, path)
            qk = permute and (".attn_q." in name or ".attn_k." in name)
            raw = gf.raw_rows(t)
            if expert is not None:  # this expert's rows of the stack: a 2-D weight like any other
                n = src.full_shape[0]
                raw = raw[expert[1] * n:(expert[1] + 1) * n]
            pieces.append(_Piece(pname, src, raw, type_name, model.cfg.head_dim if qk else None))
    return pieces


def plan_packed(model, pieces: list[_Piece]) -> dict[str, list[_Piece]]:
    """Parameter name -> its pieces, for the weights that stay packed ("auto"): every piece of
    the module in one type with a kernel, column slices on block boundaries, real rows present."""
    by_param: dict[str, list[_Piece]] = {}
    for piece in pieces:
        by_param.setdefault(piece.pname, []).append(piece)
    out, no_kernel = {}, {}
    for pname, mod in model.quantizable().items():
        ps = by_param.get(pname, [])
        types = sorted({p.type_name for p in ps})
        names = [gguf_name(p.src.hf_name, model.cfg.norm_layout != "pre") for p in ps]
        if not ps or any(t not in Q.PACKED_GGUF_TYPES for t in types):
            for t in types:
                if t not in Q.PACKED_GGUF_TYPES and t not in ("F32", "F16", "BF16"):
                    no_kernel[t] = no_kernel.get(t, 0) + 1
            continue
        if len(types) > 1:
            log.info("weight dequantized: its fused parts have different types", weight=pname, tensors=names,
                     types=types)
            continue
        cut = next((p for p in ps if p.cut is not None), None)
        if cut is not None:
            log.warning("weight dequantized: this shard's column slice does not fall on a block boundary",
                        weight=pname, tensors=names, type=types[0], block=cut.block,
                        cols=[cut.src.src_start, cut.src.src_start + cut.length])
            continue
        if mod.packed_shape()[0] == 0:  # a vocab shard made only of padding
            continue
        out[pname] = ps
    if no_kernel:
        log.info("weights dequantized: no packed kernel for their types", modules_by_type=no_kernel)
    return out


@torch.no_grad()
def load_gguf_weights(model, path: str | Path, quantization: str | None = None) -> None:
    """Fill every parameter of `model` from the GGUF file at `path` (this shard's slices).

    quantization (services/worker/model/quantize.py): "auto" keeps Q8_0/Q4_0/Q4_1/Q4_K weights
    packed, "none" dequantizes everything, "int8"/"int4" requantize the dequantized linears."""
    path = Path(path)
    quantization = Q.resolve_quantization(quantization)
    t0 = time.monotonic()
    pieces = plan_gguf_pieces(model, open_gguf(path))
    packed = plan_packed(model, pieces) if quantization == "auto" else {}
    targets = Q.int_targets(model, quantization)
    modules = model.quantizable()
    params = dict(model.named_parameters())
    left: dict[str, int] = {}
    for p in pieces:
        left[p.pname] = left.get(p.pname, 0) + 1
    bar = _progress(sum(p.nbytes for p in pieces), path.name, time.monotonic() - t0)
    try:
        for pname, ps in packed.items():
            parts = [p.packed() for p in ps]
            qw = parts[0] if len(parts) == 1 else QuantizedWeight.cat(parts)
            modules[pname].set_quantized(qw.to(model.device))  # a copy: never a view of the file map
            bar.update(sum(p.nbytes for p in ps))
        for piece in pieces:
            if piece.pname in packed:
                continue
            piece.load_into(params[piece.pname])
            bar.update(piece.nbytes)
            left[piece.pname] -= 1
            if left[piece.pname] == 0 and piece.pname in targets:  # quantize as soon as it is whole
                Q.quantize_module(piece.pname, *targets[piece.pname], model.device)
    finally:
        bar.close()
    _zero_vocab_padding(model)
    Q.log_summary(model, quantization, path.name)


def _progress(total: int, name: str, elapsed: float):
    """A byte progress bar on stderr: at once on a terminal, else only once loading passed ~2 s."""
    from tqdm import tqdm

    delay = 0.0 if sys.stderr.isatty() else max(0.0, 2.0 - elapsed)
    return tqdm(total=total, desc=f"loading {name}", unit="B", unit_scale=True, file=sys.stderr,
                delay=delay, leave=False)
