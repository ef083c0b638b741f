"""The decode forward of a packed model in one compiled call (kernels/csrc/decode_step.c).

At batch 1 on CPU the Python forward spends as much time dispatching ~300 small calls per step
as the matmuls take; `CpuDecodeStep` hands the layer loop to C instead, for the steps where
every token decodes. It reads the model's own parameters and packed weights (nothing copied)
and runs the same kernels in the same order (in the model's numeric mode: fp32, or the bf16
regime at every row count, as QuantizableWeight.matmul), so its hidden states equal the Python
path's bit for bit, and whether a step runs here never changes a token: prefill and mixed
steps, GPUs, tensor and pipeline parallelism, float (unpacked) linears and machines without the
compiled kernels stay on the Python path, and so do models that are not the plain Llama/Qwen
shape (`ModelConfig.llama_shape`: sliding windows, soft-caps, GeGLU, other norm layouts, ...).

With LoRA adapters attached (services/worker/lora.py) the step adds each row's adapter delta
after every linear, through the same per-row kernel as the Python path (csrc/lora.c), so steps
that mix adapters stay on the compiled path with the same bits.

``ZEROSERVE_CPU_STEP=0`` turns it off (to measure what it saves).
"""

from __future__ import annotations

import ctypes
import os

import torch

from zeroserve.kernels.metadata import AttentionMetadata
from zeroserve.kernels import cpu_native
from zeroserve.kernels.quant import QuantizedWeight

# word layout of decode_step.c's descriptor (its enums)
G_BLOCK, G_SLOTS, G_QMM_BF16, G_BF16, G_WORDS = 13, 14, 15, 16, 20
LIN_WORDS, LO_WORDS, L_WORDS = 8, 4, 54
L_K_CACHE, L_V_CACHE = 36, 37


def _turned_off() -> bool:
    return os.environ.get("ZEROSERVE_CPU_STEP", "1").lower() in ("0", "false", "no", "off")


def _fn(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _lin(qw: QuantizedWeight, bias: torch.Tensor | None) -> list[int]:
    fmt, w, w_stride, sc, mn, s_stride, group = qw._kargs
    return [fmt, w, w_stride, sc or 0, mn or 0, s_stride, group, bias.data_ptr() if bias is not None else 0]


def _lora(module, keep: list) -> list[int]:
    """A linear's LoRA slot words (A^T, B^T, part bounds, parts), zeros without adapters."""
    lin = module.lora
    if lin is None:
        return [0] * LO_WORDS
    bounds = torch.tensor(lin.bounds, dtype=torch.int64)
    keep.append(bounds)
    return [lin.at.data_ptr(), lin.bt.data_ptr(), bounds.data_ptr(), len(lin.bounds) - 1]


class CpuDecodeStep:
    """Built by `build(model)` when the model qualifies; `applies` says whether a step does."""

    def __init__(self, model, step_lib: ctypes.CDLL) -> None:
        cfg = model.cfg
        self.lib = step_lib
        a0 = model.layers[0].self_attn if model.num_layers else None
        cos_sin = model.rotary.cos_sin_cache
        self._keep = [cos_sin]  # the rotary module may swap its table (device moves): ours stays valid
        g = [model.num_layers, cfg.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim,
             cfg.intermediate_size, cos_sin.shape[1], cos_sin.shape[0], cos_sin.data_ptr(), int(cfg.qk_norm),
             model.norm.weight.data_ptr(), _fn(cpu_native.quant_lib(), "zs_qmatmul_f32_part"),
             _fn(cpu_native.decode_lib(), "zs_paged_decode_f32_part"), 0, 0,  # block size, slots: per cache
             _fn(cpu_native.quant_lib(), "zs_qmatmul_bf16_part"), 0]  # G_BF16: per call
        ctx = model.lora_ctx  # LoRA: the slots' scalings, rank and count
        lin0 = model.layers[0].self_attn.qkv_proj.lora if model.num_layers else None
        self.has_lora = ctx is not None and lin0 is not None
        g += [ctx.scale.data_ptr(), lin0.rank, ctx.scale.shape[0]] if self.has_lora else [0, 0, 0]
        assert len(g) == G_WORDS
        self.g = torch.tensor(g, dtype=torch.int64)
        self.f = torch.tensor([cfg.rms_norm_eps, a0.scale if a0 is not None else 1.0], dtype=torch.float32)
        rows = []
        for layer in model.layers:
            at, mlp = layer.self_attn, layer.mlp
            row = (_lin(at.qkv_proj.qweight, at.qkv_proj.bias) + _lin(at.o_proj.qweight, at.o_proj.bias)
                   + _lin(mlp.gate_up_proj.qweight, None) + _lin(mlp.down_proj.qweight, None))
            row += [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                    at.q_norm.weight.data_ptr() if at.qk_norm else 0,
                    at.k_norm.weight.data_ptr() if at.qk_norm else 0, 0, 0]
            for m in (at.qkv_proj, at.o_proj, mlp.gate_up_proj, mlp.down_proj):
                row += _lora(m, self._keep)
            assert len(row) == L_WORDS
            rows.append(row)
        self.layers = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), L_WORDS)
        self._caches_key = None
        # the numeric mode (services/worker/numerics.py) is set after the model is built
        self._mode_of = model.layers[0].mlp.gate_up_proj if model.num_layers else None

    @classmethod
    def build(cls, model) -> CpuDecodeStep | None:
        """The step for `model`, or None when it does not qualify (see the module docstring)."""
        from zeroserve.kernels import cpu_ops

        if (_turned_off() or model.ops is not cpu_ops or model.device.type != "cpu" or model.dtype != torch.float32
                or model.tp.size != 1 or model.stage.size != 1 or not model.cfg.llama_shape or model.cfg.is_moe or model.cfg.qk_norm_full):
            return None  # decode_step.c computes the plain Llama/Qwen layer only (no window, cap, GeGLU, MoE, ...)
        for layer in model.layers:
            mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if any(m.qweight is None or (m.bias is not None and m.bias.dtype != torch.float32) for m in mods):
                return None
        lib = cpu_native.step_lib()
        if lib is None or cpu_native.quant_lib() is None or cpu_native.decode_lib() is None:
            return None
        probe_q = torch.empty(1, model.num_heads, model.head_dim)
        probe_k = torch.empty(1, 1, model.num_kv_heads, model.head_dim)
        if not cpu_native.supports(probe_q, probe_k):  # GQA group or head_dim past the kernel's limits
            return None
        return cls(model, lib)

    def applies(self, meta: AttentionMetadata, hidden: torch.Tensor, kv_caches) -> bool:
        """Every row one decode token of its own request, fp32 caches the kernels can read."""
        t = hidden.shape[0]
        if meta.max_query_len > 1 or meta.block_tables.shape[0] != t or t == 0 or not hidden.is_contiguous():
            return False
        k0 = kv_caches[0][0] if kv_caches else None
        return k0 is None or (k0.dtype == torch.float32 and k0.is_contiguous())

    def _bind_caches(self, kv_caches) -> None:
        # keyed by the caches' addresses, not the list's id(): a new list may reuse a freed one's
        # id, and stale pointers would write into freed memory (~60 data_ptr() calls, a few us)
        key = (tuple(t.data_ptr() for kv in kv_caches for t in kv), tuple(kv_caches[0][0].shape)) if kv_caches \
            else None
        if key == self._caches_key:
            return
        if kv_caches:
            for i, (k, v) in enumerate(kv_caches):
                if not (k.is_contiguous() and v.is_contiguous()) or k.shape != v.shape:
                    raise ValueError("the paged KV cache must be contiguous, K and V alike")
                self.layers[i, L_K_CACHE] = k.data_ptr()
                self.layers[i, L_V_CACHE] = v.data_ptr()
            nb, bs = kv_caches[0][0].shape[:2]
            self.g[G_BLOCK], self.g[G_SLOTS] = bs, nb * bs
        self._caches_key = key

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata,
                 lora=None):
        """hidden [T, H] token embeddings -> final-normed hidden states (in place); `lora`: the
        step's kernels.lora.LoRABatch (needs `has_lora`), or None."""
        self._bind_caches(kv_caches)
        self.g[G_BF16] = int(self._mode_of is not None and self._mode_of.bf16_matmul)
        t = hidden.shape[0]
        pos = positions.long().contiguous()
        slots = meta.slot_mapping.long().contiguous()
        bt = meta.block_tables.to(torch.int32).contiguous()
        sl = meta.seq_lens.to(torch.int32).contiguous()
        lora_slots = lora.slots.contiguous() if lora is not None else None
        rc = self.lib.zs_decode_step_f32(self.g.data_ptr(), self.f.data_ptr(), self.layers.data_ptr(),
                                         hidden.data_ptr(), pos.data_ptr(), slots.data_ptr(), bt.data_ptr(),
                                         bt.stride(0), sl.data_ptr(), t, torch.get_num_threads(),
                                         lora_slots.data_ptr() if lora_slots is not None else None)
        if rc != 0:
            raise ValueError(f"decode step kernel failed (rc {rc}): a position past the rotary table, "
                             "a slot past the KV cache, an adapter slot past the table, or out of memory")
        return hidden
