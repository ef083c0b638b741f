"""What a model directory says about the model: `config.json` + `generation_config.json`.

`ModelConfig.from_dir(model_dir)` reads both files into one flat dataclass that the worker's
model code, the scheduler (eos ids, max length) and the handshake (name) share. Every problem is
a `ModelLoadError` whose message names the file and the key (or the architecture) at fault.

Both config layouts in the wild are accepted:
- transformers < 5: top-level `rope_theta` + `rope_scaling` (with `rope_type` or legacy `type`);
- transformers >= 5: `rope_parameters` = {"rope_theta": ..., "rope_type": ..., <scaling keys>}.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeroserve.common.dense_families import DENSE_ARCHITECTURES, FULL, SLIDING, family_fields, gemma3_rope, layer_types
from zeroserve.common.errors import ModelLoadError
from zeroserve.common.gguf_config import config_from_gguf
from zeroserve.common.sampling_params import check_defaults, defaults_from_generation_config

# architecture name in config.json -> family our model code uses
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # mixture-of-experts families (services/worker/model/moe.py)
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "OlmoeForCausalLM": "olmoe",
    **DENSE_ARCHITECTURES,  # Gemma 2/3, Phi-3, Granite, OLMo 2 (common/dense_families.py)
}
MOE_FAMILIES = ("mixtral", "qwen3moe", "olmoe")

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")



@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None = plain RoPE; else {"rope_type": "llama3", ...}
    partial_rotary_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool = False  # bias on o_proj (Llama/Qwen3 with attention_bias=true)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int = 2048
    sliding_window: int | None = None  # window of the sliding layers (all layers unless layer_types says)
    torch_dtype: str = "float32"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    model_dir: str = ""
    name: str = ""
    # mixture of experts (0 experts = dense); see moe_fields() for each family's keys
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP in an MoE model
    qk_norm_full: bool = False  # OLMoE: RMSNorm over the whole q / k projection (not per head)
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-clip, clip]
    # what generation_config.json (or a GGUF's general.sampling.*) sets for fields a request leaves
    # unset, as read (resolve_sampling_defaults checks them where they are used)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # per-family switches (common/dense_families.py sets them; the defaults are Llama's)
    hidden_act: str = "silu"  # "silu" or "gelu_tanh" (GeGLU)
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma's HF norms use 1
    norm_layout: str = "pre"  # "pre" (Llama), "sandwich" (Gemma: pre + post), "post" (OLMo 2)
    qk_norm_full: bool = False  # q/k RMSNorm over the whole projection, all heads (OLMo 2)
    embedding_multiplier: float = 1.0  # Gemma sqrt(hidden), Granite embedding_multiplier
    residual_multiplier: float = 1.0  # Granite: each block's output is scaled before the add
    attention_scale: float | None = None  # None = head_dim**-0.5
    attn_logit_softcap: float | None = None  # cap * tanh(scores / cap) before the softmax
    final_logit_softcap: float | None = None
    logits_scaling: float = 1.0  # logits are divided by it (Granite)
    layer_types: list[str] | None = None  # per layer "sliding_attention" / "full_attention"
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3)
    fused_qkv: bool = False  # checkpoint holds qkv_proj / gate_up_proj fused (Phi-3)
    fused_gate_up: bool = False

    # ------------------------------------------------------------------ derived
    @property
    def family(self) -> str:
        """"llama" (Llama, Mistral), "qwen2", "qwen3", a dense family of common/dense_families.py,
        or MoE: "mixtral", "qwen3moe", "olmoe"."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def layer_window(self, idx: int) -> int | None:
        """The sliding window of layer `idx` (None = full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[idx] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The most positions back any layer attends to, when every layer slides (the scheduler
        frees KV blocks before it); None when some layer attends to the whole context."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return None if not windows or None in windows else max(windows)

    @property
    def llama_shape(self) -> bool:
        """True when the model is the plain Llama/Qwen decoder the compiled CPU decode step runs."""
        return (self.family in ("llama", "qwen2", "qwen3") and self.sliding_window is None
                and self.hidden_act == "silu" and self.norm_layout == "pre" and self.norm_weight_offset == 0.0
                and self.attention_scale is None and self.attn_logit_softcap is None
                and self.embedding_multiplier == 1.0 and self.residual_multiplier == 1.0
                and self.rope_type in ("default", "llama3"))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, idx: int) -> bool:
        return self.is_moe and idx not in self.dense_layers

    @property
    def rope_type(self) -> str:
        return "default" if not self.rope_scaling else self.rope_scaling["rope_type"]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def num_params(self) -> int:
        """Parameter count of the full (unsharded) model."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        per_layer = h * (q + 2 * kv) + q * h + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.o_proj_bias:
            per_layer += h
        if self.qk_norm:
            per_layer += 2 * d
        if self.qk_norm_full:
            per_layer += q + kv
        if self.norm_layout == "sandwich":
            per_layer += 2 * h  # pre- and post-norms around both blocks (OLMo 2: post only, still 2)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # experts + router row each
        mlps = sum(moe if self.is_moe_layer(j) else 3 * h * i for j in range(self.num_layers))
        return self.num_layers * per_layer + mlps + emb + h

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike, require_weights: bool = True) -> ModelConfig:
        """Parse `model_dir`/config.json (+ generation_config.json when present).

        `require_weights=False` skips the check for *.safetensors files (random-init benchmarks
        only need the shapes). A .gguf file, or a directory without config.json holding exactly
        one .gguf file, is read by common/gguf_config.py instead."""
        kind, path = resolve_model_path(model_dir)
        if kind == "gguf":
            return config_from_gguf(path, cls.from_hf_dict)
        if not path.is_dir():
            raise ModelLoadError(f"model directory {str(path)!r} does not exist or is not a directory")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"missing config.json in model directory {str(path)!r}")
        hf = _read_json(cfg_path)
        gen_path = path / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else {}
        cfg = cls.from_hf_dict(hf, gen, model_dir=str(path), source=str(cfg_path))
        if require_weights and not any(path.glob("*.safetensors")):
            raise ModelLoadError(
                f"no *.safetensors weight files in model directory {str(path)!r} "
                "(only safetensors checkpoints are supported; convert .bin/.pt files first)"
            )
        return cfg

    @classmethod
    def from_hf_dict(
        cls,
        hf: dict[str, Any],
        generation: dict[str, Any] | None = None,
        model_dir: str = "",
        source: str = "config.json",
    ) -> ModelConfig:
        """Build from an already-parsed config.json dict (and generation_config.json dict)."""
        generation = generation or {}
        if not isinstance(hf, dict):
            raise ModelLoadError(f"{source}: expected a JSON object at top level")

        archs = hf.get("architectures")
        if not archs or not isinstance(archs, list):
            raise ModelLoadError(
                f"{source}: missing key 'architectures' (expected one of {sorted(SUPPORTED_ARCHITECTURES)})"
            )
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: unsupported architecture {arch!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]

        def req(key: str, kind: type = int) -> Any:
            if key not in hf or hf[key] is None:
                raise ModelLoadError(f"{source}: missing key {key!r} (required for {arch})")
            value = hf[key]
            try:
                if kind is int and (isinstance(value, bool) or int(value) != value):
                    raise ValueError
                return kind(value)
            except (TypeError, ValueError):
                raise ModelLoadError(f"{source}: key {key!r} must be {kind.__name__}, got {value!r}") from None

        hidden = req("hidden_size")
        num_layers = req("num_hidden_layers")
        num_heads = req("num_attention_heads")
        intermediate = req("intermediate_size")
        vocab = req("vocab_size")
        num_kv = hf.get("num_key_value_heads")
        num_kv = num_heads if num_kv is None else int(num_kv)
        head_dim = hf.get("head_dim")
        if head_dim is None:
            if hidden % num_heads:
                raise ModelLoadError(
                    f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {num_heads} "
                    "and no 'head_dim' is given"
                )
            head_dim = hidden // num_heads
        head_dim = int(head_dim)
        for key, value in (("hidden_size", hidden), ("num_hidden_layers", num_layers),
                           ("num_attention_heads", num_heads), ("num_key_value_heads", num_kv),
                           ("intermediate_size", intermediate), ("vocab_size", vocab), ("head_dim", head_dim)):
            if value <= 0:
                raise ModelLoadError(f"{source}: key {key!r} must be positive, got {value}")
        if num_heads % num_kv:
            raise ModelLoadError(
                f"{source}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}"
            )
        if head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim {head_dim} must be even for rotary embeddings")

        act = "silu" if family in ("gemma2", "gemma3") else hf.get("hidden_act", "silu")  # Gemma: see family_fields
        if act not in ("silu", "swish"):
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if hf.get("mlp_bias"):
            raise ModelLoadError(f"{source}: mlp_bias=true is not supported")

        rope_local_theta = None
        if family == "gemma3":
            hf, rope_local_theta = gemma3_rope(hf, source)
        rope_theta, rope_scaling, partial = _parse_rope(hf, source)
        if rope_scaling and rope_scaling["rope_type"] == "longrope":
            rope_scaling = _longrope(rope_scaling, hf, head_dim, partial, source)

        # projection biases, as transformers' modules define them per architecture
        if family == "qwen2":
            attention_bias, o_proj_bias = True, False  # Qwen2: q/k/v bias always, o_proj never
        elif arch == "MistralForCausalLM":
            attention_bias = o_proj_bias = False  # Mistral has no attention biases
        else:  # Llama, Qwen3: `attention_bias` covers q, k, v and o
            attention_bias = o_proj_bias = bool(hf.get("attention_bias", False))

        moe = moe_fields(hf, family, intermediate, num_layers, source)

        # sliding-window attention: Mistral on every layer; Qwen2/3 (use_sliding_window) on the
        # layers from max_window_layers on, as transformers' layer_types
        sliding_window = hf.get("sliding_window")
        qwen_layer_types = None
        if family in ("qwen3moe", "olmoe") and not hf.get("use_sliding_window", False):
            sliding_window = None
        if family in ("qwen2", "qwen3"):
            if not hf.get("use_sliding_window", False):
                sliding_window = None
            elif sliding_window:
                mwl = int(hf.get("max_window_layers") or 0)
                qwen_layer_types = hf.get("layer_types") or [SLIDING if i >= mwl else FULL for i in range(num_layers)]

        eos = _merge_ids(hf.get("eos_token_id"), generation.get("eos_token_id"), source=source)
        bos = generation.get("bos_token_id", hf.get("bos_token_id"))
        pad = generation.get("pad_token_id", hf.get("pad_token_id"))
        if isinstance(bos, list):
            bos = bos[0] if bos else None
        if isinstance(pad, list):
            pad = pad[0] if pad else None

        dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if not isinstance(dtype, str):
            dtype = str(dtype).replace("torch.", "")

        extra = family_fields(arch, hf, source) if arch in DENSE_ARCHITECTURES else {}
        if rope_local_theta is not None:
            extra["rope_local_theta"] = rope_local_theta
        if qwen_layer_types is not None:
            extra["layer_types"] = layer_types({"layer_types": qwen_layer_types}, num_layers, source, 1)
        if "sliding_window" in extra:
            sliding_window = extra.pop("sliding_window")
        attention_bias = extra.pop("attention_bias", attention_bias)
        o_proj_bias = extra.pop("o_proj_bias", o_proj_bias)
        if sliding_window is not None and sliding_window <= 0:
            raise ModelLoadError(f"{source}: key 'sliding_window' must be positive, got {sliding_window}")

        name = Path(model_dir).name if model_dir else hf.get("_name_or_path", "") or arch
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            intermediate_size=intermediate,
            vocab_size=vocab,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            partial_rotary_factor=partial,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(extra.pop("tie_word_embeddings", hf.get("tie_word_embeddings", False))),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            sliding_window=None if sliding_window is None else int(sliding_window),
            qk_norm=bool(extra.pop("qk_norm", family in ("qwen3", "qwen3moe"))),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
            torch_dtype=dtype,
            eos_token_ids=eos,
            bos_token_id=None if bos is None else int(bos),
            pad_token_id=None if pad is None else int(pad),
            model_dir=str(model_dir),
            name=name,
            sampling_defaults=defaults_from_generation_config(generation),
            **moe,
            **extra,
        )


def moe_fields(hf: dict[str, Any], family: str, intermediate: int, num_layers: int,
               source: str) -> dict[str, Any]:
    """The ModelConfig MoE fields from an HF config dict (empty for dense families), with each
    family's defaults as its transformers config class has them."""
    if family not in MOE_FAMILIES:
        return {}
    # transformers 5 maps num_experts <-> num_local_experts per family and may write either
    keys = ("num_local_experts", "num_experts") if family == "mixtral" else ("num_experts", "num_local_experts")
    experts_key = next((k for k in keys if hf.get(k) is not None), keys[0])

    def pos_int(key: str, default: int | None) -> int:
        v = hf.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ModelLoadError(f"{source}: key {key!r} must be a positive integer, got {v!r}")
        return v

    n = pos_int(experts_key, None)
    k = pos_int("num_experts_per_tok", 2 if family == "mixtral" else 8)
    if k > n:
        raise ModelLoadError(f"{source}: num_experts_per_tok {k} exceeds {experts_key} {n}")
    out: dict[str, Any] = {"num_experts": n, "num_experts_per_tok": k, "moe_intermediate_size": intermediate,
                           "norm_topk_prob": True}
    if family in ("qwen3moe", "olmoe"):
        out["norm_topk_prob"] = bool(hf.get("norm_topk_prob", False))
    if family == "qwen3moe":
        out["moe_intermediate_size"] = pos_int("moe_intermediate_size", 768)
        step = pos_int("decoder_sparse_step", 1)
        only = hf.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in only):
            raise ModelLoadError(f"{source}: key 'mlp_only_layers' must be a list of layer indices, got {only!r}")
        # as Qwen3MoeDecoderLayer decides: sparse unless listed, and only every `step`-th layer
        out["dense_layers"] = [i for i in range(num_layers) if i in only or (i + 1) % step != 0]
    if family == "olmoe":
        out["qk_norm_full"] = True
        clip = hf.get("clip_qkv")
        out["clip_qkv"] = None if clip is None else float(clip)
    if family in ("mixtral", "olmoe") and hf.get("shared_expert_intermediate_size"):
        raise ModelLoadError(f"{source}: key 'shared_expert_intermediate_size' (shared experts) is not supported")
    return out


def resolve_sampling_defaults(cfg: ModelConfig, choice: str | None) -> dict[str, Any]:
    """The sampling defaults to serve `cfg` with, checked, by `--generation-config`: "auto" = the
    model's own, "none" (or vLLM's "vllm") = SamplingParams' defaults alone, else a
    generation_config.json file (or a directory holding one) whose values replace the model's
    (one file for every model a scheduler serves)."""
    if choice in (None, "auto"):
        where = "generation_config.json" if not cfg.model_dir.endswith(".gguf") else "general.sampling.*"
        return check_defaults(dict(cfg.sampling_defaults), f"{cfg.name or cfg.model_dir}: {where}")
    if choice in ("none", "vllm"):
        return {}
    if not isinstance(choice, str) or not choice.strip():
        raise ModelLoadError(f"--generation-config must be auto, none or a file, got {choice!r}")
    path = Path(choice)
    if path.is_dir():
        path = path / "generation_config.json"
    if not path.is_file():
        raise ModelLoadError(f"--generation-config {choice!r}: no such file; give auto, none, or a "
                             "generation_config.json file (or a directory holding one)")
    gen = _read_json(path)
    if not isinstance(gen, dict):
        raise ModelLoadError(f"{str(path)!r}: expected a JSON object at top level")
    return check_defaults(defaults_from_generation_config(gen), str(path))


def resolve_model_path(model_path: str | os.PathLike) -> tuple[str, Path]:
    """("gguf", file) for a .gguf file or a directory with no config.json and exactly one .gguf
    file; ("hf", path) otherwise (from_dir then reports what is missing)."""
    path = Path(model_path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return "gguf", path
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        if len(ggufs) > 1:
            raise ModelLoadError(
                f"model directory {str(path)!r} has no config.json and {len(ggufs)} .gguf files "
                f"({', '.join(p.name for p in ggufs[:4])}{', ...' if len(ggufs) > 4 else ''}); "
                "pass one .gguf file as the model (split GGUF files are not supported)"
            )
    return "hf", path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{str(path)!r} is not valid JSON: {e}") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read {str(path)!r}: {e}") from None


def _merge_ids(*values: Any, source: str = "config.json") -> list[int]:
    out: list[int] = []
    for v in values:
        if v is None:
            continue
        items = v if isinstance(v, (list, tuple)) else [v]
        for x in items:
            if isinstance(x, bool) or not isinstance(x, int):
                raise ModelLoadError(f"{source}: eos_token_id entries must be integers, got {x!r}")
            if x not in out:
                out.append(x)
    return out


def _parse_rope(hf: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None, float]:
    """-> (rope_theta, rope_scaling or None, partial_rotary_factor)."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    theta = hf.get("rope_theta")
    partial = hf.get("partial_rotary_factor")
    if isinstance(params, dict) and params:
        if "rope_type" not in params and "type" not in params and all(isinstance(v, dict) for v in params.values()):
            raise ModelLoadError(f"{source}: per-layer-type rope_parameters are not supported")
        if theta is None:
            theta = params.get("rope_theta")
        if partial is None:
            partial = params.get("partial_rotary_factor")
        if scaling is None:
            scaling = params
    theta = 10000.0 if theta is None else float(theta)
    partial = 1.0 if partial is None else float(partial)
    if not 0.0 < partial <= 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor must be in (0, 1], got {partial}")
    if scaling is None:
        return theta, None, partial
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: rope_scaling must be an object or null, got {scaling!r}")
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return theta, None, partial
    if rope_type == "linear":
        factor = scaling.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ModelLoadError(f"{source}: linear rope scaling needs a positive 'factor', got {factor!r}")
        return theta, {"rope_type": "linear", "factor": float(factor)}, partial
    if rope_type == "longrope":
        return theta, dict(scaling, rope_type="longrope"), partial  # checked by _longrope
    if rope_type != "llama3":
        raise ModelLoadError(
            f"{source}: unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    missing = [k for k in _LLAMA3_KEYS if scaling.get(k) is None]
    if missing:
        raise ModelLoadError(f"{source}: llama3 rope scaling is missing key(s) {missing}")
    out = {"rope_type": "llama3"}
    for k in _LLAMA3_KEYS:
        out[k] = float(scaling[k])
    out["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    if out["high_freq_factor"] == out["low_freq_factor"]:
        raise ModelLoadError(f"{source}: llama3 rope scaling needs high_freq_factor != low_freq_factor")
    if not math.isfinite(out["factor"]) or out["factor"] <= 0:
        raise ModelLoadError(f"{source}: llama3 rope scaling factor must be positive, got {out['factor']}")
    return theta, out, partial


def _longrope(scaling: dict[str, Any], hf: dict[str, Any], head_dim: int, partial: float,
              source: str) -> dict[str, Any]:
    """Phi-3 LongRoPE: per-frequency divisors (short below original_max_position_embeddings,
    long past it) and a cos/sin scale, as transformers' _compute_longrope_parameters."""
    orig = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if not orig:
        raise ModelLoadError(f"{source}: longrope rope scaling needs 'original_max_position_embeddings'")
    half = int(head_dim * partial) // 2
    out: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": int(orig)}
    for key in ("short_factor", "long_factor"):
        f = scaling.get(key)
        if not isinstance(f, list) or len(f) != half:
            raise ModelLoadError(f"{source}: longrope {key!r} must list {half} numbers (rotary_dim / 2), got {f!r}")
        out[key] = [float(x) for x in f]
    factor = scaling.get("factor")
    if factor is None:
        factor = int(hf.get("max_position_embeddings") or 2048) / int(orig)
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(int(orig)))
    out["attention_factor"] = float(attn)
    return out
