"""Structured outputs in the engine: grammars compiled by xgrammar, bitmasks built by the policy,
applied by the sampler. The model has random weights, so whatever it writes is valid only
because the constraint made it so: every output below is checked with `jsonschema`,
`re.fullmatch` or a parser of the grammar, at temperature 1 over several seeds."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers import cached_model_dir, torch_single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SEEDS = range(6)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "string",
                                                                               "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "ok", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,5}-\d{2,4}( \((yes|no)\))?"
CHOICES = ["red", "green", "blue sky", "ünïcode ✓"]
GRAMMAR = r'''root ::= expr
expr ::= term ("+" term)*
term ::= [0-9]{1,3} | "(" expr ")"'''


def _grammar_ok(s: str) -> bool:
    """A recursive-descent check of GRAMMAR's language."""
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(s) and s[pos] == "+":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if pos < len(s) and s[pos] == "(":
            pos += 1
            if not expr() or pos >= len(s) or s[pos] != ")":
                return False
            pos += 1
            return True
        m = re.match(r"[0-9]{1,3}", s[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    return expr() and pos == len(s)


@pytest.fixture(scope="module")
def llm():
    from zeroserve import LLM

    return LLM(str(cached_model_dir("llama")), num_kv_blocks=256)


def _run(llm, so: dict, max_tokens: int = 160, n_prompts: int = len(SEEDS), **kw):
    ps = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=so, **kw)
          for s in range(n_prompts)]
    outs = llm.generate([f"prompt {i}:" for i in range(n_prompts)], ps)
    return [c for o in outs for c in o.outputs]


# ---------------------------------------------------------------------------- the params


def test_structured_outputs_params_take_exactly_one_constraint():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.kind == "regex"
    assert SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)).structured_outputs.kind \
        == "json_object"
    for bad, msg in [({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
                     ({"json": "{nope"}, "not valid JSON"), ({"json": [1]}, "JSON Schema"),
                     ({"choice": []}, "choice must be"), ({"choice": ["a", ""]}, "choice must be"),
                     ({"regex": " "}, "non-empty"), ({"regx": "a"}, "unknown field"),
                     ({"grammar": "x" * (300 << 10)}, "the limit is")]:
        with pytest.raises(InvalidRequest, match=msg):
            SamplingParams(structured_outputs=bad)


def test_params_with_a_constraint_survive_the_wire():
    import msgspec

    p = SamplingParams(structured_outputs={"json": PERSON}, seed=3)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert back == p and back.structured_outputs.json == PERSON
    assert SamplingParams.from_dict(p.to_dict()) == p


# ---------------------------------------------------------------------------- the sampler


def test_bitmask_unpacks_to_exactly_the_allowed_tokens():
    from zeroserve.kernels.token_bitmask import unpack_bitmask

    rng = np.random.default_rng(0)
    allowed = rng.random((3, 70)) < 0.3
    words = np.zeros((3, 3), np.int64)
    for r, t in zip(*np.nonzero(allowed)):
        words[r, t // 32] |= 1 << (t % 32)
    bm = torch.from_numpy(words.astype(np.uint32).view(np.int32))
    assert torch.equal(unpack_bitmask(bm, 70), torch.from_numpy(allowed))


def test_sampler_only_picks_allowed_tokens_and_the_grammar_outranks_min_tokens_bans():
    from zeroserve.services.worker.sampler import SamplingTensors, sample

    V = 64
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 5
    allowed = torch.zeros(2, V, dtype=torch.bool)
    allowed[0, [3, 17, 40]] = True
    allowed[1, [2]] = True  # only EOS (id 2) allowed: a finished grammar
    words = torch.zeros(2, 2, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0, min_tokens=5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    for seed in range(20):
        st = SamplingTensors.from_requests(params, [seed] * 4, [7] * 4, [[1]] * 4, [[]] * 4, eos_ids=[2])
        st.bitmask_rows, st.bitmask = torch.tensor([3, 1]), bitmask  # mask row 0 is batch row 3
        out = sample(logits, st).sampled.tolist()
        assert out[1] == 2  # EOS, though min_tokens bans it: the grammar allows nothing else
        assert out[3] in (3, 17, 40)
        assert out[2] == int(torch.argmax(logits[2]))  # an unconstrained row is untouched


# ---------------------------------------------------------------------------- the engine


def test_json_schema_outputs_are_always_valid(llm):
    outs = _run(llm, {"json": PERSON}, max_tokens=300)
    for c in outs:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), PERSON)
    assert len({c.text for c in outs}) > 1  # the seeds still choose


def test_json_object_regex_choice_and_grammar_outputs_are_always_valid(llm):
    for c in _run(llm, {"json_object": True}, max_tokens=300):
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
        else:  # unbounded strings may run to max_tokens: then the text is a prefix, never wrong
            assert c.finish_reason == "length" and c.text.startswith("{")
    for c in _run(llm, {"regex": REGEX}):
        assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c.text
    texts = [c.text for c in _run(llm, {"choice": CHOICES})]
    assert all(t in CHOICES for t in texts), texts
    for c in _run(llm, {"grammar": GRAMMAR}, max_tokens=60):
        if c.finish_reason == "stop":
            assert _grammar_ok(c.text), c.text


def test_every_sample_of_n_follows_the_constraint_and_greedy_is_valid_too(llm):
    from zeroserve import SamplingParams as SP

    out = llm.generate("many:", SP(n=4, temperature=1.0, seed=1, max_tokens=60, structured_outputs={"regex": REGEX}))
    assert len(out[0].outputs) == 4
    assert all(re.fullmatch(REGEX, c.text) for c in out[0].outputs)
    g = llm.generate("greedy:", SP(temperature=0, max_tokens=300, structured_outputs={"json": PERSON}))[0].outputs[0]
    jsonschema.validate(json.loads(g.text), PERSON)


def test_a_constrained_request_beside_free_ones_leaves_them_as_they_were(llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["free text"], free)[0].outputs[0].token_ids
    mixed = llm.generate(["free text", "json:"],
                         [free, SamplingParams(temperature=0, max_tokens=300, structured_outputs={"json": PERSON})])
    assert mixed[0].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), PERSON)


def test_bad_constraints_are_invalid_requests_that_say_what_is_wrong(llm):
    for so, msg in [({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "json constraint"),
                    ({"regex": "(unclosed"}, "regex constraint"),
                    ({"grammar": "root ::= (\"a\""}, "grammar constraint"),
                    ({"grammar": "start: \"a\""}, "EBNF/GBNF")]:
        with pytest.raises(InvalidRequest, match=msg):
            llm.generate("x", SamplingParams(structured_outputs=so))
    # the engine keeps serving
    assert llm.generate("x", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids


def test_the_grammar_survives_preemption_and_the_matcher_follows_every_token(llm):
    """A KV cache too small for all requests: some are preempted and recomputed mid-answer."""
    from zeroserve import LLM

    small = LLM(str(cached_model_dir("llama")), num_kv_blocks=24, max_num_seqs=8)
    outs = _run(small, {"json": PERSON}, max_tokens=300, n_prompts=8)
    assert small.engine.scheduler.num_preemptions > 0
    for c in outs:
        jsonschema.validate(json.loads(c.text), PERSON)


def test_the_same_schema_compiles_once(llm):
    g = llm.engine.grammars
    so = StructuredOutputsParams(json=PERSON)
    a, b = g.compile(so), g.compile(StructuredOutputsParams(json=json.dumps(PERSON)))
    assert g._get().get_cache_size_bytes() > 0
    import time

    t0 = time.perf_counter()
    for _ in range(20):
        g.compile(so)
    assert (time.perf_counter() - t0) / 20 < 0.01  # a cache hit, not a compile (~20 ms cold)
    assert a is not None and b is not None
