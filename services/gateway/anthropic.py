"""`POST /v1/messages`: Anthropic's Messages API, translated onto the chat request every other
API uses (services/gateway/chat_bridge.py), for Claude-compatible tools and the `anthropic` SDK.

- `system` (text or text blocks) and `messages` (text, `tool_use` and `tool_result` blocks)
  become chat turns: an assistant's tool_use blocks its tool_calls, a user's tool_result blocks
  `tool` turns; `max_tokens`, `stop_sequences`, temperature / top_p / top_k the SamplingParams;
  `tools` ({name, description, input_schema}) and `tool_choice` (auto, any, tool, none;
  `disable_parallel_tool_use`) the chat endpoint's tools and their grammar;
  `output_config.format` (json_schema) the structured-outputs constraint.
- The answer is text and `tool_use` content blocks with Anthropic's stop_reason (end_turn,
  max_tokens, stop_sequence, tool_use); streamed, Anthropic's events (message_start,
  content_block_start / delta / stop, message_delta, message_stop).
- Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}` with its statuses; the
  gateway's API key is accepted as `x-api-key` as well as a bearer token (app.py).

An unknown field is a 400 naming it (thinking, images, server tools... are not served here).
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from zeroserve.common.errors import InvalidRequest, ZeroserveError
from zeroserve.services.gateway.chat_bridge import ChatTurn, arguments_object, json_constraint, open_stream, run_whole
from zeroserve.services.gateway.completions import Route, parse_body
from zeroserve.services.gateway.errors import APIError, api_error

_json = msgspec.json.Encoder()
# OpenAI-style error type (errors.py) -> Anthropic's error type; the status stays, except that an
# overloaded cluster is Anthropic's 529 overloaded_error (its SDKs retry that one)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
          429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


class AnthropicError(APIError):
    def body(self) -> dict:
        return {"type": "error", "error": {"type": _TYPES.get(self.status, "api_error"), "message": self.message}}


def anthropic_error(e: BaseException) -> AnthropicError:
    err = api_error(e)
    status = 529 if err.code == "overloaded" else err.status
    return AnthropicError(status, err.message, err.type, err.code, err.param, err.headers)


# ================================================================ the request
class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it (module doc)

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None  # user_id: an end-user id, used for nothing
    output_config: dict[str, Any] | None = None

    def constraint(self):
        cfg = self.output_config or {}
        extra = sorted(set(cfg) - {"format"})
        if extra:
            raise InvalidRequest(f"output_config.{extra[0]} is not supported by this server")
        fmt = cfg.get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
            raise InvalidRequest('output_config.format must be {"type": "json_schema", "schema": {...}}')
        return json_constraint(fmt["schema"], "output_config.format.schema")

    def chat_tools(self) -> tuple[list[dict] | None, Any, bool | None]:
        tools = None
        if self.tools is not None:
            tools = []
            for i, t in enumerate(self.tools):
                if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                    raise InvalidRequest(f"tools[{i}].type: only client tools ({{name, description, input_schema}}) "
                                         "are supported")
                extra = sorted(set(t) - {"type", "name", "description", "input_schema", "cache_control"})
                if extra:
                    raise InvalidRequest(f"tools[{i}].{extra[0]} is not supported by this server")
                fn = {"name": t.get("name"), "parameters": t.get("input_schema")}
                if t.get("description") is not None:
                    fn["description"] = t["description"]
                tools.append({"type": "function", "function": fn})
        tc = self.tool_choice
        if tc is None:
            return tools, None, None
        kind = tc.get("type")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            choice = {"type": "function", "function": {"name": tc.get("name")}}
        if choice is None or set(tc) - {"type", "name", "disable_parallel_tool_use"}:
            raise InvalidRequest('tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", '
                                 '"name": ...} (with disable_parallel_tool_use)')
        return tools, choice, (False if tc.get("disable_parallel_tool_use") else None)

    def turn(self) -> ChatTurn:
        messages = []
        if self.system:
            messages.append({"role": "system", "content": _text(self.system, "system")})
        for i, m in enumerate(self.messages):
            messages += _turns(m, i)
        tools, choice, parallel = self.chat_tools()
        params = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "stop": self.stop_sequences or None, "structured_outputs": self.constraint()}
        return ChatTurn(self.model, messages, params, tools, choice, parallel)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of text blocks")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise InvalidRequest(f"{where}[{j}].type: only text blocks are supported here")
    return "".join(b["text"] for b in content)


def _turns(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat turns: a user's tool_result blocks become `tool` turns (before
    its text), an assistant's tool_use blocks its tool_calls."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or set(m) - {"role", "content"}:
        raise InvalidRequest(f'{where} must be {{"role": "user" | "assistant", "content": ...}}')
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of content blocks")
    text, calls, results = [], [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
                    or not isinstance(b.get("input"), dict):
                raise InvalidRequest(f"{at}: a tool_use block needs id, name and input (an object)")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise InvalidRequest(f"{at}.tool_use_id must be a string")
            out = _text(b.get("content", ""), f"{at}.content")
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": f"Error: {out}" if b.get("is_error") else out})
        else:
            raise InvalidRequest(f"{at}.type: {kind!r:.40} blocks are not supported in a {role} message (text, "
                                 + ("tool_use" if role == "assistant" else "tool_result") + " are)")
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


# ================================================================ the answer
def _stop(finish: str | None, stop_reason: Any) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finish."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(prompt: int, out: int, cached: int) -> dict:
    return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_tokens": out}


def _tool_id() -> str:
    return "toolu_" + os.urandom(12).hex()


def _message(rid: str, model: str, content: list, stop: tuple[str | None, str | None], usage: dict) -> dict:
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


async def _create(gw, body: bytes):
    req = parse_body(MessagesRequest, body)
    turn = req.turn()
    rid = "msg_" + os.urandom(12).hex()
    if not req.stream:
        out, model = await run_whole(gw, turn, rid)
        o = out.outputs[0]
        text = o.text if o.tool_calls is None else (o.content or "")
        content = ([{"type": "text", "text": text}] if text or not o.tool_calls else []) + \
            [{"type": "tool_use", "id": _tool_id(), "name": c["function"]["name"],
              "input": arguments_object(c["function"]["arguments"])} for c in o.tool_calls or []]
        finish = "tool_calls" if o.tool_calls else o.finish_reason
        return _message(rid, model, content, _stop(finish, o.stop_reason),
                        _usage(len(out.prompt_token_ids), len(o.token_ids), out.num_cached_tokens))
    pieces, streams, firsts, model = await open_stream(gw, turn, rid)
    prompt = len(firsts[0].prompt_token_ids or []) if not isinstance(firsts[0], StopAsyncIteration) else 0
    return _events(rid, model, prompt, pieces), streams, firsts


async def _events(rid: str, model: str, prompt: int, pieces):
    """Anthropic's SSE events; waiting pieces go out in one write."""
    out: list[bytes] = []
    block: list[Any] = [None, -1]  # the open content block's kind ("text" / a tool call's index) and index

    def ev(kind: str, **data) -> None:
        out.append(b"event: " + kind.encode() + b"\ndata: " + _json.encode({"type": kind, **data}) + b"\n\n")

    def start(kind: Any, content_block: dict) -> None:
        if block[0] is not None:
            ev("content_block_stop", index=block[1])
        block[0], block[1] = kind, block[1] + 1
        ev("content_block_start", index=block[1], content_block=content_block)

    ev("message_start", message=_message(rid, model, [], (None, None), _usage(prompt, 0, 0)))
    try:
        async for p in pieces:
            for d in p.deltas:
                if "content" in d:
                    if block[0] != "text":
                        start("text", {"type": "text", "text": ""})
                    ev("content_block_delta", index=block[1], delta={"type": "text_delta", "text": d["content"]})
                    continue
                c = d["tool_calls"][0]
                if "id" in c:  # a call's first piece
                    start(c["index"], {"type": "tool_use", "id": _tool_id(), "name": c["function"]["name"],
                                       "input": {}})
                if c["function"].get("arguments"):
                    ev("content_block_delta", index=block[1],
                       delta={"type": "input_json_delta", "partial_json": c["function"]["arguments"]})
            if p.finish_reason is not None:
                if block[0] is not None:
                    ev("content_block_stop", index=block[1])
                reason, seq = _stop(p.finish_reason, p.stop_reason)
                ev("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                   usage=_usage(p.prompt_tokens, p.output_tokens, p.cached_tokens))
                ev("message_stop")
            if out and not p.more:
                yield b"".join(out)
                out.clear()
    except ZeroserveError as e:  # mid-stream: the status is sent already
        ev("error", error=anthropic_error(e).body()["error"])
    if out:
        yield b"".join(out)


ROUTES = {"/v1/messages": Route(_create, anthropic_error)}
