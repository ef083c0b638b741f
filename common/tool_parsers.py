"""Tool-call parsers: a model's text -> OpenAI tool calls, one parser per format, named as vLLM's
`--tool-call-parser` names them.

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks; the text around them is the message's content.
- `llama3_json` (Llama 3.1 / 3.2): the output is `{"name": ..., "parameters": {...}}` (or
  "arguments"), optionally after `<|python_tag|>`, several separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of calls, or (newer templates) `name[ARGS]{...}`;
  an answer that starts with the list itself too (the marker is a special token, which the
  default skip_special_tokens drops from the text).
- `json`: the output is a JSON array of `{"name", "parameters"}` objects (or one object): what
  tool_choice "required" forces (common/tools.py).

One scanner serves the whole text and a stream: every `feed` rescans the text so far into
content and calls (a call's name once complete, then its arguments' raw text as it grows), and
emits what is new. A call's arguments are the model's own JSON text of the object (not
re-encoded), so the streamed pieces join to exactly the arguments a whole parse gives.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from json.decoder import scanstring

_DEC = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")
_ARGS_KEYS = ("arguments", "parameters")


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Delta:
    """A stream's piece: content text, or a piece of call `index` (its first piece has `name`)."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class _Call:
    name: str | None = None
    args: str = ""  # raw JSON text of the arguments so far
    complete: bool = False  # the call's JSON has closed
    ok: bool = True  # nothing malformed seen


def _ws(s: str, i: int) -> int:
    return _WS.match(s, i).end()


def _scan_object(s: str, i: int) -> tuple[_Call, int]:
    """The call object starting at s[i] == '{' -> (what is known of it, where it ends or len(s))."""
    call, n = _Call(), len(s)
    i += 1
    while True:
        i = _ws(s, i)
        if i >= n:
            return call, n
        if s[i] == "}":
            call.complete = True
            call.ok = call.ok and call.name is not None
            return call, i + 1
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            call.ok = False
            return call, n
        try:
            key, i = scanstring(s, i + 1)
        except ValueError:
            return call, n  # the key is still arriving
        i = _ws(s, i)
        if i >= n:
            return call, n
        if s[i] != ":":
            call.ok = False
            return call, n
        i = _ws(s, i + 1)
        if i >= n:
            return call, n
        try:
            val, j = _DEC.raw_decode(s, i)
        except ValueError:
            if key in _ARGS_KEYS:  # arguments still arriving: all that is there belongs to them
                call.args = s[i:]
            return call, n
        if key == "name":
            call.name = val if isinstance(val, str) else None
            call.ok = call.ok and isinstance(val, str)
        elif key in _ARGS_KEYS:
            call.args = s[i:j]
            call.ok = call.ok and isinstance(val, dict)
        i = j


def _scan_calls(s: str, i: int, sep: str) -> tuple[list[_Call], bool]:
    """Call objects from s[i], separated by `sep` (',' in a list, ';' for Llama) -> (calls, ok)."""
    calls, n = [], len(s)
    while True:
        i = _ws(s, i)
        if i >= n or s[i] in "]":
            return calls, True
        if s[i] == sep and calls:
            i += 1
            continue
        if s[i] != "{":
            return calls, False
        call, i = _scan_object(s, i)
        calls.append(call)
        if not call.ok or not call.complete:
            return calls, call.ok


def _held(s: str, marker: str) -> int:
    """How many trailing characters of s could begin `marker` (kept back from content)."""
    for k in range(min(len(marker) - 1, len(s)), 0, -1):
        if marker.startswith(s[-k:]):
            return k
    return 0


class ToolParser:
    """A format: `segments(text, final)` -> [str | _Call ...] in order, plus whether it parsed."""

    name = ""

    def segments(self, text: str, final: bool) -> tuple[list, bool]:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedOutput:
        """The whole output; an output with a malformed call is all content (never an error)."""
        segs, ok = self.segments(text, True)
        calls = [s for s in segs if isinstance(s, _Call)]
        if not ok or not all(c.ok and c.complete and c.name for c in calls):
            return ParsedOutput(text, [])
        content = "".join(s for s in segs if isinstance(s, str))
        return ParsedOutput(content if content.strip() else None, [ToolCall("", c.name, c.args) for c in calls])

    def stream(self) -> StreamState:
        return StreamState(self)


class StreamState:
    """One completion's incremental parse: `feed` text pieces, then `finish`."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser, self.text = parser, ""
        self.content_sent = 0
        self.sent: list[int] = []  # per call: argument characters sent (-1: header not sent)

    def feed(self, delta: str) -> list[Delta]:
        self.text += delta
        return self._emit(False)

    def finish(self) -> list[Delta]:
        return self._emit(True)

    def _emit(self, final: bool) -> list[Delta]:
        segs, _ = self.parser.segments(self.text, final)
        out, content_pos, k = [], 0, 0
        for s in segs:
            if isinstance(s, str):
                end = content_pos + len(s)
                if end > self.content_sent:
                    out.append(Delta(content=s[max(0, self.content_sent - content_pos):]))
                    self.content_sent = end
                content_pos = end
                continue
            if k == len(self.sent):
                if s.name is None:
                    break  # a call's header needs its name: hold its arguments until then
                self.sent.append(0)
                out.append(Delta(index=k, name=s.name, arguments=""))
            if len(s.args) > self.sent[k]:
                out.append(Delta(index=k, arguments=s.args[self.sent[k]:]))
                self.sent[k] = len(s.args)
            k += 1
        return out


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def segments(self, text: str, final: bool) -> tuple[list, bool]:
        segs, i, ok = [], 0, True
        while True:
            j = text.find(self.OPEN, i)
            if j < 0:
                rest = text[i:]
                segs.append(rest if final else rest[:len(rest) - _held(rest, self.OPEN)])
                return segs, ok
            segs.append(text[i:j])
            body = _ws(text, j + len(self.OPEN))
            if body >= len(text):
                return segs + ([_Call(ok=False)] if final else []), not final
            if text[body] != "{":
                return segs + [_Call(ok=False)], False
            # the object first: its strings may hold "</tool_call>" themselves
            call, end = _scan_object(text, body)
            segs.append(call)
            if not call.complete:
                return segs, ok and call.ok
            k = _ws(text, end)
            if text.startswith(self.CLOSE, k):
                i = k + len(self.CLOSE)
                ok = ok and call.ok
                continue
            if self.CLOSE.startswith(text[k:]):  # the close tag is arriving, or the model
                return segs, ok and call.ok  # ended the answer (EOS) before writing it
            call.ok = False
            return segs, False


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def segments(self, text: str, final: bool) -> tuple[list, bool]:
        s = text.lstrip()
        if s.startswith(self.TAG):
            s = s[len(self.TAG):]
        elif not final and self.TAG.startswith(s):
            return [], True  # may be the tag arriving
        s = s.lstrip()
        if not s:
            return ([text] if final else []), True
        if s[0] != "{":
            return [text], True  # plain content
        calls, ok = _scan_calls(s, 0, ";")
        return calls, ok


class MistralParser(ToolParser):
    name = "mistral"
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def segments(self, text: str, final: bool) -> tuple[list, bool]:
        j = text.find(self.TAG)
        if j < 0:
            # [TOOL_CALLS] is a special token: detokenized with skip_special_tokens (the
            # default) it is gone, and the answer starts with the calls' JSON list itself
            s = text.lstrip()
            if s.startswith("[{"):
                return _scan_calls(s, 1, ",")
            if not final and (not s or "[{".startswith(s)):
                return [], True  # may be that list beginning
            return [text if final else text[:len(text) - _held(text, self.TAG)]], True
        segs = [text[:j]]
        i = _ws(text, j + len(self.TAG))
        if i >= len(text):
            return segs, True
        if text[i] == "[":
            calls, ok = _scan_calls(text, i + 1, ",")
            return segs + calls, ok
        while i < len(text):  # name[ARGS]{...} (repeated, each after its own [TOOL_CALLS])
            a = text.find(self.ARGS, i)
            if a < 0:
                return segs, not final
            call = _Call(name=text[i:a].strip())
            start = _ws(text, a + len(self.ARGS))
            try:
                val, end = _DEC.raw_decode(text, start)
                call.args, call.complete, call.ok = text[start:end], True, isinstance(val, dict) and bool(call.name)
            except ValueError:
                call.args = text[start:]
                segs.append(call)
                return segs, not final
            segs.append(call)
            i = _ws(text, end)
            if text.startswith(self.TAG, i):
                i = _ws(text, i + len(self.TAG))
            elif i < len(text):
                return segs, False
        return segs, True


class JsonParser(ToolParser):
    name = "json"

    def segments(self, text: str, final: bool) -> tuple[list, bool]:
        i = _ws(text, 0)
        if i >= len(text):
            return [], not final
        if text[i] == "[":
            return _scan_calls(text, i + 1, ",")
        if text[i] == "{":
            call, _ = _scan_object(text, i)
            return [call], call.ok
        return [text], False


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                            JsonParser)}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}") from None


def parser_for_template(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model (None: not recognised)."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return None


def check_calls(calls: list[ToolCall], tools: list[dict]) -> list[str]:
    """What is wrong with parsed calls against the request's tools (empty: nothing)."""
    names = {t["function"]["name"] for t in tools}
    problems = []
    for c in calls:
        if c.name not in names:
            problems.append(f"{c.name!r} is not one of the tools {sorted(names)}")
        try:
            if not isinstance(json.loads(c.arguments), dict):
                problems.append(f"the arguments of {c.name!r} are not a JSON object")
        except ValueError:
            problems.append(f"the arguments of {c.name!r} are not valid JSON")
    return problems
