"""Chat prompts: one place that turns a conversation into prompt token ids.

The scheduler's tokenizer pool and the in-process engine both call `chat_prompt`, so every
client (Python, HTTP gateway, offline `LLM.chat`) gets the same prompt for the same messages:
the model's chat template (from tokenizer_config.json, chat_template.jinja or GGUF metadata;
or a template file given with ``--chat-template``) rendered with the generation prompt, then
tokenized without adding special tokens again (the template writes BOS where the model wants
one), as vLLM does.
"""

from __future__ import annotations

import json
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
        calls, call_id = get("tool_calls"), get("tool_call_id")
        if calls is not None:
            d["tool_calls"] = _check_calls(calls, i)
        if call_id is not None:
            if not isinstance(call_id, str) or len(call_id) > 256:
                raise InvalidRequest(f"messages[{i}].tool_call_id must be a string of at most 256 characters")
            d["tool_call_id"] = call_id
        out.append(d)
    return out


def _check_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant turn's tool calls in OpenAI's shape. Arguments travel as JSON text (OpenAI)
    but chat templates read them as objects (`tool_call.arguments | tojson`): they are parsed
    here, as vLLM does."""
    if not isinstance(calls, list) or len(calls) > 128:
        raise InvalidRequest(f"messages[{i}].tool_calls must be a list of at most 128 calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f'messages[{i}].tool_calls[{j}] must be {{"id": ..., "type": "function", '
                                 '"function": {"name": ..., "arguments": "{...}"}}')
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise InvalidRequest(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON") from None
        if not isinstance(args, dict):
            raise InvalidRequest(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _tools_in_system_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A template that never reads `tools` would hide them from the model: they go into the system
    message instead, with the call format tool_choice "required" enforces (llama.cpp's generic way)."""
    text = ("You can call these tools (their parameters as JSON Schema):\n" + json.dumps(tools, ensure_ascii=False)
            + '\nTo call tools, answer with only a JSON array: [{"name": <tool name>, "parameters": {<arguments>}}].')
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], template: str | None = None,
                tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """(rendered text, token ids) of a conversation, ready for the assistant's turn; `tools`
    (OpenAI function definitions) are rendered by the template as HF templates take them."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequest("this model has no chat template (none in tokenizer_config.json, chat_template.jinja "
                             "or the GGUF file); send a plain prompt, or start the cluster with --chat-template FILE")
    if tools and "tools" not in template:
        messages = _tools_in_system_prompt(messages, tools)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=template,
                                             tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja raises many types (e.g. a template that refuses a role)
        raise InvalidRequest(f"the chat template refused these messages: {type(e).__name__}: {e}") from None
    return text, tokenizer.encode(text, add_special_tokens=False)
