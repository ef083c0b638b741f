"""Tokenizers: one place that turns a model directory (or a .gguf file) into a tokenizer.

`FastTokenizer` is the `tokenizers` library's tokenizer with the parts of transformers' fast
tokenizer that serving uses (encode, decode, apply_chat_template, special tokens), built from the
same files by the same rules, without importing transformers (and with it torch): that import
costs seconds of CPU in every process that loads a tokenizer (scheduler, gateway, detokenizer),
taken from the worker on a small machine. tests/test_tokenizer.py checks it equals transformers'
id for id and template for template. Only constrained decoding's xgrammar, which imports
transformers itself, gets a transformers view of it (`to_transformers`), on the first constraint.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.model_config import resolve_model_path

NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

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


def load_tokenizer(model_dir: str | os.PathLike, **kwargs: Any) -> "FastTokenizer":
    """The tokenizer of an HF model directory (tokenizer.json + tokenizer_config.json) or of a
    .gguf file (its metadata). ModelLoadError when the directory has no tokenizer.json, when that
    file is not valid JSON, or when it cannot be built."""
    if kwargs:
        raise TypeError(f"load_tokenizer takes no options, got {sorted(kwargs)}")
    kind, path = resolve_model_path(model_dir)
    if kind == "gguf":
        return _load_gguf_tokenizer(path)
    load_tokenizer_file_check(path)
    try:
        return FastTokenizer(path)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
        raise ModelLoadError(f"cannot load tokenizer from {str(path)!r}: {type(e).__name__}: {e}") from None


def _load_gguf_tokenizer(path: Path) -> "FastTokenizer":
    from zeroserve.common.gguf_tokenizer import Unsupported, build_gguf_tokenizer

    try:
        backend, cfg = build_gguf_tokenizer(path)
    except Unsupported as e:
        from zeroserve.common.log import get_logger

        get_logger("tokenizer").warning("building this GGUF tokenizer through transformers (imports torch)",
                                        reason=str(e), path=str(path))
        return _transformers_gguf_tokenizer(path)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
        raise ModelLoadError(f"cannot build a tokenizer from {str(path)!r}: {type(e).__name__}: {e}") from None
    return FastTokenizer(path, backend=backend, config=cfg)


_IMPORT_LOCK = threading.Lock()


def _transformers_fast_class():
    """transformers' PreTrainedTokenizerFast, its first import under a lock. Its lazy top-level
    module is not safe to import from two threads at once: one of them gets `ImportError: cannot
    import name ...` (the scheduler prepares one grammar compiler per served model in parallel,
    each asking for a transformers view of its tokenizer)."""
    with _IMPORT_LOCK:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast


def _transformers_gguf_tokenizer(path: Path) -> "FastTokenizer":
    """The kinds gguf_tokenizer does not build (t5, gemma's and phi3's sentencepiece variants):
    transformers' own conversion, kept as a FastTokenizer of its backend and special tokens."""
    PreTrainedTokenizerFast = _transformers_fast_class()  # noqa: N806 (transformers' name)

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ModelLoadError(f"cannot build a tokenizer from {str(path)!r}: {type(e).__name__}: {e}") from None
    cfg = dict(tok.special_tokens_map)
    from zeroserve.common.gguf_config import gguf_chat_template

    cfg["chat_template"] = getattr(tok, "chat_template", None) or gguf_chat_template(path)
    return FastTokenizer(path, backend=tok.backend_tokenizer, config=cfg)


def _content(v: Any) -> str | None:
    v = v.get("content") if isinstance(v, dict) else v
    return v if isinstance(v, str) else None


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}


class FastTokenizer:
    """A fast tokenizer as transformers builds it from a model directory (or from `backend` and
    `config`, a GGUF's): tokenizer_config.json's special tokens added as special when missing,
    the BOS/EOS post-processor rebuilt when the config names add_bos_token/add_eos_token (or the
    file has none), `clean_up_tokenization_spaces` except for BPE (transformers skips it there),
    the chat template from the config, chat_template.jinja or chat_template.json."""

    is_fast = True

    def __init__(self, path: str | os.PathLike, backend: Any = None, config: dict[str, Any] | None = None) -> None:
        from tokenizers import AddedToken, processors
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        self.name_or_path = str(path)
        if backend is None:
            backend = _Tokenizer.from_file(str(path / "tokenizer.json"))
            config = {**_read_json(path / "special_tokens_map.json"), **_read_json(path / "tokenizer_config.json")}
            config.setdefault("chat_template", self._template_file(path))
        cfg = config or {}
        self._tok = backend
        self.chat_template = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": ..., "template": ...}] (older configs)
            self.chat_template = {t["name"]: t["template"] for t in self.chat_template}
        self.clean_up_tokenization_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        self._specials = {k: _content(cfg.get(k)) for k in NAMED_SPECIALS}
        extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or []
        extra = [t for t in map(_content, extra if isinstance(extra, list) else []) if t]
        # the config's specials become the backend's special tokens where it lacks them
        added = {t.content: t for t in backend.get_added_tokens_decoder().values()}
        dec = cfg.get("added_tokens_decoder") or {}
        extra_added = [AddedToken(v["content"], special=bool(v.get("special")), normalized=bool(v.get("normalized", False)),
                                  lstrip=bool(v.get("lstrip")), rstrip=bool(v.get("rstrip")),
                                  single_word=bool(v.get("single_word")))
                       for _, v in sorted(dec.items(), key=lambda kv: int(kv[0]))
                       if isinstance(v, dict) and isinstance(v.get("content"), str) and v["content"] not in added]
        for t in [s for s in self._specials.values() if s] + extra:
            if t not in added and all(t != a.content for a in extra_added):
                extra_added.append(AddedToken(t, special=True, normalized=False))
        if extra_added:
            backend.add_tokens(extra_added)
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.add_eos_token = bool(cfg.get("add_eos_token", False))
        if "add_bos_token" in cfg or "add_eos_token" in cfg or backend.post_processor is None:
            bos, eos = self._specials["bos_token"], self._specials["eos_token"]
            add_bos, add_eos = self.add_bos_token and bos is not None, self.add_eos_token and eos is not None
            single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
            pair = " ".join([single] + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
            specials = ([(bos, backend.token_to_id(bos))] if add_bos else []) + ([(eos, backend.token_to_id(eos))] if add_eos else [])
            backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
        self._bpe = type(backend.model).__name__ == "BPE"

    @staticmethod
    def _template_file(path: Path) -> str | None:
        if (path / "chat_template.jinja").is_file():
            return (path / "chat_template.jinja").read_text(encoding="utf-8")
        j = _read_json(path / "chat_template.json")
        return j.get("chat_template") if isinstance(j, dict) else None

    # ------------------------------------------------------------ transformers' names
    @property
    def backend_tokenizer(self):
        return self._tok

    def __getattr__(self, name: str) -> Any:  # bos_token, eos_token_id, ...
        if name in NAMED_SPECIALS:
            return self._specials[name]
        if name.endswith("_id") and name[:-3] in NAMED_SPECIALS:
            t = self._specials[name[:-3]]
            return None if t is None else self._tok.token_to_id(t)
        raise AttributeError(name)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {k: v for k, v in self._specials.items() if v is not None}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=self.encode(text, add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        if isinstance(ids, int):
            ids = [ids]
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and not self._bpe:  # transformers skips it for BPE (it would eat real spaces)
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = False, **kwargs: Any):
        """transformers' apply_chat_template for one conversation (zeroserve.common.chat renders it)."""
        from zeroserve.common.chat import render_chat

        template = chat_template or self.chat_template
        if isinstance(template, dict):  # named templates: "tool_use" when tools are given
            template = template.get("tool_use") if tools and "tool_use" in template else template.get("default")
        if not template:
            raise ValueError("this tokenizer has no chat template")
        text = render_chat(template, messages, tools, add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def to_transformers(self):
        """A transformers PreTrainedTokenizerFast over the same backend (xgrammar takes one)."""
        from tokenizers import Tokenizer

        PreTrainedTokenizerFast = _transformers_fast_class()  # noqa: N806 (transformers' name)

        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(self._tok.to_str()), **self.special_tokens_map)
