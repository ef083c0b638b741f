"""config.json -> ModelConfig switches for the dense families beyond Llama/Qwen.

`family_fields(arch, hf, source)` returns the ModelConfig fields one architecture sets (what the
model code in services/worker/model/ reads); model_config.from_hf_dict merges them in. Each
family is a few lines here rather than a branch inside the shared parser, so a new family is
one entry in DENSE_ARCHITECTURES plus one function.

What each family needs (as transformers' modules compute it):
- Gemma 2: GeGLU (gelu tanh), RMSNorm scaled by (1 + w), embeddings x sqrt(hidden), scale
  query_pre_attn_scalar**-0.5, tanh soft-capping of attention logits and final logits,
  sliding window on the layers `layer_types` marks, norms before and after each block.
- Gemma 3 text: Gemma 2 plus per-head q/k norms and a separate RoPE base for sliding layers.
- Phi-3: fused qkv_proj / gate_up_proj checkpoints, LongRoPE.
- Granite: embedding / residual / attention multipliers, logits divided by logits_scaling.
- OLMo 2: norms after attention and MLP only, q/k RMSNorm over the whole projection.
"""

from __future__ import annotations

from typing import Any

from zeroserve.common.errors import ModelLoadError

# architecture name -> family
DENSE_ARCHITECTURES: dict[str, str] = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
}

SLIDING, FULL = "sliding_attention", "full_attention"


def _num(hf: dict[str, Any], key: str, default: float | None, source: str) -> float | None:
    v = hf.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ModelLoadError(f"{source}: key {key!r} must be a positive number, got {v!r}")
    return float(v)


def layer_types(hf: dict[str, Any], num_layers: int, source: str, default_pattern: int) -> list[str]:
    """Per-layer "sliding_attention" / "full_attention": config's `layer_types`, or every
    `default_pattern`-th layer full (Gemma 2: 2, odd layers full; Gemma 3: 6)."""
    lt = hf.get("layer_types")
    if lt is None:
        pattern = int(hf.get("sliding_window_pattern") or default_pattern)
        lt = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if not isinstance(lt, list) or len(lt) != num_layers or any(t not in (SLIDING, FULL) for t in lt):
        raise ModelLoadError(f"{source}: key 'layer_types' must list {num_layers} entries of "
                             f"{SLIDING!r} / {FULL!r}, got {lt!r}")
    return list(lt)


def _gemma(hf: dict[str, Any], num_layers: int, source: str, pattern: int) -> dict[str, Any]:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{source}: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention=true is not supported")
    lt = layer_types(hf, num_layers, source, pattern)
    window = hf.get("sliding_window")
    if SLIDING in lt and not window:
        raise ModelLoadError(f"{source}: layer_types has sliding layers but key 'sliding_window' is not set")
    return dict(
        hidden_act="gelu_tanh",
        norm_weight_offset=1.0,
        norm_layout="sandwich",
        embedding_multiplier=float(hf["hidden_size"]) ** 0.5,
        attention_scale=_num(hf, "query_pre_attn_scalar", 256, source) ** -0.5,
        attn_logit_softcap=_num(hf, "attn_logit_softcapping", None, source),
        final_logit_softcap=_num(hf, "final_logit_softcapping", None, source),
        layer_types=lt,
        sliding_window=int(window) if SLIDING in lt else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),  # Gemma's default
    )


def gemma3_rope(hf: dict[str, Any], source: str) -> tuple[dict[str, Any], float]:
    """-> (config with the full layers' rope as plain keys, the sliding layers' rope theta).

    transformers 5 writes rope_parameters = {"sliding_attention": {...}, "full_attention": {...}};
    4.x writes rope_theta / rope_scaling (global) and rope_local_base_freq (local)."""
    params = hf.get("rope_parameters")
    out = dict(hf)
    if isinstance(params, dict) and FULL in params:
        local = params.get(SLIDING) or {}
        if (local.get("rope_type") or "default") != "default":
            raise ModelLoadError(f"{source}: rope_parameters.{SLIDING} must be default RoPE, got {local!r}")
        out["rope_parameters"] = dict(params[FULL])
        out.pop("rope_scaling", None)
        out.pop("rope_theta", None)
        return out, float(local.get("rope_theta", 10000.0))
    out.setdefault("rope_theta", 1_000_000.0)
    return out, float(hf.get("rope_local_base_freq", 10000.0))


def family_fields(arch: str, hf: dict[str, Any], source: str) -> dict[str, Any]:
    family = DENSE_ARCHITECTURES[arch]
    n = int(hf["num_hidden_layers"])
    if family == "gemma2":
        return _gemma(hf, n, source, 2)
    if family == "gemma3":
        out = _gemma(hf, n, source, 6)
        out["qk_norm"] = True  # per head, (1 + w) like the other Gemma norms
        return out
    if family == "granite":
        return dict(
            embedding_multiplier=_num(hf, "embedding_multiplier", 1.0, source),
            residual_multiplier=_num(hf, "residual_multiplier", 1.0, source),
            attention_scale=_num(hf, "attention_multiplier", 1.0, source),
            logits_scaling=_num(hf, "logits_scaling", 1.0, source),
            attention_bias=bool(hf.get("attention_bias", False)),
            o_proj_bias=bool(hf.get("attention_bias", False)),
        )
    if family == "olmo2":
        return dict(norm_layout="post", qk_norm_full=True,
                    attention_bias=bool(hf.get("attention_bias", False)),
                    o_proj_bias=bool(hf.get("attention_bias", False)))
    if family == "phi3":
        return dict(fused_qkv=True, fused_gate_up=True,
                    sliding_window=None if hf.get("sliding_window") is None else int(hf["sliding_window"]))
    raise AssertionError(family)
