"""Chat prompts: one place that turns a conversation into prompt token ids.

The scheduler's tokenizer pool and the in-process engine both call `chat_prompt`, so every
client (Python, HTTP gateway, offline `LLM.chat`) gets the same prompt for the same messages:
the model's chat template (from tokenizer_config.json, chat_template.jinja or GGUF metadata;
or a template file given with ``--chat-template``) rendered with the generation prompt, then
tokenized without adding special tokens again (the template writes BOS where the model wants
one), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.errors import InvalidRequest, ModelLoadError

MAX_MESSAGES = 4096


def load_chat_template(path: str | None) -> str | None:
    """The text of a ``--chat-template FILE`` (None: use the model's own)."""
    if not path:
        return None
    p = Path(path).expanduser()
    try:
        return p.read_text(encoding="utf-8")
    except OSError as e:
        raise ModelLoadError(f"cannot read chat template file {str(p)!r}: {e.strerror or e}") from None


def check_messages(messages: Any) -> list[dict[str, str]]:
    """A conversation as plain ``{"role", "content"[, "name"]}`` dicts, or InvalidRequest saying
    what is wrong with which message."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"a conversation holds at most {MAX_MESSAGES} messages, got {len(messages)}")
    out = []
    for i, m in enumerate(messages):
        get = m.get if isinstance(m, dict) else (lambda k, d=None, m=m: getattr(m, k, d))
        role, content, name = get("role"), get("content", ""), get("name")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string (system, user, assistant...)")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string, got {type(content).__name__}")
        d = {"role": role, "content": content}
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequest(f"messages[{i}].name must be a string")
            d["name"] = name
        out.append(d)
    return out


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]], template: str | None = None) -> tuple[str, list[int]]:
    """(rendered text, token ids) of a conversation, ready for the assistant's turn."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequest("this model has no chat template (none in tokenizer_config.json, chat_template.jinja "
                             "or the GGUF file); send a plain prompt, or start the cluster with --chat-template FILE")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja raises many types (e.g. a template that refuses a role)
        raise InvalidRequest(f"the chat template refused these messages: {type(e).__name__}: {e}") from None
    return text, tokenizer.encode(text, add_special_tokens=False)
