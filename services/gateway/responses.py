"""`POST /v1/responses` and `GET|DELETE /v1/responses/{id}`: OpenAI's Responses API, translated
onto the chat request every other API uses (services/gateway/chat_bridge.py).

- `input` (a string, or a list of items: messages with text parts, `function_call` and
  `function_call_output` items) and `instructions` become chat messages; `max_output_tokens`,
  temperature, top_p, seed the SamplingParams; `text.format` (json_schema, json_object) the
  structured-outputs constraint; function `tools` / `tool_choice` the chat endpoint's tools.
- The answer's text is a `message` output item, each tool call a `function_call` item; streamed,
  OpenAI's event sequence (`response.created`, `response.in_progress`, items added, text and
  argument deltas, items done, `response.completed` or `response.incomplete`).
- `store` (default true) keeps a response, and the conversation that led to it, in a bounded
  in-memory store (`ResponseStore`: the newest STORE_MAX_ITEMS responses within STORE_MAX_BYTES,
  the least recently used dropped first; per gateway process, gone on restart), so a later
  request continues it with `previous_response_id` and `GET /v1/responses/{id}` returns it.

A field this server does not implement is a 400 naming it, never silently dropped: a Responses
request's fields change the answer's kind (reasoning, built-in tools, background runs...).
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from zeroserve.common.errors import InvalidRequest, ZeroserveError
from zeroserve.services.gateway.chat_bridge import ChatTurn, json_constraint, open_stream, run_whole
from zeroserve.services.gateway.completions import Route, parse_body
from zeroserve.services.gateway.errors import APIError, api_error

STORE_MAX_ITEMS = 1000
STORE_MAX_BYTES = 64 << 20
_json = msgspec.json.Encoder()


def _id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(16).hex()}"


# ================================================================ the request
class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it (module doc)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # not OpenAI's, as on chat completions: reproducible sampling
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)  # echoed back, as OpenAI does
    user: str | None = None  # an end-user id: echoed, used for nothing
    truncation: Literal["disabled"] | None = None  # "auto" would drop input: not done here

    def constraint(self):
        fmt = (self.text.format if self.text else None) or {"type": "text"}
        kind = fmt.get("type")
        allowed = {"text": {"type"}, "json_object": {"type"},
                   "json_schema": {"type", "name", "schema", "strict", "description"}}.get(kind)
        if allowed is None:
            raise InvalidRequest(f"text.format.type must be text, json_object or json_schema, got {kind!r:.40}")
        extra = sorted(set(fmt) - allowed)
        if extra:
            raise InvalidRequest(f"text.format.{extra[0]} is not supported by this server")
        if kind == "json_object":
            return json_constraint(True, "text.format")
        if kind == "json_schema":
            if "schema" not in fmt:
                raise InvalidRequest("text.format.schema is required with type json_schema")
            return json_constraint(fmt["schema"], "text.format.schema")
        return None

    def chat_tools(self) -> tuple[list[dict] | None, Any]:
        """The function tools and tool_choice in chat completions' shape (the shared tool code's)."""
        tools = None
        if self.tools is not None:
            tools = []
            for i, t in enumerate(self.tools):
                if not isinstance(t, dict) or t.get("type") != "function":
                    raise InvalidRequest(f"tools[{i}].type: only function tools are supported, got "
                                         f"{t.get('type') if isinstance(t, dict) else t!r:.40}")
                extra = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
                if extra:
                    raise InvalidRequest(f"tools[{i}].{extra[0]} is not supported by this server")
                fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
                tools.append({"type": "function", "function": fn})
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or set(choice) != {"type", "name"}:
                raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                     '"name": ...}')
            choice = {"type": "function", "function": {"name": choice["name"]}}
        return tools, choice

    def turn(self, history: list[dict[str, Any]]) -> ChatTurn:
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history \
            + input_messages(self.input)
        tools, choice = self.chat_tools()
        params = {"max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "seed": self.seed, "structured_outputs": self.constraint()}
        return ChatTurn(self.model, messages, params, tools, choice, self.parallel_tool_calls)


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else part
            raise InvalidRequest(f"{where}[{j}].type: only text parts ({', '.join(kinds)}) are supported, "
                                 f"got {kind!r:.40}")
        out.append(part["text"])
    return "".join(out)


def input_messages(inp: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: message items as turns (developer as system), consecutive
    function_call items as one assistant turn's tool_calls, function_call_output items as tool turns."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not inp:
        raise InvalidRequest("input is empty; send a string or a list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(inp):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"input[{i}].role must be user, assistant, system or developer, got {role!r:.40}")
            text = _text_of(item.get("content"), f"input[{i}].content", ("input_text", "output_text"))
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(item.get(k), str):
                    raise InvalidRequest(f"input[{i}].{k} must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and "tool_call_id" not in out[-1]:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"input[{i}].call_id must be a string")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text_of(item.get("output"), f"input[{i}].output", ("input_text",))})
        else:
            raise InvalidRequest(f"input[{i}].type: {kind!r:.40} items are not supported (message, function_call "
                                 "and function_call_output are)")
    return out


# ================================================================ the store
class ResponseStore:
    """Stored responses by id, each with the chat messages that continue it (its history, its
    input and its output): at most `max_items` and about `max_bytes` (their JSON size), the least
    recently used dropped first."""

    def __init__(self, max_items: int = STORE_MAX_ITEMS, max_bytes: int = STORE_MAX_BYTES) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: collections.OrderedDict[str, tuple[dict, list[dict], int]] = collections.OrderedDict()
        self.bytes = 0

    def put(self, response: dict, history: list[dict]) -> None:
        size = len(_json.encode(response)) + len(_json.encode(history))
        if size > self.max_bytes:
            return  # larger than the whole store: it could only evict everything else
        self.pop(response["id"])
        self._items[response["id"]] = (response, history, size)
        self.bytes += size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            self.bytes -= self._items.popitem(last=False)[1][2]

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        hit = self._items.get(rid)
        if hit is None:
            return None
        self._items.move_to_end(rid)
        return hit[0], hit[1]

    def pop(self, rid: str) -> bool:
        hit = self._items.pop(rid, None)
        if hit is not None:
            self.bytes -= hit[2]
        return hit is not None

    def __len__(self) -> int:
        return len(self._items)


def _not_found(rid: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id {rid!r:.80} not found (responses are kept in this gateway's memory, "
                         f"the latest {STORE_MAX_ITEMS} at most, and only with store: true)", "NotFoundError",
                    "not_found", param=param)


def store_of(gw) -> ResponseStore:
    st = getattr(gw, "response_store", None)
    if st is None:
        st = gw.response_store = ResponseStore()
    return st


# ================================================================ the response
def _usage(prompt: int, out: int, cached: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + out}


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def history_of(output: list[dict]) -> list[dict]:
    """A response's output items as the chat turn that continues the conversation."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


class _Shape:
    """The response object around an answer (the fields OpenAI echoes from the request)."""

    def __init__(self, req: ResponsesRequest, model: str, rid: str) -> None:
        self.req, self.model, self.id, self.created = req, model, rid, int(time.time())

    def response(self, status: str, output: list[dict], usage: dict | None, finish: str | None = None) -> dict:
        r = self.req
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        if incomplete:
            status = "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "instructions": r.instructions,
                "max_output_tokens": r.max_output_tokens, "model": self.model, "output": output,
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": r.previous_response_id, "temperature": r.temperature, "top_p": r.top_p,
                "text": {"format": (r.text.format if r.text and r.text.format else {"type": "text"})},
                "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "store": r.store,
                "metadata": r.metadata or {}, "truncation": "disabled", "user": r.user, "usage": usage}


# ================================================================ the handler
async def _create(gw, body: bytes):
    req = parse_body(ResponsesRequest, body)
    store = store_of(gw)
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        history = prev[1]
    turn = req.turn(history)
    rid = _id("resp")
    if not req.stream:
        out, model = await run_whole(gw, turn, rid)
        o = out.outputs[0]
        calls = o.tool_calls or []
        content = o.text if o.tool_calls is None else (o.content or "")
        output = ([_message_item(content)] if content or not calls else []) + \
                 [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        shape = _Shape(req, model, rid)
        resp = shape.response("completed", output, _usage(len(out.prompt_token_ids), len(o.token_ids),
                                                          out.num_cached_tokens), o.finish_reason)
        if req.store:
            store.put(resp, turn.messages[1 if req.instructions else 0:] + history_of(output))
        return resp
    pieces, streams, firsts, model = await open_stream(gw, turn, rid)
    return _events(req, _Shape(req, model, rid), turn, pieces, store), streams, firsts


async def _events(req: ResponsesRequest, shape: _Shape, turn: ChatTurn, pieces, store: ResponseStore):
    """The SSE stream: OpenAI's Responses events, each `event: TYPE` + `data: {...}` with a
    running sequence_number; waiting pieces go out in one write."""
    seq = 0
    out: list[bytes] = []
    items: list[dict] = []
    open_msg: int | None = None  # output index of the message item text goes to
    calls: dict[int, int] = {}  # tool call index -> output index

    def ev(kind: str, **data) -> None:
        nonlocal seq
        out.append(b"event: " + kind.encode() + b"\ndata: " + _json.encode({"type": kind, "sequence_number": seq,
                                                                           **data}) + b"\n\n")
        seq += 1

    def add(item: dict) -> int:
        items.append(item)
        ev("response.output_item.added", output_index=len(items) - 1, item={**item})
        return len(items) - 1

    def close_message() -> None:
        nonlocal open_msg
        if open_msg is None:
            return
        item = items[open_msg]
        item["status"] = "completed"
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": open_msg, "content_index": 0}
        ev("response.output_text.done", **where, text=part["text"], logprobs=[])
        ev("response.content_part.done", **where, part=part)
        ev("response.output_item.done", output_index=open_msg, item=item)
        open_msg = None

    ev("response.created", response=shape.response("in_progress", [], None))
    ev("response.in_progress", response=shape.response("in_progress", [], None))
    usage, finish = None, None
    try:
        async for p in pieces:
            for d in p.deltas:
                if "content" in d:
                    if open_msg is None:
                        open_msg = add({**_message_item("", "in_progress"), "content": []})
                        items[open_msg]["content"].append(_text_part(""))
                        ev("response.content_part.added", item_id=items[open_msg]["id"], output_index=open_msg,
                           content_index=0, part=_text_part(""))
                    items[open_msg]["content"][0]["text"] += d["content"]
                    ev("response.output_text.delta", item_id=items[open_msg]["id"], output_index=open_msg,
                       content_index=0, delta=d["content"], logprobs=[])
                    continue
                c = d["tool_calls"][0]
                if "id" in c:  # a call's first piece
                    close_message()
                    calls[c["index"]] = add(_call_item(c["id"], c["function"]["name"], "", "in_progress"))
                args = c["function"].get("arguments") or ""
                if args:
                    i = calls[c["index"]]
                    items[i]["arguments"] += args
                    ev("response.function_call_arguments.delta", item_id=items[i]["id"], output_index=i, delta=args)
            if p.finish_reason is not None:
                usage, finish = _usage(p.prompt_tokens, p.output_tokens, p.cached_tokens), p.finish_reason
            if out and not p.more:
                yield b"".join(out)
                out.clear()
        close_message()
        for i in calls.values():
            it = items[i]
            it["status"] = "completed"
            ev("response.function_call_arguments.done", item_id=it["id"], output_index=i, name=it["name"],
               arguments=it["arguments"])
            ev("response.output_item.done", output_index=i, item=it)
        resp = shape.response("completed", items, usage, finish)
        ev("response.completed" if resp["status"] == "completed" else "response.incomplete", response=resp)
        if req.store:
            store.put(resp, turn.messages[1 if req.instructions else 0:] + history_of(items))
    except ZeroserveError as e:  # mid-stream: the status is sent already
        err = api_error(e)
        ev("error", code=err.code, message=err.message, param=err.param)
    yield b"".join(out)


async def get_response(gw, rid: str) -> dict:
    hit = store_of(gw).get(rid)
    if hit is None:
        raise _not_found(rid)
    return hit[0]


async def delete_response(gw, rid: str) -> dict:
    if not store_of(gw).pop(rid):
        raise _not_found(rid)
    return {"id": rid, "object": "response.deleted", "deleted": True}


ROUTES = {"/v1/responses": Route(_create)}
