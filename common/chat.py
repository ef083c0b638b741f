"""Chat prompts: one place that turns a conversation into prompt token ids.

The scheduler's tokenizer pool and the in-process engine both call `chat_prompt`, so every
client (Python, HTTP gateway, offline `LLM.chat`) gets the same prompt for the same messages:
the model's chat template (from tokenizer_config.json, chat_template.jinja or GGUF metadata;
or a template file given with ``--chat-template``) rendered with the generation prompt, then
tokenized without adding special tokens again (the template writes BOS where the model wants
one), as vLLM does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from zeroserve.common.errors import InvalidRequest, ModelLoadError

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


@functools.lru_cache(maxsize=16)
def compile_template(template: str):
    """A chat template compiled the way transformers' apply_chat_template compiles it (same
    sandbox, trimming, extensions, filters and globals), so the same template renders the same
    text here without importing transformers: a sandboxed, immutable environment (templates from
    a model repository are untrusted code), `tojson` without HTML escaping and with json.dumps'
    options, `raise_exception`, `strftime_now`, and the `{% generation %}` tag (rendered as its body)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # HF templates mark assistant text with {% generation %}...{% endgeneration %} for
        # training masks; serving only renders it
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        # no underscore names: a template must not reach Python internals through a namespace
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dict(), namespace=Namespace)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, **special_tokens: Any) -> str:
    """The template rendered for a conversation, as `apply_chat_template(tokenize=False)`: keys
    whose value is None dropped from each message, a message's reasoning visible under every
    name templates read it by, the tokenizer's named special tokens (bos_token...) as variables."""
    chat = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    return compile_template(template).render(messages=chat, tools=tools, documents=None,
                                             add_generation_prompt=add_generation_prompt, **special_tokens)


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
