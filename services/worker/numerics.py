"""A worker's numeric mode: what arithmetic its model does, fixed once at start-up, never measured.

A request's tokens are a function of (model, numeric mode, prompt, sampling params, seed), so
the mode is a choice from the arguments and the hardware, logged with the reason:

- ``float32`` (`--dtype float32`, and `auto` where bf16 would not be native or the checkpoint
  is fp32): every linear runs on the compiled kernel (kernels/csrc/qmatmul.c) in fp32 --
  packed weights in their format, float weights through its "f32" view of the parameter
  (torch's fp32 GEMM rounds row 0 of a 1-row call differently from a 4-row one). Exact: greedy
  output equals HF's fp32.
- ``bfloat16`` (`--dtype bfloat16` / `--matmul-dtype bfloat16`, and `auto` on a CPU that
  multiplies bf16 natively when the checkpoint is not fp32): every linear in the kernel's bf16
  regime (x and w rounded to bf16, products summed in fp32, y fp32) at every row count;
  activations, norms and attention stay fp32. The float linears' weights are held in bf16
  (half the bytes; the same bits: the regime rounds them anyway).

What `auto` picks on a CPU is a rule on two facts that do not change between starts: whether
this kernel build multiplies bf16 natively (AVX-512 BF16's VDPBF16PS; the build is part of the
mode's name) and the checkpoint's dtype (ModelConfig.torch_dtype: a bf16/f16 checkpoint or a
quantized GGUF was not made to be computed in fp32; an fp32 one was). bf16 where both hold: the
regime is batch-invariant like fp32 and ~1.75x its throughput on such a CPU (SmolLM2 Q4_1, 16
concurrent: benchmarks/cpu_dtype.py, docs/benchmarks.md), which is also what vLLM's CPU default
computes. It is not exact against HF's fp32 (greedy ties break differently): `--dtype float32`
is, on every CPU. A host without native bf16 computes `auto` in fp32, so a cluster that mixes
such hosts mixes modes, and the scheduler refuses the second (below); give `--dtype` there.

In both modes a row's arithmetic is the same at any batch size, chunking or thread count (the
kernel has one per-row reduction order; there is no row-count threshold between kernels). It
does depend on the kernel build (vector width: AVX-512 vs AVX2 vs portable) and, in bf16, on
whether the CPU multiplies bf16 natively (VDPBF16PS sums pairs of products; the emulated path
sums one product at a time: other bits, tests/kernels/test_quant_bf16.py shows it). So the
mode's name (`mode_name`) carries the build, the bf16 path, the KV cache dtype and the weight
format; the worker sends it in its HELLO and the scheduler lets only one mode serve a model
(services/scheduler/groups.py), which keeps failover and restarts exact.

On a GPU the mode is the torch dtype and the device (Triton / torch kernels, no claim of batch
invariance yet).
"""

from __future__ import annotations

import torch

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.log import get_logger
from zeroserve.kernels import cpu_native
from zeroserve.kernels.quant import QuantizedWeight
from zeroserve.services.worker.dtype import requested, wants_bf16
from zeroserve.services.worker.model.layers import QuantizableWeight, VocabParallelEmbedding
from zeroserve.services.worker.model.moe import Router

log = get_logger("worker.numerics")

MATMUL_DTYPES = ("auto", "float32", "bfloat16")


def matmul_name(matmul_dtype: str | None) -> str:
    """A user's --matmul-dtype, normalized (None = "auto")."""
    return str(matmul_dtype or "auto").strip().lower()


def matmul_choice(matmul_dtype: str | None, dtype: str | torch.dtype, native_bf16: bool = False,
                  checkpoint_dtype: str = "float32") -> tuple[str, str]:
    """("float32" | "bfloat16", why) for a CPU fp32 model: a rule on the arguments, whether the
    kernel build multiplies bf16 natively and the checkpoint's dtype (module docstring)."""
    name = matmul_name(matmul_dtype)
    if name not in MATMUL_DTYPES:
        raise ModelLoadError(f"unsupported matmul_dtype {name!r}; use one of {MATMUL_DTYPES}")
    asked = requested(dtype)
    if name != "auto":
        if asked in (torch.float32, torch.bfloat16) and asked != {"float32": torch.float32,
                                                                   "bfloat16": torch.bfloat16}[name]:
            # --dtype float32 promises float32 in every matmul: a contradiction is refused, not resolved
            raise ModelLoadError(f"--dtype {dtype} and --matmul-dtype {name} contradict each other; "
                                 "give one of them (or --dtype auto)")
        return name, f"--matmul-dtype {name}"
    if wants_bf16(dtype):
        return "bfloat16", "--dtype bfloat16 (on a CPU: the bf16 matmul regime, fp32 elsewhere)"
    if asked is torch.float32:
        return "float32", "--dtype float32: float32 in every matmul, exact against HF fp32"
    if not native_bf16:
        return "float32", ("auto on a CPU without native bf16: float32, exact against HF fp32 "
                           "(--dtype bfloat16 for the emulated bf16 regime)")
    if checkpoint_dtype == "float32":
        return "float32", "auto with an fp32 checkpoint: float32, exact against HF fp32 (--dtype bfloat16 to opt in)"
    return "bfloat16", (f"auto on a CPU with native bf16 and a {checkpoint_dtype} checkpoint: the bf16 regime "
                        "(batch-invariant, ~1.75x fp32's throughput); --dtype float32 for HF fp32's exact tokens")


def configure(runner) -> str:
    """Fix `runner.model`'s arithmetic from the runner's args; sets `runner.numeric_mode` and
    returns the matmul dtype ("float32" / "bfloat16" on a CPU, the torch dtype elsewhere)."""
    args, model = runner.args, runner.model
    if runner.device.type != "cpu" or runner.dtype != torch.float32:
        name = str(runner.dtype).removeprefix("torch.")
        if matmul_name(getattr(args, "matmul_dtype", None)) == "bfloat16":
            log.warning("matmul_dtype bfloat16 applies to float32 models on a CPU only; ignored",
                        device=str(runner.device), dtype=name)
        if runner.device.type == "cpu":
            log.warning("float16 on a CPU runs torch's kernels: a row's rounding can depend on the batch",
                        dtype=name)
        runner.numeric_mode = f"{name}/{runner.device.type}-torch"
        log.info("numeric mode", mode=runner.numeric_mode, why=f"--dtype {args.dtype} on {runner.device}")
        return name
    lib = cpu_native.quant_lib()
    matmul, why = matmul_choice(getattr(args, "matmul_dtype", "auto"), args.dtype,
                                native_bf16=lib is not None and lib.bf16_native,
                                checkpoint_dtype=str(runner.cfg.torch_dtype).removeprefix("torch."))
    # bf16 weights where the mode came from the dtype (asked or auto), not from --matmul-dtype alone
    chosen_by_auto = matmul_name(getattr(args, "matmul_dtype", None)) == "auto"
    hold_bf16 = matmul == "bfloat16" and (wants_bf16(args.dtype) or chosen_by_auto)
    on_torch = apply(model, matmul == "bfloat16", hold_bf16=hold_bf16, kernels=lib is not None)
    runner.numeric_mode = mode_name(matmul, lib, runner.kv_dtype, getattr(args, "quantization", None), on_torch,
                                    attention=runner.backend)
    if on_torch:
        log.warning("some linears run on torch's GEMM, whose rounding of a row can depend on the batch",
                    linears=on_torch, reason=cpu_native.quant_unavailable_reason() or "K not a multiple of 32")
    log.info("numeric mode", mode=runner.numeric_mode, why=why, cpu=cpu_native.cpu_model(),
             native_bf16=cpu_native.native_bf16())
    return matmul


def apply(model: torch.nn.Module, bf16: bool, hold_bf16: bool = False, kernels: bool = True) -> int:
    """Route every linear of `model` through the compiled kernel, in the bf16 regime when `bf16`
    (MoE routers stay fp32: they pick experts); `hold_bf16`: keep the float linears' weights in
    bf16 (the embedding keeps its fp32 rows for lookups). Returns how many linears stay on torch
    (no kernels, or K not a multiple of 32)."""
    on_torch = 0
    for m in model.modules():
        if not isinstance(m, (QuantizableWeight, Router)):
            continue
        if isinstance(m, QuantizableWeight):
            m.bf16_matmul = bf16
            if m.qweight is not None or "weight" not in m._parameters:
                continue  # packed already, or a tied LM head (its embedding holds the weight)
        w = m.weight
        if not kernels or w.dim() != 2 or w.shape[1] % 32 or w.dtype != torch.float32 or not w.is_cpu:
            on_torch += 1
            continue
        if hold_bf16 and not isinstance(m, (VocabParallelEmbedding, Router)):
            m.set_quantized(QuantizedWeight.from_float(w[:m.packed_shape()[0]], "bf16"))  # real vocab rows
        else:
            m.kernel_weight = QuantizedWeight.from_float(w)  # a view: no copy
    return on_torch


def mode_name(matmul: str, lib, kv_dtype: torch.dtype, quantization: str | None, on_torch: int = 0,
              attention: str = "cpu") -> str:
    """What a CPU worker computes, as one comparable string: matmul dtype / kernel build (and bf16
    path) / KV cache dtype / weight format, e.g. "float32/cpu-avx512/kv-float32/weights-auto".
    Linears left on torch (`on_torch` of them) add "torch-linears" without the count: which ones
    follows from their shapes and the build, and a pipeline stage holds only some of the model's
    linears, so a count would tell its stages (and a pp=1 group) apart where they compute alike.
    Another attention backend than the per-row kernel adds "attention-NAME"."""
    if lib is None:
        build = "cpu-torch"
    else:
        build = f"cpu-{lib.isa}"
        if matmul == "bfloat16":
            build += "-vdpbf16ps" if lib.bf16_native else "-emulated"
    parts = [matmul, build, "kv-" + str(kv_dtype).removeprefix("torch."), f"weights-{quantization or 'auto'}"]
    if on_torch:
        parts.append("torch-linears")
    if attention != "cpu":  # --attention-backend torch: the padded SDPA twin, not per-row
        parts.append(f"attention-{attention}")
    return "/".join(parts)
