"""The in-process engine (LLM -> LLMEngine -> policy + model runner) against HF transformers.

Acceptance tests of the engine: greedy outputs equal HF `generate` token for token (fp32, CPU,
one prompt at a time in HF, no padding) for llama, qwen2 and qwen3, whatever the engine does
with the batch: single requests, 30+ concurrent requests of mixed lengths and max_tokens,
preemption under a tiny KV budget, chunked prefill of long prompts, prefix-cache hits (and the
prefix cache really skips computation), n > 1.

One workload of token-id prompts (exact lengths 1..300, a group sharing a 200-token prefix, and
a prompt after which the qwen2 model picks EOS) serves every configuration, so the HF reference
(cached per process in tests/hf_reference.py) runs once per (arch, prompt, N).
"""

from __future__ import annotations

import pytest

from tests.helpers import random_prompt
from tests.hf_reference import (  # noqa: F401
    ARCHS,
    explain_mismatch,
    hf_greedy,
    model_dir,
    single_torch_thread,
)
from zeroserve import LLM, SamplingParams

EOS = 2
BS = 16

RANDOM_LENS = [1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 47, 64, 65, 90, 128, 150, 200, 257, 300]
PREFIX = random_prompt(200, 512, seed=9000)
SUFFIX_LENS = [1, 2, 3, 5, 8, 11, 16, 17, 24, 30, 40, 60]
EOS_PROMPT = random_prompt(5, 512, seed=7)  # qwen2 (tiny, seed 0) greedily emits EOS as its 4th token

PROMPTS: list[list[int]] = (
    [random_prompt(n, 512, seed=100 + i) for i, n in enumerate(RANDOM_LENS)]
    + [EOS_PROMPT]
    + [PREFIX + random_prompt(n, 512, seed=200 + i) for i, n in enumerate(SUFFIX_LENS)]
)
MAX_TOKENS = [8 + (7 * i) % 13 for i in range(len(PROMPTS))]  # 8..20, mixed
SHARED = range(len(RANDOM_LENS) + 1, len(PROMPTS))  # indexes of the shared-prefix prompts
LONGEST = RANDOM_LENS.index(300)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **kw)


def make_llm(arch: str, **kw) -> LLM:
    return LLM(str(model_dir(arch)), **kw)


def check_against_hf(arch: str, idxs, outputs, mode: str = "ignore") -> None:
    """Every completion of every output equals HF's greedy tokens; finish reason "length"."""
    problems = []
    for i, out in zip(idxs, outputs):
        p, n = PROMPTS[i], MAX_TOKENS[i]
        ref = hf_greedy(arch, p, n, mode)
        assert out.finished and out.prompt_token_ids == p
        for comp in out.outputs:
            if comp.token_ids != ref:
                problems.append(explain_mismatch(arch, p, comp.token_ids, ref))
            elif comp.finish_reason != "length":
                problems.append(f"prompt {i}: finish_reason {comp.finish_reason!r}, expected 'length'")
    assert not problems, f"{len(problems)} mismatch(es) vs HF:\n" + "\n".join(problems)


def run_workload(llm: LLM, idxs=None):
    idxs = list(range(len(PROMPTS))) if idxs is None else list(idxs)
    outs = llm.generate([PROMPTS[i] for i in idxs], [greedy(MAX_TOKENS[i]) for i in idxs])
    return idxs, outs


def spy_schedule(llm: LLM) -> list[dict[str, int]]:
    """Record num_scheduled_tokens of every step (wraps the scheduler instance's method)."""
    sched = llm.engine.scheduler
    real = sched.schedule
    steps: list[dict[str, int]] = []

    def schedule(*a, **kw):
        so = real(*a, **kw)
        steps.append(so.num_scheduled())
        return so

    sched.schedule = schedule
    return steps


def expected_computed(idxs, cached) -> int:
    """Tokens an engine runs through the model when nothing is preempted: each prompt minus its
    prefix-cache hit, then one decode per generated token except the last."""
    return sum(len(PROMPTS[i]) - c + MAX_TOKENS[i] - 1 for i, c in zip(idxs, cached))


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_single_requests_match_hf(arch):
    llm = make_llm(arch)  # default engine args (1 GiB CPU KV budget)
    for i in (0, 9, 10, LONGEST, len(RANDOM_LENS), SHARED[0]):  # 1, 32, 33, 300 tokens, EOS, shared
        [out] = llm.generate(PROMPTS[i], greedy(MAX_TOKENS[i]))
        check_against_hf(arch, [i], [out])
        comp = out.outputs[0]
        assert comp.text == llm.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
        assert comp.stop_reason is None
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_mixed_batch_matches_hf(arch):
    llm = make_llm(arch, num_kv_blocks=1024)
    steps = spy_schedule(llm)
    idxs, outs = run_workload(llm)
    assert len(outs) == len(PROMPTS) >= 32
    check_against_hf(arch, idxs, outs)
    # it really was one continuous batch: many requests per step, few steps
    assert max(len(s) for s in steps) >= 30
    assert llm.engine.runner.num_steps <= 2 * max(MAX_TOKENS)
    assert llm.engine.scheduler.num_preemptions == 0
    assert llm.engine.block_manager.num_used_blocks == 0  # everything released


@pytest.mark.parametrize("arch,prefix_caching", [(a, True) for a in ARCHS] + [("llama", False)])
def test_preemption_matches_hf(arch, prefix_caching):
    # 40 blocks = 640 tokens for 33 requests of up to 320 tokens each: decodes run out of blocks
    llm = make_llm(arch, num_kv_blocks=40, enable_prefix_caching=prefix_caching)
    idxs, outs = run_workload(llm)
    assert llm.engine.scheduler.num_preemptions > 0
    check_against_hf(arch, idxs, outs)
    assert llm.engine.block_manager.num_used_blocks == 0
    if not prefix_caching:  # the preempted requests really were recomputed from their tokens
        assert llm.engine.scheduler.num_computed_tokens_total > expected_computed(idxs, [0] * len(idxs))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_hf(arch):
    llm = make_llm(arch, num_kv_blocks=1024, max_num_batched_tokens=64)
    steps = spy_schedule(llm)
    idxs, outs = run_workload(llm)
    check_against_hf(arch, idxs, outs)
    assert max(sum(s.values()) for s in steps) <= 64
    # the 300-token prompt was computed in chunks of at most 64 tokens over >= 5 steps
    rid = outs[LONGEST].request_id + "#0"
    chunks = [s[rid] for s in steps if rid in s and s[rid] > 1]
    assert len(chunks) >= 5 and sum(chunks) + 1 >= len(PROMPTS[LONGEST]), chunks
    # chunks mixed with other requests' decodes in the same step
    assert any(rid in s and s[rid] > 1 and any(v == 1 for v in s.values()) for s in steps)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_match_hf_and_skip_compute(arch):
    on = make_llm(arch, num_kv_blocks=1024, enable_prefix_caching=True)
    off = make_llm(arch, num_kv_blocks=1024, enable_prefix_caching=False)
    idxs, outs_on = run_workload(on)
    _, outs_off = run_workload(off)
    check_against_hf(arch, idxs, outs_on)
    check_against_hf(arch, idxs, outs_off)

    cached_on = [o.num_cached_tokens for o in outs_on]
    assert all(o.num_cached_tokens == 0 for o in outs_off)
    # the shared-prefix prompts (200 common tokens = 12 full blocks) hit the cache, except the
    # one computed first; prompts without a shared prefix never do
    full = (len(PREFIX) // BS) * BS
    shared_hits = [cached_on[i] for i in SHARED]
    assert sum(c >= full for c in shared_hits) >= len(SHARED) - 1, shared_hits
    assert all((c % BS == 0 or c == len(PROMPTS[i]) - 1) and c < len(PROMPTS[i]) for i, c in zip(idxs, cached_on))
    assert all(cached_on[i] == 0 for i in range(len(RANDOM_LENS) + 1))
    # ... and the model really computed fewer tokens, exactly the cached ones fewer
    total_on = on.engine.scheduler.num_computed_tokens_total
    total_off = off.engine.scheduler.num_computed_tokens_total
    assert on.engine.scheduler.num_preemptions == off.engine.scheduler.num_preemptions == 0
    assert total_off == expected_computed(idxs, [0] * len(idxs))
    assert total_on == expected_computed(idxs, cached_on)
    assert total_off - total_on >= (len(SHARED) - 1) * full

    # a second round of the shared prompts on the same engine: every one hits (the blocks were
    # freed but stay cached), outputs unchanged
    before = on.engine.scheduler.num_computed_tokens_total
    idxs2, outs2 = run_workload(on, SHARED)
    check_against_hf(arch, idxs2, outs2)
    hits2 = [o.num_cached_tokens for o in outs2]
    assert all(c >= full for c in hits2), hits2
    assert on.engine.scheduler.num_computed_tokens_total - before == expected_computed(idxs2, hits2)


def test_identical_prompts_at_block_boundaries_share_full_blocks():
    """Copies of one prompt in a batch reuse its full blocks, the last one too, and compute
    only what the cache lacks, at least the last prompt token (its logits; its K/V, already in
    the shared block, is not written again): 16 tokens -> 15 cached, 32 -> 31, 33 -> 32."""
    arch = "qwen3"
    llm = make_llm(arch, num_kv_blocks=256)
    for i, cached in ((6, 15), (9, 31), (10, 32)):  # 16, 32, 33 tokens
        assert len(PROMPTS[i]) in (16, 32, 33)
        outs = llm.generate([PROMPTS[i]] * 3, greedy(MAX_TOKENS[i]))
        check_against_hf(arch, [i] * 3, outs)
        assert [o.num_cached_tokens for o in outs] == [0, cached, cached]
        again = llm.generate(PROMPTS[i], greedy(MAX_TOKENS[i]))  # later: the blocks stay cached
        check_against_hf(arch, [i], again)
        assert again[0].num_cached_tokens == cached


@pytest.mark.parametrize("arch", ARCHS)
def test_n_greedy_gives_identical_copies_equal_to_hf(arch):
    llm = make_llm(arch, num_kv_blocks=1024)
    idxs = [2, 8, 10, LONGEST, SHARED[3]]  # 3, 17, 33, 300 tokens, shared prefix
    outs = llm.generate([PROMPTS[i] for i in idxs], [greedy(MAX_TOKENS[i], n=3) for i in idxs])
    for out in outs:
        assert [c.index for c in out.outputs] == [0, 1, 2]
    check_against_hf(arch, idxs, outs)


@pytest.mark.parametrize("arch", ARCHS)
def test_min_tokens_matches_hf_min_new_tokens(arch):
    """min_tokens=N without ignore_eos bans EOS for N tokens, like HF's min_new_tokens=N."""
    llm = make_llm(arch, num_kv_blocks=1024)
    idxs = [3, 7, len(RANDOM_LENS), SHARED[0]]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], min_tokens=MAX_TOKENS[i]) for i in idxs]
    outs = llm.generate([PROMPTS[i] for i in idxs], params)
    check_against_hf(arch, idxs, outs, mode="min_new")
    for out in outs:
        assert EOS not in out.outputs[0].token_ids


def test_workload_exercises_eos_under_ignore_eos():
    """The workload is meaningful for ignore_eos: qwen2 picks EOS after EOS_PROMPT and goes on
    (HF with EOS as an ordinary token); with EOS banned (min_new_tokens) the output differs."""
    i = len(RANDOM_LENS)
    ref = hf_greedy("qwen2", PROMPTS[i], MAX_TOKENS[i])
    assert EOS in ref[:-1]
    assert hf_greedy("qwen2", PROMPTS[i], MAX_TOKENS[i], "min_new") != ref
    llm = make_llm("qwen2", num_kv_blocks=256)
    [out] = llm.generate(PROMPTS[i], greedy(MAX_TOKENS[i]))
    assert out.outputs[0].token_ids == ref and out.outputs[0].finish_reason == "length"


def test_repeated_prompt_writes_no_kv_into_its_cached_blocks():
    """A prompt sent again whose every block is cached computes one token, whose K/V slot the
    worker leaves alone (slot -1): the block is shared with the cache and other requests."""
    arch = "qwen3"
    llm = make_llm(arch, num_kv_blocks=256)
    i = 9  # 32 tokens: two full blocks
    first = llm.generate(PROMPTS[i], greedy(MAX_TOKENS[i]))
    runner = llm.engine.runner
    seen, prepare = [], runner._prepare_inputs

    def recording(step, req_ids):
        b = prepare(step, req_ids)
        seen.append((b.T, b.slots.copy()))
        return b

    runner._prepare_inputs = recording
    again = llm.generate(PROMPTS[i], greedy(MAX_TOKENS[i]))
    check_against_hf(arch, [i, i], first + again)
    assert again[0].num_cached_tokens == 31
    assert seen[0][0] == 1 and seen[0][1].tolist() == [-1]  # one token computed, nothing written
    assert all((s >= 0).all() for _, s in seen[1:])  # the decode tokens write their K/V as ever
