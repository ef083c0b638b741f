"""The attention and MLP blocks every decoder layer is made of (llama.DecoderLayer and
post_norm.PostNormDecoderLayer): q/k/v projections with the families' bias, per-head q/k norms,
RoPE and paged attention; the gated MLP with the family's activation.
"""

from __future__ import annotations

from torch import nn

from zeroserve.common.model_config import ModelConfig
from zeroserve.services.worker.model.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    TPInfo,
    WeightSource,
    divide,
)
from zeroserve.services.worker.model.moe import ShardedRMSNorm


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, tp: TPInfo, ops, rotary: RotaryEmbedding, device, dtype,
                 window: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.window = window  # sliding window of this layer (None = full attention)
        self.softcap = cfg.attn_logit_softcap
        self.ops = ops
        self.prefix = prefix
        d = cfg.head_dim
        self.head_dim = d
        self.num_heads = divide(cfg.num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = divide(cfg.num_kv_heads, tp.size, "num_key_value_heads")
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.scale = d ** -0.5 if cfg.attention_scale is None else cfg.attention_scale
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], tp,
            cfg.attention_bias, device, dtype,
            part_names=["q_proj (num_attention_heads*head_dim)", "k_proj (num_key_value_heads*head_dim)",
                        "v_proj (num_key_value_heads*head_dim)"],
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, tp, device, dtype,
                                        what="o_proj input (num_attention_heads*head_dim)", bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        off = cfg.norm_weight_offset
        self.qk_norm_full = cfg.qk_norm_full  # OLMo 2, OLMoE: over the whole projection (all heads of all shards)
        self.clip_qkv = cfg.clip_qkv
        if cfg.qk_norm_full:
            self.q_norm = ShardedRMSNorm(self.q_size, cfg.num_heads * d, cfg.rms_norm_eps, tp, device, dtype)
            self.k_norm = ShardedRMSNorm(self.kv_size, cfg.num_kv_heads * d, cfg.rms_norm_eps, tp, device, dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, ops, device, dtype, offset=off)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, ops, device, dtype, offset=off)
        self._rotary = [rotary]  # shared across layers; a list keeps it out of submodules

    def forward(self, positions, hidden, kv_cache, meta):
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_norm:
            q = self.q_norm(q.reshape(t * self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(t * self.num_kv_heads, self.head_dim))
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self._rotary[0](positions, q, k)
        k_cache, v_cache = kv_cache
        self.ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if self.window is None and self.softcap is None:
            out = self.ops.paged_attention(q, k_cache, v_cache, meta, self.scale)
        else:
            out = self.ops.paged_attention(q, k_cache, v_cache, meta, self.scale,
                                           sliding_window=self.window, softcap=self.softcap)
        return self.o_proj(out.reshape(t, self.q_size))

    def weight_sources(self) -> dict[str, list[WeightSource]]:
        p = self.prefix
        names = [f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"]
        qkv = (self.qkv_proj.fused_sources(f"{p}.qkv_proj.weight") if self.cfg.fused_qkv
               else self.qkv_proj.sources([n + ".weight" for n in names], "weight"))
        out = {
            "qkv_proj.weight": qkv,
            "o_proj.weight": self.o_proj.sources(f"{p}.o_proj.weight"),
        }
        if self.qkv_proj.bias is not None:
            out["qkv_proj.bias"] = self.qkv_proj.sources([n + ".bias" for n in names], "bias")
        if self.o_proj.bias is not None:
            out["o_proj.bias"] = self.o_proj.bias_sources(f"{p}.o_proj.bias")
        if self.qk_norm or self.qk_norm_full:
            out["q_norm.weight"] = self.q_norm.sources(f"{p}.q_norm.weight")
            out["k_norm.weight"] = self.k_norm.sources(f"{p}.k_norm.weight")
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, tp: TPInfo, ops, device, dtype):
        super().__init__()
        self.ops = ops
        self.prefix = prefix
        self.fused = cfg.fused_gate_up
        self.act_and_mul = ops.gelu_tanh_and_mul if cfg.hidden_act == "gelu_tanh" else ops.silu_and_mul
        i = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [i, i], tp, False, device, dtype,
                                                 part_names=["intermediate_size", "intermediate_size"])
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, tp, device, dtype, what="intermediate_size")

    def forward(self, x):
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def weight_sources(self) -> dict[str, list[WeightSource]]:
        p = self.prefix
        gate_up = (self.gate_up_proj.fused_sources(f"{p}.gate_up_proj.weight") if self.fused
                   else self.gate_up_proj.sources([f"{p}.gate_proj.weight", f"{p}.up_proj.weight"]))
        return {
            "gate_up_proj.weight": gate_up,
            "down_proj.weight": self.down_proj.sources(f"{p}.down_proj.weight"),
        }
