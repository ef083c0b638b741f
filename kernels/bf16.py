"""bf16 weight panels for the CPU's batched matmuls (prefill, batched decode).

Why: a step with many rows is compute-bound, and a CPU with AVX-512 BF16 / AMX multiplies bf16
at twice (AMX: far more than) the fp32 rate. Each linear keeps its exact weight (fp32 parameter
or packed GGUF/int blocks) and gains a bf16 copy made once at start-up, dequantized from the
exact values; steps with at least `min_rows` rows multiply on the copy (oneDNN's bf16 GEMM,
products accumulated in fp32, the output rounded to bf16 by the GEMM and widened back to fp32);
steps with fewer rows (decode at batch 1, where the packed 4-bit kernel reads ~3x fewer bytes
than bf16) keep the exact path. A packed weight's bf16 steps below PANEL_MIN_ROWS rows (batched
decode) do not read the panel: they run in the same bf16 regime on the packed bytes
(`QuantizedWeight.linear_bf16`). Activations stay fp32 outside the matmuls: x is rounded to bf16
at the matmul.

Memory: 2 bytes per weight on top of the exact copy (SmolLM2-135M: +257 MiB next to 84 MiB of
Q4_1 blocks; the tied embedding/LM head's copy is 54 MiB of it).

Numerics: rounding x and w to bf16 (8 mantissa bits) moves each product by ~2^-8 relative; a
step's result depends on whether it had `min_rows` rows. The fp32 path stays the reference and
is what runs unless the panels are attached (`--matmul-dtype bfloat16`, or `auto` on a CPU with
native bf16 where the start-up probe says so: services/worker/matmul_probe.py).

``ZEROSERVE_CPU_BF16=0`` keeps ``auto`` at fp32 (the test suite sets it: fp32-exact outputs).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# rows from which a packed weight's bf16 steps read the panel: below, they multiply on the packed
# bytes in the bf16 regime (csrc/qmatmul_bf16.c: decoded to bf16 in cache, VDPBF16PS), which
# reads ~3x fewer bytes than the panel's 2 a weight; decode steps are that small, and the
# compiled decode step (services/worker/model/cpu_step.py) runs them so up to here. Prefill-sized
# steps go to oneDNN on the panels: 1.5x the packed bf16 kernel at 256 rows (SmolLM2's gate/up,
# one EPYC core, cache-hot: 5.3 vs 7.8 ms)
PANEL_MIN_ROWS = 64
NEVER = 1 << 62  # a min_rows no step reaches
# rows from which the panels are used when nothing was measured: on the AVX-512 BF16 dev box
# (2 EPYC cores, SmolLM2's 1536x576 gate/up, best of 40) bf16 took 0.09 ms at 8 rows against
# fp32's 0.17 and the packed Q4 kernel's 0.20; at 1 row the packed kernel won (0.047 vs 0.074)
DEFAULT_MIN_ROWS = 8


def turned_off() -> bool:
    """ZEROSERVE_CPU_BF16=0: `auto` never picks bf16 (explicit bfloat16 still does)."""
    return os.environ.get("ZEROSERVE_CPU_BF16", "1").lower() in ("0", "false", "no", "off")


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] float -> the bf16 panel `linear` reads: oneDNN's prepacked (blocked) layout where
    torch has it, else a plain contiguous bf16 tensor. Why prepacked: F.linear on a plain bf16
    weight re-lays it out on every call, which at decode sizes costs more than the GEMM (2 EPYC
    cores, 3072x576: 0.235 ms at 8 rows plain vs 0.150 prepacked, 0.143 vs 0.070 at 1 row)."""
    plain = w.to(torch.bfloat16).contiguous()
    if not torch.backends.mkldnn.is_available():
        return plain
    try:
        return torch.ops.mkldnn._reorder_linear_weight(plain, None)
    except (RuntimeError, AttributeError):  # a torch build without the op
        return plain


def dense(w_bf16: torch.Tensor) -> torch.Tensor:
    """A panel as a plain [N, K] bf16 tensor (for tests and the twin)."""
    return w_bf16.to_dense() if w_bf16.is_mkldnn else w_bf16


def linear(x: torch.Tensor, w_bf16: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype) @ w_bf16[N, K].T (+ bias) in bf16, returned in x's dtype;
    `w_bf16` as `pack` made it. The bias is added in fp32 after the GEMM (not rounded to bf16)."""
    xb = x.to(torch.bfloat16)
    if w_bf16.is_mkldnn:
        y = torch.ops.mkldnn._linear_pointwise(xb if xb.is_contiguous() else xb.contiguous(), w_bf16, None,
                                               "none", [], "")
    else:
        y = F.linear(xb, w_bf16)
    y = y.to(x.dtype) if x.dtype != torch.bfloat16 else y
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def linear_twin(x: torch.Tensor, w_bf16: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `linear` computes, spelled in fp32: both operands rounded to bf16, products summed in
    fp32 (here by the fp32 GEMM), the sum rounded to bf16. The reference for the tests (any CPU:
    no bf16 instruction involved)."""
    y = F.linear(x.to(torch.bfloat16).float(), dense(w_bf16).float()).to(torch.bfloat16).to(x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def attach(model: torch.nn.Module, min_rows: int = DEFAULT_MIN_ROWS) -> int:
    """Give every linear of `model` (QuantizableWeight modules: attention, MLP, LM head; the
    embedding's copy serves a tied LM head) a bf16 panel used from `min_rows` rows on. Returns
    the panels' bytes. Idempotent: a second call only changes `min_rows`."""
    from zeroserve.services.worker.model.layers import QuantizableWeight, VocabParallelEmbedding

    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    total = 0
    for m in model.modules():
        if not isinstance(m, QuantizableWeight) or (isinstance(m, VocabParallelEmbedding) and not _tied(model, m)):
            continue
        if "weight" not in m._parameters and m.qweight is None:
            continue  # a tied LM head: its embedding holds the weight (and the panel)
        if m.bf16_weight is None:
            m.bf16_weight = pack(m.float_weight(torch.float32))
        m.bf16_min_rows = min_rows
        total += m.bf16_weight.numel() * 2
    return total


def detach(model: torch.nn.Module) -> None:
    """Drop every panel: the model computes on its exact weights again."""
    for m in model.modules():
        if getattr(m, "bf16_weight", None) is not None:
            m.bf16_weight = None


def set_min_rows(model: torch.nn.Module, min_rows: int) -> None:
    for m in model.modules():
        if getattr(m, "bf16_weight", None) is not None:
            m.bf16_min_rows = min_rows


def min_rows(model: torch.nn.Module) -> int | None:
    """Rows from which `model`'s linears run on bf16 panels (None: no panels)."""
    for m in model.modules():
        if getattr(m, "bf16_weight", None) is not None:
            return m.bf16_min_rows
    return None


def _tied(model: torch.nn.Module, emb: torch.nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    return head is not None and getattr(head, "tied", False) and head.weight_module() is emb
