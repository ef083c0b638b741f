"""What the Responses and Anthropic Messages translations share: a request already turned into
OpenAI chat terms (messages, SamplingParams, tools) run on the cluster, whole or streamed.

Each API module only maps its own fields onto a `ChatTurn` and the result back onto its own
shapes; the chat template, the tool constraint (`required` / a named function), the tool-call
parsers and the streamed tool-call pieces are the chat endpoint's (common/tools.py,
services/gateway/tools.py), so every API answers a tool call alike.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.sampling_params import MODEL_DEFAULT_FIELDS, StructuredOutputsParams
from zeroserve.common.tools import ToolSpec, ToolStream, check_tools
from zeroserve.services.gateway.completions import _chain, _prefetch
from zeroserve.services.gateway.tools import tool_parser


@dataclass
class ChatTurn:
    """One request in chat terms. `params` are SamplingParams fields (a dict: the fields it leaves
    out are `unset` and take the model's generation config, as on /v1/chat/completions)."""

    model: str | None
    messages: list[dict[str, Any]]
    params: dict[str, Any]
    tools: list[dict[str, Any]] | None = None  # OpenAI chat's {"type": "function", "function": {...}}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    spec: ToolSpec | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.spec = check_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def unset(self) -> list[str]:
        return [k for k in MODEL_DEFAULT_FIELDS if self.params.get(k) is None]

    def sampling(self, model: str) -> dict[str, Any]:
        return {k: v for k, v in self.params.items() if v is not None} | {"model": model}

    def tool_kwargs(self) -> dict[str, Any]:
        return {"tools": self.tools, "tool_choice": self.tool_choice, "parallel_tool_calls": self.parallel_tool_calls}


def json_constraint(schema: Any, where: str) -> StructuredOutputsParams:
    """A JSON Schema (or True: any JSON object) as the output's constraint; `where` names the field."""
    if schema is True:
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where} must be a JSON Schema object")
    return StructuredOutputsParams(json=schema)


def arguments_object(text: str) -> dict[str, Any]:
    """A call's arguments (JSON text of an object, as the parsers guarantee) as an object."""
    try:
        v = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


async def _parser(gw, turn: ChatTurn, model: str) -> str | None:
    spec = turn.spec
    return await tool_parser(gw, model) if spec is not None and spec.choice == "auto" else None


async def run_whole(gw, turn: ChatTurn, rid: str):
    """The whole answer (a RequestOutput whose outputs carry `content` / `tool_calls` when the
    request had tools) and the served model's name."""
    model = await gw.resolve_model(turn.model)
    out = await gw.client.chat(turn.messages, turn.sampling(model), rid, request_timeout_s=gw.cfg.request_timeout_s,
                               model_defaults=turn.unset(), tool_parser=await _parser(gw, turn, model),
                               **turn.tool_kwargs())
    return out, model


@dataclass
class Piece:
    """A streamed answer's next pieces: OpenAI chat deltas (`{"content": ...}` or
    `{"tool_calls": [...]}`, common/tools.py's ToolStream), and on the last piece the finish."""

    deltas: list[dict[str, Any]]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    more: bool = False  # another piece is waiting already (the caller may join their writes)


async def open_stream(gw, turn: ChatTurn, rid: str):
    """Start the answer's stream and wait for its first delta (so errors come before any HTTP
    status) -> (the pieces, the cluster streams to close, the first deltas, the model)."""
    model = await gw.resolve_model(turn.model)
    parser = await _parser(gw, turn, model)
    streams = [gw.client.stream_chat(turn.messages, turn.sampling(model), rid,
                                     request_timeout_s=gw.cfg.request_timeout_s, model_defaults=turn.unset(),
                                     **turn.tool_kwargs())]
    firsts = await _prefetch(streams)
    shaper = ToolStream(turn.spec, parser)

    async def pieces() -> AsyncIterator[Piece]:
        prompt = cached = out = 0
        async for _, d, more in _chain(firsts, streams):
            if d.prompt_token_ids is not None:
                prompt, cached = len(d.prompt_token_ids), d.num_cached_tokens
            out += len(d.token_ids)
            p = Piece(shaper.feed(d.text), prompt_tokens=prompt, cached_tokens=cached, output_tokens=out, more=more)
            if d.finish_reason is not None:
                p.deltas += shaper.finish()
                p.finish_reason = "tool_calls" if shaper.calls else d.finish_reason
                p.stop_reason = d.stop_reason
            yield p

    return pieces(), streams, firsts, model
