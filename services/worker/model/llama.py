"""Our decoder for the Llama family (Llama 2/3, Mistral), Qwen2 and Qwen3.

One flat batch per forward: `input_ids[T]`, `positions[T]` and the paged-KV metadata describe
prefill chunks and decode tokens of many requests mixed; nothing here loops over requests.
Mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE) swap the MLP of their sparse layers
for services/worker/model/moe.py's block.
The differences between the families are switches read from ModelConfig:
`attention_bias` (Qwen2 q/k/v bias), `qk_norm` (Qwen3 per-head RMSNorm before RoPE) and
`tie_word_embeddings`; the dense families of common/dense_families.py add the activation,
norm offset and layout (post_norm.py holds the Gemma / OLMo 2 layer), multipliers, soft-caps,
per-layer sliding windows and RoPE bases, whole-projection q/k norms and fused checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn

from zeroserve.common.model_config import ModelConfig
from zeroserve.services.worker.model.layers import (
    ParallelLMHead,
    QuantizableWeight,
    RMSNorm,
    RotaryEmbedding,
    TPInfo,
    VocabParallelEmbedding,
    WeightSource,
    divide,
)
from zeroserve.services.worker.model.blocks import MLP, Attention
from zeroserve.services.worker.model.moe import SparseMoeBlock, moe_prefix
from zeroserve.services.worker.pipeline import StageInfo


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, tp: TPInfo, ops, rotary, device, dtype,
                 expert_parallel: bool = False):
        super().__init__()
        prefix = f"model.layers.{idx}"
        self.prefix = prefix
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, device, dtype)
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", tp, ops, rotary, device, dtype,
                                   window=cfg.layer_window(idx))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, device, dtype)
        if cfg.is_moe_layer(idx):  # mixture of experts: services/worker/model/moe.py
            self.mlp = SparseMoeBlock(cfg, moe_prefix(cfg, prefix), tp, ops, device, dtype, expert_parallel)
        else:
            self.mlp = MLP(cfg, f"{prefix}.mlp", tp, ops, device, dtype)
        self.residual_multiplier = cfg.residual_multiplier  # Granite: block outputs scaled before the add

    def forward(self, positions, hidden, residual, kv_cache, meta):
        # pre-norm block with the residual add fused into the next norm
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual

    def weight_sources(self) -> dict[str, list[WeightSource]]:
        out = {
            "input_layernorm.weight": self.input_layernorm.sources(f"{self.prefix}.input_layernorm.weight"),
            "post_attention_layernorm.weight":
                self.post_attention_layernorm.sources(f"{self.prefix}.post_attention_layernorm.weight"),
        }
        out.update({f"self_attn.{k}": v for k, v in self.self_attn.weight_sources().items()})
        out.update({f"mlp.{k}": v for k, v in self.mlp.weight_sources().items()})
        return out


class CausalLM(nn.Module):
    """Decoder-only LM over a paged KV cache; see the package docstring for the interface.

    A pipeline stage (pp_size > 1, services/worker/pipeline.py) holds only its layers (`layers[i]`
    is global layer `stage.layers[i]`), the embedding on the first stage and the final norm and
    LM head on the last; the others are None."""

    lora_ctx = None  # services/worker/lora.py's LoRAContext, when adapters are enabled

    def __init__(self, cfg: ModelConfig, device, dtype: torch.dtype, ops,
                 tp_rank: int = 0, tp_size: int = 1, tp_group=None, expert_parallel: bool = False,
                 pp_rank: int = 0, pp_size: int = 1):
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        self.cfg = cfg
        self.ops = ops
        self.tp = TPInfo(tp_rank, tp_size, tp_group)
        self.device = torch.device(device)
        self.dtype = dtype
        # validate every split up front so the error names the config value
        divide(cfg.num_heads, tp_size, "num_attention_heads")
        divide(cfg.num_kv_heads, tp_size, "num_key_value_heads")
        divide(cfg.intermediate_size, tp_size, "intermediate_size")
        self.stage = StageInfo.of(cfg.num_layers, pp_rank, pp_size)
        self.num_layers = len(self.stage.layers)  # this stage's (its KV cache has as many)
        self.num_heads = cfg.num_heads // tp_size
        self.num_kv_heads = cfg.num_kv_heads // tp_size
        self.head_dim = cfg.head_dim
        self.vocab_size = cfg.vocab_size

        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, ops, self.device)
        # Gemma 3: the sliding layers rotate with their own base (plain RoPE)
        self.rotary_local = (RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_local_theta,
                                             None, ops, self.device) if cfg.rope_local_theta is not None else None)
        first, last = self.stage.first, self.stage.last
        # the last stage of a tied model holds the embedding as its LM head's weight
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.tp, self.device, dtype)
                             if first or (last and cfg.tie_word_embeddings) else None)
        layer_cls = DecoderLayer
        if cfg.norm_layout != "pre":
            from zeroserve.services.worker.model.post_norm import PostNormDecoderLayer as layer_cls
        self.layers = nn.ModuleList(
            layer_cls(cfg, i, self.tp, ops,
                      self.rotary_local if self.rotary_local is not None and cfg.layer_window(i) else self.rotary,
                      self.device, dtype, expert_parallel)
            for i in self.stage.layers
        )
        self.norm = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, self.device, dtype,
                             offset=cfg.norm_weight_offset) if last else None)
        self.lm_head = (ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.tp, self.device, dtype,
                                       tied_to=self.embed_tokens if cfg.tie_word_embeddings else None)
                        if last else None)
        # what a stage passes on besides the hidden states: pre-norm layers carry the residual
        # stream (its add is fused into the next norm); post-norm layers fold it into hidden
        self.carries_residual = cfg.norm_layout == "pre"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta, intermediate=None):
        """input_ids[T], positions[T] -> final-normed hidden states [T, hidden].

        A pipeline stage after the first starts from `intermediate` = (hidden, residual) as the
        previous stage returned them (input_ids unused); a stage before the last returns
        (hidden, residual) instead of normed states."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} (k_cache, v_cache) pairs, got {len(kv_caches)}")
        positions = self.rotary.rope_positions(positions, meta)  # LongRoPE: short or long rows
        if intermediate is not None:
            hidden, residual = intermediate
        else:
            hidden, residual = self.embed_tokens(input_ids), None
            if self.cfg.embedding_multiplier != 1.0:  # Gemma sqrt(hidden), Granite embedding_multiplier
                hidden = hidden * self.cfg.embedding_multiplier
            step = self._cpu_step()
            lora = self.lora_ctx.batch if self.lora_ctx is not None else None  # this step's adapter rows
            if step is not None and (lora is None or step.has_lora) and step.applies(meta, hidden, kv_caches):
                return step(hidden, positions, kv_caches, meta, lora)  # the same layers, in one compiled call
        for layer, kv in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv, meta)
        if not self.stage.last:
            return hidden, residual
        if residual is None:  # zero layers, or post-norm layers
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def set_cpu_step(self, enabled: bool) -> None:
        """Use the compiled decode step where it applies (the default), or always the layers
        here (to measure what the step saves; like ZEROSERVE_CPU_STEP=0 for one model)."""
        if enabled:
            self.__dict__.pop("_step", None)  # rebuilt on the next forward
        else:
            self._step = None

    def _cpu_step(self):
        """The compiled decode step for this model (built on first use, after the weights are
        loaded and packed), or None where it does not apply."""
        if not hasattr(self, "_step"):
            from zeroserve.services.worker.model.cpu_step import CpuDecodeStep

            self._step = CpuDecodeStep.build(self)
        return self._step

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden[N, H] -> logits[N, vocab_size] float32 over the full vocabulary."""
        logits = self.lm_head(hidden)
        if self.cfg.logits_scaling != 1.0:  # Granite
            logits = logits / self.cfg.logits_scaling
        cap = self.cfg.final_logit_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def quantizable(self) -> dict[str, QuantizableWeight]:
        """Parameter name -> the module holding it, for every weight that may be packed: the
        decoder's linears, the embedding and (untied) the LM head."""
        return {f"{name}.weight": m for name, m in self.named_modules()
                if isinstance(m, QuantizableWeight) and not getattr(m, "tied", False)}

    def weight_bytes(self) -> int:
        """Bytes the weights occupy: float parameters plus packed weights (each counted once)."""
        n = sum(p.numel() * p.element_size() for p in self.parameters())
        return n + sum(m.qweight.nbytes for m in self.quantizable().values() if m.qweight is not None)

    def quant_summary(self) -> dict[str, int]:
        """Weight format -> how many of `quantizable()` hold it ("float" for unpacked ones)."""
        out: dict[str, int] = {}
        for m in self.quantizable().values():
            key = m.qweight.format if m.qweight is not None else "float"
            out[key] = out.get(key, 0) + 1
        return out

    def weight_sources(self) -> dict[str, list[WeightSource]]:
        """Our parameter name -> checkpoint pieces that fill it (this shard's slices only)."""
        out = {}
        if self.embed_tokens is not None:
            out["embed_tokens.weight"] = self.embed_tokens.sources("model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):  # local index i; the layer's prefix names its global one
            out.update({f"layers.{i}.{k}": v for k, v in layer.weight_sources().items()})
        if self.stage.last:
            out["norm.weight"] = self.norm.sources("model.norm.weight")
            if not self.cfg.tie_word_embeddings:
                out["lm_head.weight"] = self.lm_head.sources("lm_head.weight")
        return out
