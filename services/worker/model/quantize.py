"""Which weights are packed, and in which format (weight-only quantization; kernels/quant.py).

`load_model(..., quantization=Q)`:

==========  =========================================================================================
Q           what the linears hold
==========  =========================================================================================
None/auto   GGUF: the file's Q8_0 / Q4_0 / Q4_1 / Q4_K tensors stay packed (every linear, the
            embedding and the LM head); other types (F16, Q5_*, Q2_K, Q3_K, Q5_K, Q6_K, ...) are
            dequantized to the compute dtype. safetensors: floats.
none        floats: every tensor dequantized / read at the compute dtype (the pre-quantization path)
int8        the decoder's linears quantized at load, int8 symmetric per group of 128 input columns;
            the LM head int8 per group of 32 (tied: the embedding lookup shares it); an untied
            embedding stays float
int4        the decoder's linears int4 asymmetric per group of 32; the LM head int8 per group of 32
            (as llama.cpp's Q4 files keep token_embd/output at 6-8 bits: the logits are the most
            sensitive matmul, and through a tied embedding so is every layer's input)
==========  =========================================================================================

int8/int4 quantize whatever float the loader produced (a GGUF's Q4_1 weights are dequantized
first, then requantized). Each tensor-parallel shard quantizes its own slice right after the
slice is read, so the float copy of the whole model never exists at once; a row-parallel slice
whose ends are not on a group boundary is quantized with groups starting at its first column
(valid, but not bit-equal to the tp=1 grouping: said in a log line).

A packed GGUF linear in a column-parallel shard is a row slice (`QuantizedWeight.rows`, a view
before the copy that owns it); in a row-parallel shard a column slice, which must fall on the
format's block boundary (32, Q4_K 256): if it does not, that tensor is dequantized and a log line
says so. Fused projections (q/k/v, gate/up) are stacked with `QuantizedWeight.cat` when their
parts share a format; llama.cpp's per-head q/k row permutation is undone with `select_rows`.
"""

from __future__ import annotations

import torch

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.log import get_logger
from zeroserve.kernels.quant import GGML_TYPES, quantize_int4, quantize_int8
from zeroserve.services.worker.model.layers import (
    ParallelLMHead,
    QuantizableWeight,
    RowParallelLinear,
)

log = get_logger("worker.model.quantize")

QUANTIZATIONS = ("auto", "none", "int8", "int4")
# the GGUF types QuantizedWeight reads packed (it has a matmul kernel for them)
PACKED_GGUF_TYPES = tuple(n.upper() for n in GGML_TYPES.values())
INT_GROUP = {"int8": 128, "int4": 32}  # decoder linears: format -> group size
LM_HEAD = ("int8", 32)  # the LM head (and a tied embedding) in both int modes
# SmolLM2-135M (tied, its Q8_0 token_embd dequantized then requantized), int8 head, 29 positions:
# group 128 moved logits by up to 0.45 and flipped 1 argmax; group 32 reproduces Q8_0 exactly


def resolve_quantization(quantization: str | None) -> str:
    q = "auto" if quantization is None else str(quantization).lower()
    if q not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or None = auto), "
                             f"got {quantization!r}")
    return q


def int_targets(model, quantization: str) -> dict[str, tuple[QuantizableWeight, str, int]]:
    """Parameter name -> (module, format, group size) of the weights an int8/int4 load quantizes."""
    if quantization not in INT_GROUP:
        return {}
    out = {}
    head = model.lm_head.weight_module() if model.lm_head is not None else None  # None: not the last stage
    for pname, mod in model.quantizable().items():
        if mod is head:
            out[pname] = (mod, *LM_HEAD)
        elif pname.startswith("layers."):
            out[pname] = (mod, quantization, INT_GROUP[quantization])
    return out


@torch.no_grad()
def quantize_module(pname: str, mod: QuantizableWeight, fmt: str, group: int, device) -> bool:
    """Replace `mod`'s float weight by `fmt` (int8/int4) per `group` input columns. False (and a
    log line) when the shape does not allow it: the weight then stays float."""
    rows, cols = mod.packed_shape()
    if cols % 32 or rows == 0:
        log.warning("weight kept float: int quantization needs K % 32 == 0", weight=pname, shape=[rows, cols])
        return False
    if isinstance(mod, RowParallelLinear) and mod.tp.size > 1 and cols % group:
        log.info("row-parallel shard quantized with groups from its own first column (not the tp=1 grouping)",
                 weight=pname, shard_cols=cols, group=group)
    w = mod.weight[:rows]
    qw = (quantize_int8 if fmt == "int8" else quantize_int4)(w, group)
    mod.set_quantized(qw.to(device))
    return True


def log_summary(model, quantization: str, source: str) -> None:
    summary = model.quant_summary()
    log.info("weights loaded", source=source, quantization=quantization, formats=summary,
             weight_bytes=model.weight_bytes(), lm_head=_head_format(model))


def _head_format(model) -> str:
    head: ParallelLMHead | None = model.lm_head
    if head is None:
        return "none (an earlier pipeline stage)"
    m = head.weight_module()
    fmt = m.qweight.format if m.qweight is not None else "float"
    return f"{fmt} (tied)" if head.tied else fmt
