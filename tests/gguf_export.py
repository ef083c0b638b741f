"""Writing GGUF files for the tests with the gguf package's writer, the way llama.cpp does.

    export_hf_dir(model_dir, out_path)           # a tiny HF model dir -> F32 GGUF (+ tokenizer)
    write_gguf(path, "llama", hparams, tensors)  # arbitrary tensors: {gguf_name: (array, qtype)}
    random_blocks("Q4_K", rows, cols, rng)       # raw quantized bytes with sane fp16 scales

The name map and the q/k permutation below are written out independently of
services/worker/model/gguf_loader.py, following llama.cpp's convert_hf_to_gguf.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np

LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Phi-3's fused tensors keep their fusion in llama.cpp (ffn_up = gate then up); a map of their
# own, so LAYER_MAP stays one-to-one (tests invert it)
FUSED_MAP = dict(LAYER_MAP, **{"self_attn.qkv_proj.weight": "attn_qkv.weight",
                               "mlp.gate_up_proj.weight": "ffn_up.weight"})
TOP_MAP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe",
             "OlmoeForCausalLM": "olmoe", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
             "Olmo2ForCausalLM": "olmo2", "Phi3ForCausalLM": "phi3",
             "GraniteForCausalLM": "granite"}
# MoE: per-expert HF tensors -> llama.cpp's stacked [E, rows, cols] tensors; routers stay F32
# (llama-quantize never quantizes ffn_gate_inp)
EXPERT_MAP = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
              "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
ROUTER_MAP = {"mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}
# llama.cpp's names for the norms of the families with output norms (gguf.MODEL_TENSORS)
POST_NORM_MAP = dict(LAYER_MAP, **{
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
})
# offsets of the fp16 scale fields inside one block (gguf/quants.py dequantize_blocks)
K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def to_gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in TOP_MAP:
        return TOP_MAP[hf_name]
    _, _, idx, rest = hf_name.split(".", 3)  # model.layers.N.<rest>
    table = POST_NORM_MAP if arch in ("gemma2", "gemma3", "olmo2") else FUSED_MAP if arch == "phi3" else LAYER_MAP
    return f"blk.{idx}.{table[rest]}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> interleaved rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of random blocks of a K-quant (the gguf package cannot quantize those):
    random quants and sub-scales, with the fp16 super-block scales set to small finite values."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    n = rows * (cols // block)
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(1e-3, 1e-2, size=n).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def encode_tensor(w: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """A float array in GGML type `qtype` (F32/F16/BF16/legacy quants via gguf.quants.quantize,
    K-quants as random blocks of the same shape)."""
    if qtype in K_SCALE_OFFSETS:
        return random_blocks(qtype, w.shape[0], w.shape[1], rng)
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType[qtype])


def write_gguf(path: str | Path, arch: str, hp: dict[str, Any], tensors: dict[str, tuple[np.ndarray, str]],
               tokenizer: dict[str, Any] | None = None) -> Path:
    """Write a GGUF with llama.cpp's metadata keys. `tensors`: {name: (data, type name)} where the
    data is float (F32/F16) or already-encoded bytes (uint8 [rows, bytes]) of the given type."""
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(hp["block_count"])
    w.add_context_length(hp.get("context_length", 2048))
    w.add_embedding_length(hp["embedding_length"])
    w.add_feed_forward_length(hp["feed_forward_length"])
    w.add_head_count(hp["head_count"])
    w.add_head_count_kv(hp["head_count_kv"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_rope_dimension_count(hp["head_dim"])
    w.add_rope_freq_base(hp.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(hp.get("rms_norm_eps", 1e-6))
    for key, value in hp.get("extra", {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value) if isinstance(value, str) else w.add_float32(key, value)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tokenizer["pre"])
        w.add_token_list(tokenizer["tokens"])
        w.add_token_types(tokenizer["token_types"])
        w.add_token_merges(tokenizer["merges"])
        w.add_bos_token_id(tokenizer["bos"])
        w.add_eos_token_id(tokenizer["eos"])
        w.add_pad_token_id(tokenizer["pad"])
        w.add_add_bos_token(tokenizer["add_bos"])
        w.add_chat_template(tokenizer.get("chat_template", CHAT_TEMPLATE))
    for name, (data, qtype) in tensors.items():
        if qtype in ("F32", "F16") and data.dtype != np.uint8:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32 if qtype == "F32" else np.float16))
        else:
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tokenizer_fields(model_dir: Path, pre: str, add_bos: bool) -> dict[str, Any]:
    """The tokenizer.ggml.* fields llama.cpp writes for a byte-level BPE tokenizer.json."""
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    special = {t["id"] for t in tj.get("added_tokens", []) if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {"pre": pre, "tokens": tokens, "merges": merges, "add_bos": add_bos,
            "token_types": [3 if i in special else 1 for i in range(len(tokens))],
            "bos": 1, "eos": 2, "pad": 0}


def llama3_rope_freqs(rot_dim: int, theta: float, rope: dict[str, Any]) -> np.ndarray:
    """convert_hf_to_gguf.py's `rope_freqs` for llama3 scaling (one divisor per frequency)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    orig = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, rot_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / rot_dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _stack_experts(weights: dict[str, np.ndarray], tensors: dict, qtype: str, rng) -> dict[str, np.ndarray]:
    """Move every MoE tensor from `weights` into `tensors` under llama.cpp's names (experts
    stacked, in `qtype`; routers F32); returns the other weights."""
    rest, stacks = {}, {}
    for hf_name, w in weights.items():
        _, _, idx, tail = hf_name.split(".", 3) if hf_name.startswith("model.layers.") else ("", "", "", hf_name)
        if tail in ROUTER_MAP:
            tensors[f"blk.{idx}.{ROUTER_MAP[tail]}"] = (w.astype(np.float32), "F32")
        elif ".experts." in tail:
            e, proj, _ = tail.split(".experts.")[1].split(".")  # "<e>.<proj>.weight"
            stacks.setdefault(f"blk.{idx}.{EXPERT_MAP[proj]}.weight", {})[int(e)] = w.astype(np.float32)
        else:
            rest[hf_name] = w
    for name, per in stacks.items():
        w = np.stack([per[e] for e in range(len(per))])
        if qtype == "F32":
            tensors[name] = (w, "F32")
        else:
            enc = encode_tensor(w.reshape(-1, w.shape[-1]), qtype, rng)
            tensors[name] = (enc.reshape(w.shape[0], w.shape[1], -1), qtype)
    return rest


def export_hf_dir(model_dir: str | Path, out_path: str | Path, qtype: str = "F32",
                  seed: int = 0) -> Path:
    """Convert a (tiny) HF model directory to GGUF as llama.cpp would: F32 norms/biases, 2-D
    weights in `qtype`, Llama q/k rows permuted, llama3 rope scaling as `rope_freqs.weight`."""
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    weights: dict[str, np.ndarray] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    rng = np.random.default_rng(seed)
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    weights = _stack_experts(weights, tensors, qtype, rng)
    for hf_name, w in weights.items():
        w = w.astype(np.float32)
        if arch in ("llama", "granite") and (".q_proj." in hf_name or ".k_proj." in hf_name):
            w = llamacpp_permute(w, heads if ".q_proj." in hf_name else kv)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            w = w + 1  # convert_hf_to_gguf Gemma2Model / Gemma3Model: norms (q/k too) stored as (1 + w)
        t = qtype if w.ndim == 2 else "F32"
        tensors[to_gguf_name(hf_name, arch)] = (w if t == "F32" else encode_tensor(w, t, rng), t)
    theta = float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    rope = cfg.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type")) == "llama3":
        tensors["rope_freqs.weight"] = (llama3_rope_freqs(head_dim, theta, rope), "F32")
    hp = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
          "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
          "head_count": heads, "head_count_kv": kv, "head_dim": head_dim, "rope_theta": theta,
          "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6)}
    if arch == "gemma2":  # convert_hf_to_gguf Gemma2Model's keys (no query_pre_attn_scalar: see gguf_config)
        hp["extra"] = {"gemma2.attention.sliding_window": int(cfg["sliding_window"]),
                       "gemma2.attn_logit_softcapping": float(cfg["attn_logit_softcapping"]),
                       "gemma2.final_logit_softcapping": float(cfg["final_logit_softcapping"])}
    if arch == "phi3" and rope.get("rope_type") == "longrope":  # convert_hf_to_gguf Phi3MiniModel
        orig = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / orig
        attn = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(orig))
        tensors["rope_factors_long.weight"] = (np.array(rope["long_factor"], dtype=np.float32), "F32")
        tensors["rope_factors_short.weight"] = (np.array(rope["short_factor"], dtype=np.float32), "F32")
        hp["extra"] = {"phi3.rope.scaling.attn_factor": float(attn),
                       "phi3.rope.scaling.original_context_length": int(orig)}
    if arch == "granite":  # convert_hf_to_gguf GraniteModel
        hp["extra"] = {"granite.embedding_scale": float(cfg["embedding_multiplier"]),
                       "granite.residual_scale": float(cfg["residual_multiplier"]),
                       "granite.attention.scale": float(cfg["attention_multiplier"]),
                       "granite.logit_scale": float(cfg["logits_scaling"])}
    if arch == "gemma3":
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta", 10000.0)
        hp["rope_theta"] = float(cfg["rope_parameters"]["full_attention"]["rope_theta"])
        hp["extra"] = {"gemma3.attention.sliding_window": int(cfg["sliding_window"]),
                       "gemma3.rope.freq_base_swa": float(local)}
        if cfg.get("final_logit_softcapping"):
            hp["extra"]["gemma3.final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
    n_exp = cfg.get("num_local_experts") or cfg.get("num_experts")
    if n_exp:
        hp["extra"] = {**hp.get("extra", {}), f"{arch}.expert_count": n_exp, f"{arch}.expert_used_count": cfg["num_experts_per_tok"]}
        if arch == "qwen3moe":
            hp["extra"][f"{arch}.expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    tok = tokenizer_fields(model_dir, "qwen2" if arch.startswith("qwen") else "gpt-2", add_bos=arch == "llama")
    return write_gguf(out_path, arch, hp, tensors, tok)
