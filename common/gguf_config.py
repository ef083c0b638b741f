"""What a GGUF file says about the model: its metadata turned into our `ModelConfig`.

`config_from_gguf(path, ModelConfig.from_hf_dict)` reads `general.architecture` and the `<arch>.*` / `tokenizer.ggml.*`
keys, spells them as an HF config dict and hands that to `ModelConfig.from_hf_dict`, so GGUF and
safetensors models go through the same validation. No torch here: the scheduler and the
detokenizer read configs too (numpy and the `gguf` package are fine).

`GGUFFile` parses the header (metadata + tensor directory) itself instead of using
`gguf.GGUFReader`: the reader builds numpy objects for every vocabulary string and merge, which
took ~3 s and ~170 MB for a 49k-token vocabulary (~10 s for Qwen's 152k), in every process that
reads a config. Walking the header with `struct` takes ~0.1 s; tensor bytes are a memory map.
The gguf package still provides the type tables and the dequantization (worker side).

llama.cpp bakes Llama-3.1-style RoPE scaling into a `rope_freqs.weight` tensor (one divisor per
frequency) instead of metadata keys; `llama3_from_rope_freqs` recovers the four llama3
parameters from it and checks that they reproduce the tensor.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.sampling_params import defaults_from_gguf

# general.architecture -> architecture name our model code knows (Mistral GGUFs say "llama")
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
}  # a "llama" file with {arch}.expert_count > 0 is Mixtral (llama.cpp converts it as llama)
SUPPORTED_GGUF_ROPE = ("none", "llama3 (rope_freqs.weight)")

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp has not written it since 2023
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
BIG_ARRAY = 1024  # longer arrays (vocabulary, merges, scores) are kept as their length only


class GGUFTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy / torch order (GGUF lists the fastest-varying dim first)
    type_name: str  # GGMLQuantizationType name, e.g. "Q4_K" ("type 99" when unknown)
    offset: int  # absolute byte offset in the file
    nbytes: int  # 0 when the type is unknown


class GGUFFile:
    """The metadata and tensor directory of one .gguf file; tensor bytes through a memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read GGUF file {str(self.path)!r}: {e}") from None
        try:
            self._parse(self._map)
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise ModelLoadError(f"{self.path.name}: truncated or corrupt GGUF header ({e})") from None

    def _parse(self, buf) -> None:
        if buf[:4] != _MAGIC:
            raise ModelLoadError(f"{self.path.name} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        version = _U32.unpack_from(buf, 4)[0]
        if version & 0xFFFF == 0:
            raise ModelLoadError(f"{self.path.name}: big-endian GGUF files are not supported")
        if version not in _VERSIONS:
            raise ModelLoadError(f"{self.path.name}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _read_string(buf, pos)
            vtype = _U32.unpack_from(buf, pos)[0]
            self.metadata[key], pos = _read_value(buf, pos + 4, vtype)
        infos = []
        for _ in range(n_tensors):
            name, pos = _read_string(buf, pos)
            ndim = _U32.unpack_from(buf, pos)[0]
            dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
            pos += 4 + 8 * ndim
            type_id, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, tuple(int(d) for d in reversed(dims)), type_id, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-pos // align) * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, type_id, offset in infos:
            type_name, nbytes = _type_info(type_id, shape)
            self.tensors[name] = GGUFTensor(name, shape, type_name, data_start + offset, nbytes)

    def raw_rows(self, t: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array [rows, bytes_per_row] (no copy)."""
        if t.nbytes <= 0 or t.offset + t.nbytes > len(self._map):
            raise ModelLoadError(f"{self.path.name}: tensor {t.name!r} ({t.type_name}) lies outside the file "
                                 "or has an unknown type")
        rows = math.prod(t.shape[:-1]) if len(t.shape) > 1 else 1
        return np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(rows, -1)


def _read_string(buf, pos: int) -> tuple[str, int]:
    n = _U64.unpack_from(buf, pos)[0]
    end = pos + 8 + n
    if end > len(buf):
        raise IndexError("string runs past the end of the file")
    return bytes(buf[pos + 8:end]).decode("utf-8", errors="replace"), end


def _read_value(buf, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALARS:
        fmt = "<" + _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _read_string(buf, pos)
    if vtype != _ARRAY:
        raise ModelLoadError(f"unknown GGUF metadata value type {vtype}")
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _SCALARS:
        width = struct.calcsize("<" + _SCALARS[etype])
        if count > BIG_ARRAY:
            return count, pos + width * count
        return list(struct.unpack_from(f"<{count}{_SCALARS[etype]}", buf, pos)), pos + width * count
    if etype == _STRING and count > BIG_ARRAY:  # skip the vocabulary without decoding it
        for _ in range(count):
            pos += 8 + _U64.unpack_from(buf, pos)[0]
        return count, pos
    out = []
    for _ in range(count):
        value, pos = _read_value(buf, pos, etype)
        out.append(value)
    return out, pos


def _type_info(type_id: int, shape: tuple[int, ...]) -> tuple[str, int]:
    import gguf  # the type tables only (gguf.constants is plain Python)

    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        return f"type {type_id}", 0
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return qtype.name, math.prod(shape) // block * type_size


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelLoadError("loading .gguf models needs the 'gguf' package (pip install gguf)") from None
    return GGUFFile(path)


def config_from_gguf(path: str | os.PathLike, from_hf_dict: Callable[..., Any]):
    """ModelConfig for one .gguf file (name = the file stem, model_dir = the file).
    `from_hf_dict`: ModelConfig.from_hf_dict, passed in by model_config.py (which imports this
    module; the arrow runs one way)."""
    path = Path(path)
    gf = open_gguf(path)
    meta, tensors = gf.metadata, gf.tensors
    source = path.name
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))} (Llama and Mistral GGUFs say 'llama')"
        )

    def key(k: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{k}"
        if full not in meta:
            if required:
                raise ModelLoadError(f"{source}: missing metadata key {full!r} (required for {arch})")
            return default
        return meta[full]

    hidden = key("embedding_length", required=True)
    heads = key("attention.head_count", required=True)
    kv_heads = _uniform(key("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv", source)
    heads = _uniform(heads, f"{arch}.attention.head_count", source)
    head_dim = key("attention.key_length") or (hidden // heads if heads else 0)
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ModelLoadError(f"{source}: missing tensor 'token_embd.weight'")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = emb.shape[0] if len(emb.shape) == 2 else len(tokens) if isinstance(tokens, list) else tokens

    rot_dim = key("rope.dimension_count") or head_dim
    theta = float(key("rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling(key, gf, rot_dim, theta, source, linear_ok=arch == "gemma3")

    hf: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": key("feed_forward_length", required=True),
        "vocab_size": vocab,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "partial_rotary_factor": rot_dim / head_dim if head_dim else 1.0,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": _compute_dtype(tensors),
    }
    hf.update(_family_keys(arch, key, hidden, heads, head_dim, source))
    if arch == "phi3":
        hf.update(_phi3_longrope(key, gf, source))
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    hf["eos_token_id"] = list(dict.fromkeys(eos))
    hf["bos_token_id"] = meta.get("tokenizer.ggml.bos_token_id")
    hf["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    hf.update(_moe_keys(key, arch, hf, tensors))
    cfg = from_hf_dict(hf, {}, model_dir=str(path), source=source)
    if arch != "qwen2":  # from_hf_dict ties o_proj's bias to q/k/v's; GGUF says which exist
        cfg.o_proj_bias = "blk.0.attn_output.bias" in tensors
    if arch in ("gemma2", "gemma3"):
        cfg.norm_weight_offset = 0.0  # llama.cpp's converter stores Gemma's norm weights with the +1 added
    cfg.name = path.stem
    cfg.sampling_defaults = defaults_from_gguf(meta)
    return cfg


def _moe_keys(key, arch: str, hf: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The HF config keys of an MoE GGUF (llama.cpp's expert_* metadata); {} for dense files.
    llama.cpp renormalizes the top-k weights for Mixtral and Qwen3-MoE and not for OLMoE unless
    `expert_weights_norm` says otherwise."""
    n = key("expert_count", 0)
    if not n:
        return {}
    out: dict[str, Any] = {"num_experts_per_tok": key("expert_used_count", 2),
                           "norm_topk_prob": bool(key("expert_weights_norm", arch != "olmoe"))}
    if arch == "llama":
        out.update(architectures=["MixtralForCausalLM"], num_local_experts=n)
    else:
        out["num_experts"] = n
    if arch == "qwen3moe":
        out["moe_intermediate_size"] = key("expert_feed_forward_length", hf["intermediate_size"])
        # no metadata for Qwen3-MoE's dense layers (mlp_only_layers): a layer without expert
        # tensors but with a dense MLP is one
        out["mlp_only_layers"] = [i for i in range(hf["num_hidden_layers"])
                                  if f"blk.{i}.ffn_gate_exps.weight" not in tensors and f"blk.{i}.ffn_gate.weight" in tensors]
    clamp = key("attention.clamp_kqv")
    if clamp:
        out["clip_qkv"] = float(clamp)
    return out


def _family_keys(arch: str, key, hidden: int, heads: int, head_dim: int, source: str) -> dict[str, Any]:
    """HF config keys of the dense families that GGUF spells as `<arch>.*` metadata."""
    if arch == "granite":  # convert_hf_to_gguf GraniteModel: the four multipliers as *_scale keys
        names = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                 "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}
        return {hf_key: float(key(g, required=True)) for hf_key, g in names.items()}
    if arch not in ("gemma2", "gemma3"):
        return {}
    window = key("attention.sliding_window")
    if not window:
        raise ModelLoadError(f"{source}: missing metadata key '{arch}.attention.sliding_window'")
    n_layers = key("block_count", required=True)
    # llama.cpp's patterns, as HF's defaults: Gemma 2 slides on even layers, Gemma 3 on all but
    # every 6th; Gemma 3's sliding layers rotate with rope.freq_base_swa (llama.cpp: 10000)
    pattern = 2 if arch == "gemma2" else 6
    extra = {} if arch == "gemma2" else {"rope_local_base_freq": float(key("rope.freq_base_swa", 10000.0))}
    return {
        **extra,
        "sliding_window": int(window),
        "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)],
        "attn_logit_softcapping": key("attn_logit_softcapping"),
        "final_logit_softcapping": key("final_logit_softcapping"),
        # GGUF has no query_pre_attn_scalar; llama.cpp scales by 1/sqrt(head_dim), except the
        # 27B (46 layers), where it is hidden / heads, which is what its HF config says too
        "query_pre_attn_scalar": hidden // heads if n_layers == 46 else head_dim,
    }


def _phi3_longrope(key, gf: GGUFFile, source: str) -> dict[str, Any]:
    """llama.cpp stores Phi-3's LongRoPE as rope_factors_short/long.weight tensors plus
    rope.scaling.attn_factor / original_context_length (no scaling type key)."""
    t_short, t_long = gf.tensors.get("rope_factors_short.weight"), gf.tensors.get("rope_factors_long.weight")
    out: dict[str, Any] = {}
    window = key("attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)
    if t_short is None and t_long is None:
        return out
    if t_short is None or t_long is None or {t_short.type_name, t_long.type_name} != {"F32"}:
        raise ModelLoadError(f"{source}: LongRoPE needs both rope_factors_short.weight and "
                             "rope_factors_long.weight as F32 tensors")
    orig = key("rope.scaling.original_context_length", required=True)
    factors = {k: gf.raw_rows(t).view(np.float32).reshape(-1).astype(float).tolist()
               for k, t in (("short_factor", t_short), ("long_factor", t_long))}
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": int(orig), **factors}
    attn = key("rope.scaling.attn_factor")
    if attn is not None:
        scaling["attention_factor"] = float(attn)
    out.update(rope_scaling=scaling, original_max_position_embeddings=int(orig))
    return out


def _uniform(value: Any, name: str, source: str) -> int:
    """A per-layer array must hold one value (we do not run models with varying head counts)."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ModelLoadError(f"{source}: {name} varies per layer ({value[:8]}...); not supported")
        value = value[0]
    return int(value)


def _compute_dtype(tensors: dict[str, Any]) -> str:
    """The "auto" dtype on accelerators: the file's float type, float16 for quantized files
    (their block scales are float16, as llama.cpp computes)."""
    t = tensors.get("blk.0.attn_q.weight")
    t = tensors["token_embd.weight"] if t is None else t
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(t.type_name, "float16")


def _rope_scaling(key, gf: GGUFFile, rot_dim: int, theta: float, source: str, linear_ok: bool = False) -> dict | None:
    kind = key("rope.scaling.type", "none")
    factor = key("rope.scaling.factor", 1.0)
    if linear_ok and kind == "linear" and factor != 1.0:  # Gemma 3's global layers
        return {"rope_type": "linear", "factor": float(factor)}
    if kind not in ("none", "") and not (kind == "linear" and factor == 1.0):
        raise ModelLoadError(
            f"{source}: unsupported rope scaling type {kind!r}; supported: {', '.join(SUPPORTED_GGUF_ROPE)}"
        )
    t = gf.tensors.get("rope_freqs.weight")
    if t is None:
        return None
    if t.type_name not in ("F32", "F16"):
        raise ModelLoadError(f"{source}: rope_freqs.weight has type {t.type_name}, expected F32 or F16")
    freqs = gf.raw_rows(t).view(np.float32 if t.type_name == "F32" else np.float16)
    return llama3_from_rope_freqs(freqs.astype(np.float64), rot_dim, theta, source)


def llama3_factors(rot_dim: int, theta: float, factor: float, low: float, high: float, orig: float) -> np.ndarray:
    """The per-frequency divisors llama3 scaling applies (llama.cpp's `rope_freqs.weight`)."""
    inv = 1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def llama3_from_rope_freqs(freqs: np.ndarray, rot_dim: int, theta: float, source: str) -> dict | None:
    """llama3 rope_scaling parameters that reproduce the divisors in `freqs` (None: all 1)."""
    f = np.asarray(freqs, dtype=np.float64).reshape(-1)
    if f.shape[0] != rot_dim // 2:
        raise ModelLoadError(f"{source}: rope_freqs.weight has {f.shape[0]} entries, expected {rot_dim // 2}")
    if np.allclose(f, 1.0):
        return None
    factor = float(f.max())
    inv = 1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    x = inv / (2 * math.pi)  # 1 / wavelength
    bad = ModelLoadError(f"{source}: rope_freqs.weight does not follow llama3 rope scaling; "
                         f"supported: {', '.join(SUPPORTED_GGUF_ROPE)}")
    if factor <= 1 or f.min() <= 0:
        raise bad
    # smooth: 1 = untouched (divisor 1), 0 = fully interpolated (divisor = factor); llama3
    # makes it linear in 1/wavelength between the two bands: smooth = a * x - b
    smooth = (1 / f - 1 / factor) / (1 - 1 / factor)
    top, bottom = smooth >= 1 - 1e-4, smooth <= 1e-4
    mid = ~top & ~bottom
    if not top.any() or not bottom.any() or x[bottom].max() >= x[top].min():
        raise bad
    x_lo, x_hi = x[bottom].max(), x[top].min()
    if mid.sum() >= 2:
        a, c = np.polyfit(x[mid], smooth[mid], 1)
        b = -c
    elif mid.sum() == 1:  # a line through the point that clears both bands
        xm, sm = x[mid][0], smooth[mid][0]
        a = max(sm / (xm - x_lo), (1 - sm) / (x_hi - xm))
        b = a * xm - sm
    else:  # a step: put the ramp in the gap between the bands
        lo, hi = x_lo + (x_hi - x_lo) / 3, x_hi - (x_hi - x_lo) / 3
        a = 1 / (hi - lo)
        b = a * lo
    if not (a > 0 and b > 0):
        raise bad
    # a = orig / (high - low), b = low / (high - low); orig must be an integer in our config
    orig = max(1, round(a / b))
    low, high = orig * b / a, orig * (b + 1) / a
    if not np.allclose(llama3_factors(rot_dim, theta, factor, low, high, orig), f, rtol=1e-4, atol=1e-6):
        raise bad
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": orig}


def gguf_chat_template(path: str | os.PathLike) -> str | None:
    """`tokenizer.chat_template` from the file's metadata (None when it has none)."""
    template = open_gguf(path).metadata.get("tokenizer.chat_template")
    return template if isinstance(template, str) else None
