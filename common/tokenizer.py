"""Tokenizer loading: one place that turns a model directory (or a .gguf file) into a fast HF tokenizer,
and `load_decoder`, the detokenizer's decode-only twin that needs no transformers import."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from common.errors import ModelLoadError
from common.model_config import resolve_model_path


def load_tokenizer_file_check(path: Path) -> None:
    """ModelLoadError unless `path` is a directory with a readable, valid tokenizer.json."""
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist or is not a directory")
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelLoadError(
            f"missing tokenizer.json in model directory {str(path)!r} (zeroserve needs a fast tokenizer file)"
        )
    try:
        with open(tok_file, encoding="utf-8") as f:
            json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"broken tokenizer file {str(tok_file)!r}: {e}") from None


_IMPORT_LOCK = threading.Lock()


def _transformers():
    """transformers, its first import under a lock. Its lazy top-level module is not safe to
    import from two threads at once: one of them gets `ImportError: cannot import name
    'AutoTokenizer'` (the scheduler's pool loads one tokenizer per model in parallel, so a
    cluster serving two models lost one of them). The names are resolved under the lock too."""
    with _IMPORT_LOCK:
        import transformers

        return transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast


def load_tokenizer(model_dir: str | os.PathLike, **kwargs: Any):
    """Return `transformers.AutoTokenizer.from_pretrained(model_dir)` (a fast tokenizer).

    Raises ModelLoadError when the directory has no tokenizer.json, when that file is not valid
    JSON, or when transformers cannot build a tokenizer from it. GGUF models (see
    `resolve_model_path`) get theirs built from the file's metadata."""
    kind, path = resolve_model_path(model_dir)
    if kind == "gguf":
        return _load_gguf_tokenizer(path, **kwargs)
    load_tokenizer_file_check(path)

    AutoTokenizer = _transformers()[0]  # noqa: N806 (transformers' name)

    try:
        tok = AutoTokenizer.from_pretrained(str(path), **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ModelLoadError(f"cannot load tokenizer from {str(path)!r}: {type(e).__name__}: {e}") from None
    if not getattr(tok, "is_fast", False):
        raise ModelLoadError(f"tokenizer in {str(path)!r} is not a fast (tokenizers-backed) tokenizer")
    return tok


def _load_gguf_tokenizer(path: Path, **kwargs: Any):
    """A fast tokenizer from the vocabulary, merges and special tokens in a GGUF's metadata.

    PreTrainedTokenizerFast takes `gguf_file` directly; AutoTokenizer would first rebuild the
    whole model config from the file with the slow reader (~10x longer) only to pick this class."""
    PreTrainedTokenizerFast = _transformers()[1]  # noqa: N806 (transformers' name)

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ModelLoadError(f"cannot build a tokenizer from {str(path)!r}: {type(e).__name__}: {e}") from None
    if not getattr(tok, "chat_template", None):  # older transformers drop it
        from common.gguf_config import gguf_chat_template

        template = gguf_chat_template(path)
        if template:
            tok.chat_template = template
    return tok


class Decoder:
    """`decode()` of an HF model directory's tokenizer.json through the `tokenizers` library
    alone: importing transformers costs seconds, and the detokenizer only decodes (its restart
    time is the streams' stall). Special tokens are the ones transformers would mark special:
    tokenizer.json's, plus tokenizer_config.json's added_tokens_decoder and *_token entries."""

    def __init__(self, path: Path) -> None:
        from tokenizers import AddedToken, Tokenizer

        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        specials = [v["content"] for v in (cfg.get("added_tokens_decoder") or {}).values()
                    if isinstance(v, dict) and v.get("special") and isinstance(v.get("content"), str)]
        for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
            v = cfg.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                specials.append(v)
        specials += [t for t in cfg.get("additional_special_tokens") or [] if isinstance(t, str)]
        if specials:
            self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(specials)])

    def decode(self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("Decoder does not clean up tokenization spaces (the detokenizer never asks it to)")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def load_decoder(model_dir: str | os.PathLike) -> Any:
    """What the detokenizer decodes with: a `Decoder` for an HF directory, the full tokenizer for
    a GGUF file (its vocabulary lives in the file's metadata, which transformers converts)."""
    kind, path = resolve_model_path(model_dir)
    if kind == "gguf":
        return load_tokenizer(path)
    load_tokenizer_file_check(path)
    try:
        return Decoder(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
        raise ModelLoadError(f"cannot load tokenizer.json from {str(path)!r}: {type(e).__name__}: {e}") from None
