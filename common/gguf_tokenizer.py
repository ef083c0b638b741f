"""A GGUF file's tokenizer (the `tokenizer.ggml.*` metadata llama.cpp writes) as a `tokenizers`
tokenizer, without transformers: importing transformers (and with it torch) costs the scheduler,
gateway and detokenizer seconds of CPU at start, taken from the worker on a small machine.

The tokenizer built equals the one transformers builds from the same file (`gguf_file=`; checked
id for id in tests/test_tokenizer.py): byte-level BPE (`tokenizer.ggml.model` "gpt2", with the
split regex `tokenizer.ggml.pre` names) and sentencepiece BPE ("llama", byte fallback, "▁" for
spaces). Other kinds raise `Unsupported`; `zeroserve.common.tokenizer` then falls back to transformers.
"""

from __future__ import annotations

import os
import struct
from typing import Any

from zeroserve.common.errors import ModelLoadError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# The split regexes of the byte-level vocabularies (llama.cpp's `tokenizer.ggml.pre` names them;
# these are the tokenizers' own definitions, as in their tokenizer.json). Names not listed keep
# GPT-2's regex (the ByteLevel pre-tokenizer's built-in one), as transformers does.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3),
          **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2)}

_WANTED = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


class Unsupported(ModelLoadError):
    """A tokenizer kind this module does not build (the caller may use transformers instead)."""


def read_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Every `tokenizer.*` and `general.architecture` key of the file, long arrays in full
    (zeroserve.common.gguf_config keeps only their lengths, which is all the model config needs)."""
    from zeroserve.common import gguf_config as g

    gf = g.open_gguf(path)
    meta = {k: v for k, v in gf.metadata.items() if k.startswith("tokenizer.") or k == "general.architecture"}
    buf = gf._map
    n_kv = struct.unpack_from("<Q", buf, 16)[0]
    pos = 24
    for _ in range(n_kv):  # walk the header again, decoding only the arrays we want in full
        key, pos = g._read_string(buf, pos)
        vtype = g._U32.unpack_from(buf, pos)[0]
        if key in _WANTED and vtype == g._ARRAY:
            meta[key], pos = _read_array(buf, pos + 4)
        else:
            _, pos = g._read_value(buf, pos + 4, vtype)
    return meta


def _read_array(buf, pos: int) -> tuple[list, int]:
    from zeroserve.common import gguf_config as g

    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in g._SCALARS:
        fmt = g._SCALARS[etype]
        return list(struct.unpack_from(f"<{count}{fmt}", buf, pos)), pos + struct.calcsize("<" + fmt) * count
    if etype != g._STRING:
        raise ModelLoadError(f"unexpected GGUF array element type {etype} in the tokenizer metadata")
    out = []
    for _ in range(count):
        s, pos = g._read_string(buf, pos)
        out.append(s)
    return out, pos


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted
    past 255 so every byte has a visible, non-whitespace character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]] | None:
    merges = meta.get("tokenizer.ggml.merges")
    if isinstance(merges, int):
        raise ModelLoadError("GGUF merges were not read in full")
    return [tuple(m.split(" ", 1)) for m in merges] if merges else None


def _byte_level(meta: dict[str, Any], tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # a token llama.cpp wrote outside the byte alphabet (an added token's plain text) is
    # respelled in it, so the BPE model finds it
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = _merges(meta)
    if merges is None:
        raise Unsupported("a byte-level GGUF vocabulary without merges")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    split = SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _sentencepiece(meta: dict[str, Any], tokens: list[str]):
    """Llama's sentencepiece BPE as tokenizer.json spells it: spaces as "▁" with one prepended
    (Metaspace), unknown bytes as <0xNN> tokens (byte fallback)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(meta)
    if merges is None:  # older files: merges implied by the scores (best pair first)
        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, list):
            raise Unsupported("a sentencepiece GGUF vocabulary with neither merges nor scores")
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    # no unk token in the model, as transformers builds it: byte fallback spells any character
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    return tok, None


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a vocabulary token into two vocabulary tokens, ordered by the merged
    token's score (higher first), then by the pieces' ids (sentencepiece's BPE order)."""
    found = []
    for merged, score in scores.items():
        for i in range(1, len(merged)):
            a, b = merged[:i], merged[i:]
            if a in vocab and b in vocab:
                found.append((-score, vocab[a], vocab[b], a, b))
    found.sort()
    return [(a, b) for _, _, _, a, b in found]


def build_gguf_tokenizer(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, config) for a GGUF file; config holds the special tokens
    (bos_token, eos_token, unk_token, pad_token: strings or None), add_bos_token,
    add_eos_token and chat_template, as transformers reads them from the same keys."""
    from tokenizers import AddedToken

    meta = read_tokenizer_metadata(path)
    kind, arch = meta.get("tokenizer.ggml.model"), meta.get("general.architecture")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(f"{os.fspath(path)}: no tokenizer vocabulary in the GGUF metadata")
    if kind == "gpt2":
        tok, alphabet = _byte_level(meta, tokens)
    elif kind == "llama" and arch not in ("gemma", "gemma2", "gemma3", "phi3"):
        tok, alphabet = _sentencepiece(meta, tokens)
    else:
        raise Unsupported(f"GGUF tokenizer {kind!r} for architecture {arch!r}")
    types = meta.get("tokenizer.ggml.token_type")
    types = types if isinstance(types, list) else []
    # control tokens (<|im_end|>...) stay whole and count as special; one spelled outside a
    # byte-level alphabet is a mislabel llama.cpp makes, skipped as transformers skips it
    control = [t for t, k in zip(tokens, types) if k == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = tok.get_vocab(with_added_tokens=True)
    user = [t for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    cfg = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
           "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
           "chat_template": meta.get("tokenizer.chat_template")}
    # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
    add_bos = meta.get("tokenizer.ggml.add_bos_token", True if kind == "llama" else None)
    if add_bos is not None:
        cfg["add_bos_token"] = bool(add_bos)
    if "tokenizer.ggml.add_eos_token" in meta:
        cfg["add_eos_token"] = bool(meta["tokenizer.ggml.add_eos_token"])
    return tok, cfg
