"""Tokenizer loading: one place that turns a model directory (or a .gguf file) into a fast HF tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from common.errors import ModelLoadError
from common.model_config import resolve_model_path


def load_tokenizer(model_dir: str | os.PathLike, **kwargs: Any):
    """Return `transformers.AutoTokenizer.from_pretrained(model_dir)` (a fast tokenizer).

    Raises ModelLoadError when the directory has no tokenizer.json, when that file is not valid
    JSON, or when transformers cannot build a tokenizer from it. GGUF models (see
    `resolve_model_path`) get theirs built from the file's metadata."""
    kind, path = resolve_model_path(model_dir)
    if kind == "gguf":
        return _load_gguf_tokenizer(path, **kwargs)
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

    from transformers import AutoTokenizer

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
    from transformers import PreTrainedTokenizerFast

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
