"""OpenAI tool calling, shared by the gateway and the Python clients: the request's `tools` and
`tool_choice` checked, the constraint `required` and a named function become, and the model's
output turned into `tool_calls` (whole or streamed).

- `required`: the output is forced (a JSON Schema grammar) to a JSON array of
  `{"name": <one of the tools>, "parameters": <that tool's parameters schema>}` (one item when
  parallel_tool_calls is false, at most MAX_PARALLEL_CALLS otherwise), as vLLM does, so the calls always parse and validate whatever
  the weights. A named function: the output is forced to its parameters' schema, and is the
  call's arguments.
- `auto`: the model chooses; its text is parsed by the parser of its chat template's format
  (common/tool_parsers.py). `none`: the tools are shown to the template, no call is parsed.
"""

from __future__ import annotations

import json
import os
import re
import string
from dataclasses import dataclass
from typing import Any, Callable

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.sampling_params import StructuredOutputsParams
from zeroserve.common.tool_parsers import check_calls, get_parser

MAX_TOOLS = 128
# `required` with parallel calls: at most this many in one answer. An unbounded array lets a model
# (random weights do) add calls until max_tokens cuts the JSON; a bound makes every answer end
MAX_PARALLEL_CALLS = 8
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_EMPTY_PARAMS = {"type": "object", "properties": {}}
_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """OpenAI's form: call_ + 24 alphanumerics."""
    return "call_" + "".join(_ALNUM[b % 62] for b in os.urandom(24))


@dataclass
class ToolSpec:
    """A request's tools, checked: OpenAI's function definitions and what the model may do."""

    tools: list[dict[str, Any]]  # [{"type": "function", "function": {"name", "description"?, "parameters"}}]
    choice: str  # "none" | "auto" | "required" | "function"
    name: str | None = None  # choice "function": which
    parallel: bool = True

    def params_of(self, name: str) -> dict[str, Any]:
        return next(t["function"]["parameters"] for t in self.tools if t["function"]["name"] == name)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def check_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = True) -> ToolSpec | None:
    """The request's tools as a ToolSpec (None: no tools and no tool_choice that needs them), or
    InvalidRequest naming what is wrong."""
    if not isinstance(parallel_tool_calls, bool) and parallel_tool_calls is not None:
        raise InvalidRequest("parallel_tool_calls must be true or false")
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequest(f"tool_choice {tool_choice!r:.80} needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools must be a list of at most {MAX_TOOLS} function definitions")
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                 '"parameters": {...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -, got {name!r:.80}")
        if name in seen:
            raise InvalidRequest(f"tools[{i}]: the function name {name!r} is given twice")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = dict(_EMPTY_PARAMS)
        if not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON Schema object")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise InvalidRequest(f"tools[{i}].function.description must be a string")
        f = {"name": name, "parameters": params}
        if desc is not None:
            f["description"] = desc
        out.append({"type": "function", "function": f})
    spec = ToolSpec(out, "auto", parallel=parallel_tool_calls is not False)
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        spec.choice = tool_choice or "auto"
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in seen:
            raise InvalidRequest(f"tool_choice names the function {name!r:.80}, which is not among the tools "
                                 f"{sorted(seen)}")
        spec.choice, spec.name = "function", name
    else:
        raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": "function", '
                             '"function": {"name": ...}}')
    return spec


def tool_constraint(spec: ToolSpec | None) -> StructuredOutputsParams | None:
    """The grammar `required` and a named function put on the output (None: free output)."""
    if spec is None or spec.choice in ("auto", "none"):
        return None
    if spec.choice == "function":
        return StructuredOutputsParams(json=spec.params_of(spec.name))
    item = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "parameters": spec.params_of(n)},
                       "required": ["name", "parameters"], "additionalProperties": False} for n in spec.names]}
    schema = {"type": "array", "items": item, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if spec.parallel else 1}
    return StructuredOutputsParams(json=schema)


def constrained_params(params: Any, spec: ToolSpec | None) -> Any:
    """`params` (None, a dict of SamplingParams fields, or a SamplingParams) with the constraint
    of `spec`'s tool_choice, in the same form (so the unset fields stay unset)."""
    so = tool_constraint(spec)
    if so is None:
        return params
    from zeroserve.common.sampling_params import SamplingParams

    if params is None:
        return {"structured_outputs": so}
    have = params.get("structured_outputs") if isinstance(params, dict) else getattr(params, "structured_outputs", None)
    if have is not None:
        raise InvalidRequest(f"tool_choice {spec.choice if spec.choice != 'function' else spec.name!r} constrains "
                             "the output itself: send no structured_outputs (or response_format) with it")
    if isinstance(params, dict):
        return {**params, "structured_outputs": so}
    if isinstance(params, SamplingParams):
        return SamplingParams(**{**params.to_dict(), "structured_outputs": so})
    return params  # the caller's own check names the wrong type


def attach_calls(outputs: list, spec: ToolSpec | None, parser: str | None) -> None:
    """Set each CompletionOutput's `content` and `tool_calls` from its text (no tools: untouched)."""
    if spec is None:
        return
    for o in outputs:
        o.content, o.tool_calls = parse_output(spec, o.text, parser)


def call_dict(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_output(spec: ToolSpec | None, text: str, parser: str | None,
                 new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole output. `required` / a named function: the forced JSON
    (an output cut short by max_tokens stays content); `auto`: what `parser` finds, when every
    call names a declared tool with an object of arguments; else the text is content."""
    if spec is None or spec.choice == "none":
        return text, []
    if spec.choice == "function":
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [call_dict(spec.name, text, new_id())]
    if spec.choice == "auto" and parser is None:
        return text, []
    # required: the forced JSON array, read by the same scanner a stream uses (equal arguments)
    parsed = get_parser("json" if spec.choice == "required" else parser).parse(text)
    if not parsed.tool_calls or check_calls(parsed.tool_calls, spec.tools):
        return text, []
    return parsed.content, [call_dict(c.name, c.arguments, new_id()) for c in parsed.tool_calls]


class ToolStream:
    """One streamed completion's text as OpenAI's chat deltas: `{"content": ...}` pieces and
    `{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}` pieces (a
    call's first piece names it, the next ones carry its arguments). Joined, a call's argument
    pieces equal the arguments the whole answer gets."""

    def __init__(self, spec: ToolSpec | None, parser: str | None, new_id: Callable[[], str] = new_call_id) -> None:
        self.spec, self.new_id = spec, new_id
        self.calls = 0  # tool calls begun
        self._named_open = False
        self._state = None
        if spec is not None and spec.choice in ("auto", "required") and (parser or spec.choice == "required"):
            self._state = get_parser("json" if spec.choice == "required" else parser).stream()

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        spec = self.spec
        if spec is not None and spec.choice == "function":  # the whole output is the arguments
            out = []
            if not self._named_open:
                self._named_open = True
                self.calls = 1
                out.append({"tool_calls": [{"index": 0, "id": self.new_id(), "type": "function",
                                            "function": {"name": spec.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        if self._state is None:
            return [{"content": text}]
        return self._openai(self._state.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return self._openai(self._state.finish()) if self._state is not None else []

    def _openai(self, deltas: list) -> list[dict[str, Any]]:
        out = []
        for d in deltas:
            if d.content is not None:
                out.append({"content": d.content})
                continue
            call: dict[str, Any] = {"index": d.index, "function": {}}
            if d.name is not None:  # a call's first piece
                self.calls = max(self.calls, d.index + 1)
                call.update(id=d.id or self.new_id(), type="function")
                call["function"]["name"] = d.name
            call["function"]["arguments"] = d.arguments or ""
            out.append({"tool_calls": [call]})
        return out
