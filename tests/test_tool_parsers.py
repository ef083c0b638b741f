"""Tool-call parsers (common/tool_parsers.py) and the OpenAI stream shaping (common/tools.py):
each format parsed whole and streamed in random pieces, with the streamed content and argument
pieces joining to exactly the whole parse; malformed calls stay content."""

from __future__ import annotations

import json
import random

import pytest

from zeroserve.common.tool_parsers import PARSERS, ToolCall, check_calls, get_parser, parser_for_template
from zeroserve.common.tools import ToolStream, check_tools, parse_output

CASES = {
    "hermes": [
        ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "x}</tool_call>"}]}}\n</tool_call>\n'
         '<tool_call>{"arguments": {"q": "ü ✓"}, "name": "g"}</tool_call> done',
         "Sure.\n\n done", [("f", '{"a": [1, {"b": "x}</tool_call>"}]}'), ("g", '{"q": "ü ✓"}')]),
        ("no calls here <tool", "no calls here <tool", []),
        # the model ended (EOS) before writing </tool_call>
        ('<tool_call>\n{"name": "f", "arguments": {}}\n', None, [("f", "{}")]),
    ],
    "llama3_json": [
        ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"n": {"m": []}}}', None,
         [("f", '{"a": 1}'), ("g", '{"n": {"m": []}}')]),
        ("The answer is 4.", "The answer is 4.", []),
    ],
    "mistral": [
        ('ok [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"z": "]"}}]', "ok ",
         [("f", '{"a": 1}'), ("g", '{"z": "]"}')]),
        ('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', None, [("f", '{"a": 1}'), ("g", "{}")]),
        # [TOOL_CALLS] dropped by skip_special_tokens: the list alone
        (' [{"name": "f", "arguments": {"a": 1}}]', None, [("f", '{"a": 1}')]),
        ("[1] is a citation", "[1] is a citation", []),
    ],
    "json": [
        ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', None,
         [("f", '{"a": 1}'), ("g", "{}")]),
        ('{"name": "f", "arguments": {"x": "y"}}', None, [("f", '{"x": "y"}')]),
    ],
}
MALFORMED = {"hermes": "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1</tool_call>",
             "llama3_json": '{"name": "f", "parameters": {"a": }}', "mistral": "[TOOL_CALLS][{\"name\": 3}]",
             "json": '[{"arguments": {}}]'}


def streamed(parser: str, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    st, deltas, i = get_parser(parser).stream(), [], 0
    while i < len(text):
        k = rng.choice((1, 1, 2, 3, 7, 20))
        deltas += st.feed(text[i:i + k])
        i += k
    deltas += st.finish()
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index is not None:
            c = calls.setdefault(d.index, ["", ""])
            if d.name is not None:
                assert c == ["", ""], "a call's header comes first, once"
                c[0] = d.name
            c[1] += d.arguments or ""
    return "".join(d.content for d in deltas if d.content is not None), [tuple(v) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("parser", sorted(CASES))
def test_each_format_parses_whole_and_streamed_alike(parser):
    for text, content, calls in CASES[parser]:
        whole = get_parser(parser).parse(text)
        assert whole.content == content and [(c.name, c.arguments) for c in whole.tool_calls] == calls
        for c in whole.tool_calls:
            assert isinstance(json.loads(c.arguments), dict)
        for seed in range(40):
            assert streamed(parser, text, random.Random(seed)) == (content or "", calls), seed


@pytest.mark.parametrize("parser", sorted(MALFORMED))
def test_a_malformed_call_leaves_the_whole_text_as_content(parser):
    out = get_parser(parser).parse(MALFORMED[parser])
    assert out.content == MALFORMED[parser] and out.tool_calls == []


def test_a_marker_prefix_is_held_back_until_it_is_known():
    st = get_parser("hermes").stream()
    assert [d.content for d in st.feed("hi <tool")] == ["hi "]
    assert [d.content for d in st.feed("box>")] == ["<toolbox>"]
    assert st.feed("<tool_call>{\"na") == []
    assert [(d.index, d.name) for d in st.feed('me": "f", "arguments": {')] == [(0, "f"), (0, None)]


def test_templates_are_recognised_and_names_checked():
    assert parser_for_template("{% for m in messages %}<tool_call>{{ x }}</tool_call>") == "hermes"
    assert parser_for_template("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert parser_for_template("{{- '<|python_tag|>' }} ipython") == "llama3_json"
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "json"}
    with pytest.raises(ValueError, match="known: \\['hermes'"):
        get_parser("pythonic")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert check_calls([ToolCall("", "f", "{}")], tools) == []
    assert len(check_calls([ToolCall("", "g", "{}"), ToolCall("", "f", "[1]"), ToolCall("", "f", "{")], tools)) == 3


def test_openai_stream_shapes_for_every_tool_choice():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    ids = iter(f"call_{i:024d}" for i in range(100))
    named = ToolStream(check_tools(tools, {"type": "function", "function": {"name": "f"}}), None, lambda: next(ids))
    out = named.feed('{"a"') + named.feed(": 1}") + named.finish()
    assert out[0] == {"tool_calls": [{"index": 0, "id": "call_" + "0" * 24, "type": "function",
                                      "function": {"name": "f", "arguments": ""}}]}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in out) == '{"a": 1}' and named.calls == 1
    auto = ToolStream(check_tools(tools), "hermes")
    out = auto.feed('Hi <tool_call>{"name": "f", "arguments": {}}</tool_call>') + auto.finish()
    assert out[0] == {"content": "Hi "} and out[1]["tool_calls"][0]["function"]["name"] == "f" and auto.calls == 1
    none = ToolStream(check_tools(tools, "none"), "hermes")
    assert none.feed("<tool_call>") == [{"content": "<tool_call>"}] and none.calls == 0
    # a whole answer under auto whose call names no declared tool stays content
    text = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert parse_output(check_tools(tools), text, "hermes") == (text, [])


async def test_the_gateway_refuses_auto_when_no_format_is_known():
    from zeroserve.services.gateway.errors import APIError
    from zeroserve.services.gateway.tools import tool_parser

    class Models:  # the gateway's view of the scheduler's model cards, as its `models()` returns them
        def __init__(self, parser):
            self.cards, self.refreshed = [{"id": "m", "tool_call_parser": parser}], 0

        async def models(self, refresh=False):
            self.refreshed += refresh
            return self.cards

    assert await tool_parser(Models("hermes"), "m") == "hermes"
    gw = Models("")
    with pytest.raises(APIError, match="--tool-call-parser NAME") as e:
        await tool_parser(gw, "m")
    assert e.value.status == 400 and gw.refreshed == 1  # asked the scheduler again before refusing
