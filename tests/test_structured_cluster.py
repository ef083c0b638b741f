"""Structured outputs through the real cluster: the `openai` SDK against the gateway, the
ZeroMQ client, and a failover in the middle of constrained answers.

One module cluster (scheduler with a chat template, detokenizer, two worker groups, a gateway
with the model's tokenizer); random weights, temperature 1, several seeds: an output is valid
only because the scheduler's grammar bitmasks made it so.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import jsonschema
import openai
import pytest

from tests.cluster import LocalCluster, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir, torch_single_thread  # noqa: F401 (fixture)
from tests.test_gateway import sdk, start_gateway, wait_http
from tests.test_structured_outputs import CHOICES, GRAMMAR, PERSON, REGEX, _grammar_ok
from tests.test_tools import ASK, TOOL_TEMPLATE, TOOLS, check_call

pytestmark = pytest.mark.usefixtures("no_leftover_processes", "torch_single_thread")

SEEDS = range(4)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    model = cached_model_dir("llama")
    tmpl = tmp_path_factory.mktemp("so") / "chat.jinja"
    tmpl.write_text(TOOL_TEMPLATE)  # a Hermes-style template: tool_choice auto parses <tool_call> blocks
    c = LocalCluster(model, workers=2, num_kv_blocks=256, scheduler_args=["--chat-template", str(tmpl)])
    try:
        c.start()
        url = start_gateway(c, "gateway", "--model", str(model))
        c.wait_ready(timeout=180)
        wait_http(url, c, "gateway")
        yield c, sdk(url)
    finally:
        c.stop()


def _chat(oai, seed: int, stream: bool = False, max_tokens: int = 300, **kw):
    return oai.chat.completions.create(model=oai.models.list().data[0].id, seed=seed, temperature=1.0,
                                       max_tokens=max_tokens, stream=stream,
                                       messages=[{"role": "user", "content": f"who is person {seed}?"}], **kw)


def test_chat_json_schema_is_valid_for_every_seed(env):
    _, oai = env
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in SEEDS:
        r = _chat(oai, seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_streamed_constrained_text_equals_the_whole_answer(env):
    _, oai = env
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in SEEDS[:2]:
        whole = _chat(oai, seed, response_format=fmt).choices[0].message.content
        parts = [ch.choices[0].delta.content or "" for ch in _chat(oai, seed, True, response_format=fmt)
                 if ch.choices]
        assert "".join(parts) == whole and len(parts) > 3


def test_completions_take_every_constraint_field(env):
    _, oai = env
    model = oai.models.list().data[0].id

    def texts(max_tokens=120, **extra):
        out = []
        for seed in SEEDS:
            r = oai.completions.create(model=model, prompt=f"answer {seed}:", max_tokens=max_tokens, temperature=1.0,
                                       seed=seed, extra_body=extra)
            out.append((r.choices[0].text, r.choices[0].finish_reason))
        return out

    for t, _ in texts(structured_outputs={"choice": CHOICES}) + texts(guided_choice=CHOICES):
        assert t in CHOICES
    for t, fr in texts(structured_outputs={"regex": REGEX}) + texts(guided_regex=REGEX):
        assert fr == "stop" and re.fullmatch(REGEX, t), t
    for t, fr in texts(guided_grammar=GRAMMAR):
        assert fr == "length" or _grammar_ok(t), t
    for t, fr in texts(300, guided_json=PERSON):
        jsonschema.validate(json.loads(t), PERSON)
    for t, fr in texts(response_format={"type": "json_object"}):
        assert fr == "length" or isinstance(json.loads(t), dict), t
    streamed = "".join(ch.choices[0].text for ch in oai.completions.create(
        model=model, prompt="answer 0:", max_tokens=120, temperature=1.0, seed=0, stream=True,
        extra_body={"guided_regex": REGEX}) if ch.choices)
    assert streamed == texts(guided_regex=REGEX)[0][0]


def test_bad_constraints_are_400s_naming_the_problem(env):
    _, oai = env
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
               "type": "object", "properties": {"a": {"type": "nope"}}}}}}, "does not compile"),
           ({"guided_regex": "(["}, "regex constraint does not compile"),
           ({"guided_grammar": "root ::= \"a"}, "grammar constraint"),
           ({"guided_json": "{broken"}, "not valid JSON"),
           ({"guided_regex": "a", "guided_choice": ["b"]}, "give one output constraint"),
           ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
           ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
           ({"response_format": {"type": "yaml"}}, "response_format")]
    for extra, msg in bad:
        with pytest.raises(openai.BadRequestError, match=re.escape(msg)):
            oai.chat.completions.create(model=oai.models.list().data[0].id, max_tokens=8,
                                        messages=[{"role": "user", "content": "x"}], extra_body=extra)
    r = _chat(oai, 0, max_tokens=4)  # the cluster still serves
    assert r.choices[0].message.content is not None


def test_the_zeromq_client_constrains_and_refuses_bad_grammars(env):
    from zeroserve.common.errors import InvalidRequest
    from zeroserve import SamplingParams

    c, _ = env
    with c.client(timeout_s=30.0) as client:
        outs = [client.generate(f"q{s}", SamplingParams(temperature=1.0, seed=s, max_tokens=300,
                                                        structured_outputs={"json": PERSON})) for s in SEEDS]
        for o in outs:
            jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
        text = "".join(d.text for d in client.stream([5, 6, 7], SamplingParams(
            temperature=1.0, seed=1, max_tokens=60, structured_outputs={"regex": REGEX})))
        assert re.fullmatch(REGEX, text)
        with pytest.raises(InvalidRequest, match="regex constraint does not compile"):
            client.generate("x", SamplingParams(structured_outputs={"regex": "a{2,1}"}))


def test_a_failover_mid_answer_keeps_every_output_valid(env):
    """SIGKILL one group's worker while 16 constrained streams run on both: the scheduler's
    matchers stay with the requests, which finish on the other group under the same grammar."""
    from zeroserve import AsyncClient, SamplingParams

    c, _ = env
    counts: list[int] = [0]

    async def one(client, i):
        text, n = "", 0
        async for d in client.stream(f"failover {i}", SamplingParams(temperature=1.0, seed=i, max_tokens=300,
                                                                     structured_outputs={"json": PERSON})):
            text += d.text
            n += len(d.token_ids)
            counts[0] += len(d.token_ids)
        return text

    async def main():
        async with AsyncClient(c.address, timeout_s=30.0) as client:
            tasks = [asyncio.ensure_future(one(client, i)) for i in range(16)]
            deadline = time.monotonic() + 60
            while counts[0] < 60 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            c.kill("g0-r0", signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 180)

    texts = asyncio.run(main())
    for t in texts:
        jsonschema.validate(json.loads(t), PERSON)
    states = {g["name"]: g["state"] for g in c.stats()["groups"]}
    assert states.get("g0") != "ready", states  # the group did die under the requests


# ---------------------------------------------------------------------------- tool calls

def _tools_chat(oai, seed: int, stream: bool = False, **kw):
    return oai.chat.completions.create(model=oai.models.list().data[0].id, seed=seed, temperature=1.0,
                                       max_tokens=600, stream=stream, messages=ASK, tools=TOOLS, **kw)


def _joined_stream(chunks) -> tuple[str, dict[int, dict], str | None]:
    """(content, {index: {"id", "name", "arguments"}}, finish_reason) of a streamed chat answer."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            cur = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert cur["id"] is None, "a call's id comes once, with its name"
                cur["id"], cur["name"] = tc.id, tc.function.name
            cur["arguments"] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    return content, calls, finish


def test_required_and_named_tool_calls_through_the_sdk_always_validate(env):
    _, oai = env
    named = {"type": "function", "function": {"name": "search"}}
    for seed in SEEDS:
        for choice in ("required", named):
            r = _tools_chat(oai, seed, tool_choice=choice)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls and msg.content is None
            for tc in msg.tool_calls:
                check_call(tc.model_dump())
            if choice is named:
                assert [tc.function.name for tc in msg.tool_calls] == ["search"]


def test_streamed_tool_calls_join_to_the_whole_answer(env):
    _, oai = env
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        whole = _tools_chat(oai, 1, tool_choice=choice).choices[0].message.tool_calls
        content, calls, finish = _joined_stream(_tools_chat(oai, 1, True, tool_choice=choice))
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
            [(tc.function.name, tc.function.arguments) for tc in whole]
        assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_requests_that_cannot_be_served_are_400s(env):
    _, oai = env
    for kw, msg in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
                    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
                     "constrains the output itself")]:
        with pytest.raises(openai.BadRequestError, match=re.escape(msg)):
            _tools_chat(oai, 0, **kw)
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        oai.chat.completions.create(model=oai.models.list().data[0].id, max_tokens=4, tool_choice="required",
                                    messages=[{"role": "user", "content": "x"}])


# the model (random weights) is made to write a Hermes call by a regex, so "auto" has one to parse
HERMES_CALL = r'Let me check\.<tool_call>\{"name": "search", "arguments": \{"query": "[a-z]{1,8}"\}\}</tool_call>'


def test_auto_parses_the_calls_the_model_wrote_whole_and_streamed(env):
    c, oai = env
    extra = {"structured_outputs": {"regex": HERMES_CALL}}
    r = _tools_chat(oai, 2, extra_body=extra)  # tool_choice defaults to auto with tools
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me check."
    assert [tc.function.name for tc in msg.tool_calls] == ["search"]
    check_call(msg.tool_calls[0].model_dump())
    content, calls, finish = _joined_stream(_tools_chat(oai, 2, True, extra_body=extra))
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(x["name"], x["arguments"]) for x in calls.values()] == [("search", msg.tool_calls[0].function.arguments)]
    # plain text under auto stays content
    r = _tools_chat(oai, 3, extra_body={"structured_outputs": {"regex": "[a-z]{3,9}"}})
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    # the ZeroMQ client parses the same way (the scheduler told it the format)
    from zeroserve import SamplingParams

    with c.client(timeout_s=30.0) as client:
        out = client.chat(ASK, SamplingParams(temperature=1.0, seed=2, max_tokens=100, structured_outputs={
            "regex": HERMES_CALL}), tools=TOOLS).outputs[0]
    assert out.content == "Let me check." and out.tool_calls[0]["function"] == msg.tool_calls[0].function.model_dump()
