"""The decoder layer of the families that normalize block *outputs*: Gemma 2/3 ("sandwich":
a norm before and after both attention and MLP) and OLMo 2 ("post": after only).

    Gemma 2/3: h = h + post_attn_norm(attn(input_norm(h)));  h = h + post_ff_norm(mlp(pre_ff_norm(h)))
    OLMo 2:    h = h + post_attn_norm(attn(h));              h = h + post_ff_norm(mlp(h))

The residual add cannot be fused into the next norm as in llama.DecoderLayer (the normed value
is the block's output, not the stream), so each layer returns the full stream and no separate
residual; CausalLM then applies the final norm to it. Attention and MLP are blocks.py's, as llama.py's are.
"""

from __future__ import annotations

from torch import nn

from zeroserve.common.model_config import ModelConfig
from zeroserve.services.worker.model.layers import RMSNorm, TPInfo, WeightSource
from zeroserve.services.worker.model.blocks import MLP, Attention


class PostNormDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, tp: TPInfo, ops, rotary, device, dtype, expert_parallel: bool = False):
        super().__init__()
        prefix = f"model.layers.{idx}"
        self.prefix = prefix
        h, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset
        self.pre = cfg.norm_layout == "sandwich"
        if cfg.norm_layout not in ("sandwich", "post"):
            raise ValueError(f"norm_layout {cfg.norm_layout!r} is not a post-norm layout")

        def norm():
            return RMSNorm(h, eps, ops, device, dtype, offset=off)

        if self.pre:
            self.input_layernorm = norm()
            self.pre_feedforward_layernorm = norm()
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", tp, ops, rotary, device, dtype,
                                   window=cfg.layer_window(idx))
        self.post_attention_layernorm = norm()
        self.mlp = MLP(cfg, f"{prefix}.mlp", tp, ops, device, dtype)
        self.post_feedforward_layernorm = norm()

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is not None:  # never from a model of these layers; kept for the interface
            hidden = hidden + residual
        x = self.input_layernorm(hidden) if self.pre else hidden
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, meta))
        x = self.pre_feedforward_layernorm(hidden) if self.pre else hidden
        hidden = hidden + self.post_feedforward_layernorm(self.mlp(x))
        return hidden, None

    def weight_sources(self) -> dict[str, list[WeightSource]]:
        names = ["post_attention_layernorm", "post_feedforward_layernorm"]
        if self.pre:
            names += ["input_layernorm", "pre_feedforward_layernorm"]
        out = {f"{n}.weight": getattr(self, n).sources(f"{self.prefix}.{n}.weight") for n in names}
        out.update({f"self_attn.{k}": v for k, v in self.self_attn.weight_sources().items()})
        out.update({f"mlp.{k}": v for k, v in self.mlp.weight_sources().items()})
        return out
