"""Sampling parameter semantics at the engine level (vLLM's meaning of every SamplingParams field).

Runs the real engine on the tiny llama (fp32, CPU). Where a result has an exact reference it is
checked against HF transformers' logits for the same prefix (tests/hf_reference.py): logprobs,
penalties, min_tokens. Prompts are token-id lists unless the test is about text.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import random_prompt
from tests.hf_reference import hf_logits, hf_logprobs, model_dir, single_torch_thread  # noqa: F401
from zeroserve import LLM, SamplingParams

ARCH = "llama"
EOS = 2
V = 512
# the tiny llama (seed 0) greedily emits EOS as the 8th token after this prompt
EOS_PROMPT = random_prompt(20, V, seed=519)
PROMPTS = [random_prompt(n, V, seed=600 + i) for i, n in enumerate([1, 4, 9, 16, 17, 30, 45, 70])]
# its greedy output repeats many tokens (15 repeats in 24 tokens): penalties have work to do
REPEATY_PROMPT = random_prompt(6, V, seed=501)
TEXT_PROMPT = "The quick brown fox jumps over"


def make_llm(**kw) -> LLM:
    kw.setdefault("num_kv_blocks", 1024)
    return LLM(str(model_dir(ARCH)), **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    """One engine shared by the tests that do not inspect engine counters."""
    return make_llm()


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def greedy_tokens(llm, prompt, n: int) -> list[int]:
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n))
    return out.outputs[0].token_ids


def first_new_index(seq: list[int], start: int) -> int:
    """The first index >= start whose token does not occur earlier in seq."""
    return next(j for j in range(start, len(seq)) if seq[j] not in seq[:j])


# --------------------------------------------------------------------------------------------
# greedy equivalents, seeds


def test_top_k_1_and_other_degenerate_filters_equal_greedy(llm):
    ref = tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)))
    for params in (
        SamplingParams(temperature=1.0, top_k=1, ignore_eos=True, max_tokens=12),  # unseeded
        SamplingParams(temperature=2.0, top_k=1, seed=3, ignore_eos=True, max_tokens=12),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=4, ignore_eos=True, max_tokens=12),  # keeps the top token
        SamplingParams(temperature=1.0, min_p=1.0, seed=5, ignore_eos=True, max_tokens=12),  # only the max survives
        SamplingParams(temperature=1e-6, seed=6, ignore_eos=True, max_tokens=12),  # below the greedy threshold
    ):
        assert tokens(llm.generate(PROMPTS, params)) == ref, params


def _seeded(seed=1234, **kw) -> SamplingParams:
    kw = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "max_tokens": 24, "ignore_eos": True, **kw}
    return SamplingParams(seed=seed, **kw)


def _other_requests(n: int, rng_seed: int = 0, max_len: int = 150):
    """n requests with random prompts and a random mix of sampling params (some unseeded)."""
    rng = random.Random(rng_seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append(random_prompt(rng.randint(1, max_len), V, seed=10_000 + rng_seed * 100 + i))
        kind = rng.choice(["greedy", "unseeded", "seeded", "penalties", "logprobs", "n2", "stop"])
        kw = {"max_tokens": rng.randint(4, 30), "ignore_eos": rng.random() < 0.5}
        if kind == "greedy":
            kw.update(temperature=0.0)
        elif kind == "unseeded":
            kw.update(temperature=rng.uniform(0.5, 1.5), top_p=rng.uniform(0.5, 1.0))
        elif kind == "seeded":
            kw.update(temperature=rng.uniform(0.5, 1.5), top_k=rng.randint(0, 40), seed=rng.randint(0, 10**6))
        elif kind == "penalties":
            kw.update(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5)
        elif kind == "logprobs":
            kw.update(temperature=1.0, logprobs=rng.randint(0, 5), min_p=0.05)
        elif kind == "n2":
            kw.update(temperature=1.0, n=2)
        else:
            kw.update(temperature=1.0, stop_token_ids=[rng.randrange(3, V)], min_tokens=2)
        params.append(SamplingParams(**kw))
    return prompts, params


def test_seeded_sampling_repeats_and_is_batch_invariant():
    prompt = PROMPTS[5]
    llm = make_llm()
    [alone] = llm.generate(prompt, _seeded())
    ref = alone.outputs[0].token_ids
    assert len(ref) == 24 and ref != greedy_tokens(llm, prompt, 24)  # it really sampled

    # the same engine again, and a fresh engine with another engine seed
    assert llm.generate(prompt, _seeded())[0].outputs[0].token_ids == ref
    assert make_llm(seed=99).generate(prompt, _seeded())[0].outputs[0].token_ids == ref

    # inside a batch of 16 other random requests, in the middle
    others, other_params = _other_requests(16)
    outs = llm.generate(others[:8] + [prompt] + others[8:], other_params[:8] + [_seeded()] + other_params[8:])
    assert outs[8].outputs[0].token_ids == ref


def test_seeded_sampling_is_invariant_to_preemption():
    prompt = PROMPTS[5]
    [alone] = make_llm().generate(prompt, _seeded())
    ref = alone.outputs[0].token_ids

    # 16 blocks (256 tokens) for 17 requests: preemptions, and the target (admitted last) is
    # among the victims, so it is recomputed from its tokens at least once
    llm = make_llm(num_kv_blocks=16, enable_prefix_caching=False)
    sched = llm.engine.scheduler
    victims = []
    real_preempt = sched._preempt

    def spy(req, out):
        victims.append(req.req_id)
        return real_preempt(req, out)

    sched._preempt = spy
    others, other_params = _other_requests(16, rng_seed=1, max_len=60)
    outs = llm.generate(others + [prompt], other_params + [_seeded()])
    assert sched.num_preemptions > 0
    assert outs[-1].request_id + "#0" in victims, victims
    assert outs[-1].outputs[0].token_ids == ref


def test_different_seeds_give_different_samples(llm):
    prompt = PROMPTS[3]
    outs = llm.generate([prompt] * 6, [_seeded(seed=s, temperature=1.0, top_p=1.0, top_k=0) for s in range(6)])
    samples = [tuple(t) for t in tokens(outs)]
    assert len(set(samples)) == 6, samples


def test_n3_with_seed_gives_different_completions_that_repeat(llm):
    params = _seeded(seed=77, n=3, temperature=1.0, max_tokens=16)
    [a] = llm.generate(PROMPTS[4], params)
    assert [c.index for c in a.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in a.outputs]
    assert len(set(samples)) == 3, samples
    assert all(len(s) == 16 and c.finish_reason == "length" for s, c in zip(samples, a.outputs))
    [b] = make_llm().generate(PROMPTS[4], params)  # another engine, same seed
    assert [tuple(c.token_ids) for c in b.outputs] == samples
    # and in a batch with other requests
    others, other_params = _other_requests(4, rng_seed=2)
    outs = llm.generate(others + [PROMPTS[4]], other_params + [params])
    assert [tuple(c.token_ids) for c in outs[-1].outputs] == samples


# --------------------------------------------------------------------------------------------
# how a request ends


def test_stop_token_ids_end_the_output_at_that_token(llm):
    prompt = PROMPTS[6]
    full = greedy_tokens(llm, prompt, 24)
    j = first_new_index(full, 4)
    stop = full[j]
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop]))
    c = out.outputs[0]
    assert c.token_ids == full[:j + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    # several stop ids: the first one generated wins
    k = first_new_index(full, j + 2)
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[full[k], stop]))
    assert out.outputs[0].token_ids == full[:j + 1] and out.outputs[0].stop_reason == stop
    # sampling: the stop id ends the seeded sample where it first appears (the stop list does
    # not change what is sampled before it)
    sampled = llm.generate(prompt, _seeded(seed=5))[0].outputs[0].token_ids
    js = first_new_index(sampled, 3)
    [out] = llm.generate(prompt, _seeded(seed=5, stop_token_ids=[sampled[js]]))
    assert out.outputs[0].token_ids == sampled[:js + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", sampled[js])


def test_stop_token_text_is_left_out_unless_include_stop_str(llm):
    prompt = PROMPTS[6]
    full = greedy_tokens(llm, prompt, 24)
    j = first_new_index(full, 4)
    dec = llm.tokenizer.decode
    [without] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[full[j]]))
    [with_] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[full[j]],
                                                  include_stop_str_in_output=True))
    assert with_.outputs[0].text == dec(full[:j + 1], skip_special_tokens=True)
    assert without.outputs[0].text == dec(full[:j], skip_special_tokens=True)


def test_eos_ends_the_output_unless_ignore_eos(llm):
    full = greedy_tokens(llm, EOS_PROMPT, 24)
    e = full.index(EOS)
    assert 0 < e < 23
    [out] = llm.generate(EOS_PROMPT, SamplingParams(temperature=0.0, max_tokens=24))
    c = out.outputs[0]
    assert c.token_ids == full[:e + 1]  # EOS is the last token id ...
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    assert "</s>" not in c.text and c.text == llm.tokenizer.decode(full[:e], skip_special_tokens=True)  # ... not text
    [out] = llm.generate(EOS_PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert out.outputs[0].token_ids == full and out.outputs[0].finish_reason == "length"
    # EOS as a stop token id too: still one stop, reported as EOS
    [out] = llm.generate(EOS_PROMPT, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[EOS]))
    assert out.outputs[0].token_ids == full[:e + 1] and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 16])
def test_max_tokens_gives_exactly_that_many_and_length(llm, max_tokens):
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens),
              _seeded(seed=max_tokens, max_tokens=max_tokens),
              SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=max_tokens, n=2)]
    for p in params:
        for out in llm.generate(PROMPTS, p):
            for c in out.outputs:
                assert len(c.token_ids) == max_tokens and c.finish_reason == "length" and c.stop_reason is None
    # without ignore_eos, on prompts that do not reach EOS greedily
    no_eos = [p for p in PROMPTS if EOS not in greedy_tokens(llm, p, max_tokens)]
    assert len(no_eos) >= 5
    outs = llm.generate(no_eos, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for out in outs:
        c = out.outputs[0]
        assert EOS not in c.token_ids and len(c.token_ids) == max_tokens and c.finish_reason == "length"


def test_max_tokens_none_or_too_large_runs_to_max_model_len():
    llm = make_llm(max_model_len=64)
    prompt = PROMPTS[7][:50]
    for max_tokens in (None, 30):
        [out] = llm.generate(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))
        assert len(out.outputs[0].token_ids) == 64 - 50 and out.outputs[0].finish_reason == "length"


def test_min_tokens_suppresses_eos_until_reached(llm):
    full = greedy_tokens(llm, EOS_PROMPT, 24)
    e = full.index(EOS)
    m = e + 3
    [out] = llm.generate(EOS_PROMPT, SamplingParams(temperature=0.0, max_tokens=24, min_tokens=m))
    got = out.outputs[0].token_ids
    assert got[:e] == full[:e]  # nothing changes before EOS would come
    assert EOS not in got[:m] and len(got) >= m
    if out.outputs[0].finish_reason == "stop":
        assert got[-1] == EOS and len(got) > m
    else:
        assert len(got) == 24
    # at the banned position the engine takes HF's best non-EOS token
    row = hf_logits(ARCH, EOS_PROMPT + full[:e])[-1].clone()
    row[EOS] = float("-inf")
    assert got[e] == int(row.argmax())
    # min_tokens with ignore_eos: EOS is not banned (vLLM), output as without min_tokens
    [out] = llm.generate(EOS_PROMPT, SamplingParams(temperature=0.0, max_tokens=24, min_tokens=m, ignore_eos=True))
    assert out.outputs[0].token_ids == full


def test_min_tokens_suppresses_stop_token_ids_until_reached(llm):
    prompt = PROMPTS[6]
    full = greedy_tokens(llm, prompt, 24)
    j = first_new_index(full, 4)
    stop = full[j]
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                stop_token_ids=[stop], min_tokens=j + 1))
    got = out.outputs[0].token_ids
    assert got[:j] == full[:j] and stop not in got[:j + 1] and len(got) >= j + 1
    row = hf_logits(ARCH, prompt + full[:j])[-1].clone()
    row[stop] = float("-inf")
    assert got[j] == int(row.argmax())
    if out.outputs[0].finish_reason == "stop":
        assert got[-1] == stop and out.outputs[0].stop_reason == stop
    # min_tokens = j: the stop token at index j (the (j+1)-th token) is allowed and ends it
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                stop_token_ids=[stop], min_tokens=j))
    assert out.outputs[0].token_ids == full[:j + 1] and out.outputs[0].finish_reason == "stop"


def _pick_stop_string(text: str, start: int = 4, size: int = 3) -> tuple[str, int]:
    """A plain-ASCII substring of `text` whose first occurrence starts at index >= start."""
    for a in range(start, len(text) - size):
        s = text[a:a + size]
        if all(ch.isascii() and (ch.isalnum() or ch == " ") for ch in s) and text.find(s) == a:
            return s, a
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_cut_the_text(llm):
    [full] = llm.generate(TEXT_PROMPT, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24))
    text, toks = full.outputs[0].text, full.outputs[0].token_ids
    assert full.prompt == TEXT_PROMPT and full.prompt_token_ids == llm.tokenizer.encode(TEXT_PROMPT)
    s, a = _pick_stop_string(text)

    [out] = llm.generate(TEXT_PROMPT, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, stop=[s]))
    c = out.outputs[0]
    assert c.text == text[:a]
    assert (c.finish_reason, c.stop_reason) == ("stop", s)
    # generation stopped at the token that completed the stop string
    n = len(c.token_ids)
    assert c.token_ids == toks[:n] and n < len(toks)
    assert s in llm.tokenizer.decode(toks[:n]) and s not in llm.tokenizer.decode(toks[:n - 1])

    [out] = llm.generate(TEXT_PROMPT, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, stop=s,
                                                     include_stop_str_in_output=True))
    c2 = out.outputs[0]
    assert c2.text == text[:a + len(s)] and c2.token_ids == c.token_ids
    assert (c2.finish_reason, c2.stop_reason) == ("stop", s)

    # several stop strings: the earliest in the text wins; one that never occurs changes nothing
    s2, _a2 = _pick_stop_string(text, start=a + len(s) + 1, size=2)
    [out] = llm.generate(TEXT_PROMPT, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24,
                                                     stop=[s2, s, "\x07never\x07"]))
    assert out.outputs[0].text == text[:a] and out.outputs[0].stop_reason == s
    [out] = llm.generate(TEXT_PROMPT, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24,
                                                     stop=["\x07never\x07"]))
    assert out.outputs[0].text == text and out.outputs[0].finish_reason == "length"


def test_min_tokens_also_holds_against_stop_strings(llm):
    [full] = llm.generate(TEXT_PROMPT, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24))
    s, _ = _pick_stop_string(full.outputs[0].text)
    [out] = llm.generate(TEXT_PROMPT, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, stop=[s],
                                                     min_tokens=12))
    assert len(out.outputs[0].token_ids) >= 12


# --------------------------------------------------------------------------------------------
# logprobs


def _check_logprobs(llm, prompt, comp, k: int, tol: float = 1e-3) -> None:
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
    ref = hf_logprobs(ARCH, list(prompt) + comp.token_ids)
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert tok in entry, (i, tok, entry)
        assert abs(entry[tok].logprob - float(row[tok])) < tol, (i, entry[tok].logprob, float(row[tok]))
        assert entry[tok].rank == 1 + int((row > row[tok]).sum())
        assert entry[tok].decoded_token == llm.tokenizer.decode([tok])
        top = torch.topk(row, k) if k else None
        others = {t: lp for t, lp in entry.items() if t != tok}
        if k == 0:
            assert not others
            continue
        assert set(entry) == set(top.indices.tolist()) | {tok}
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert abs(entry[t].logprob - v) < tol, (i, t, entry[t].logprob, v)
            assert entry[t].rank == r


def test_logprobs_match_hf_log_softmax(llm):
    prompt = PROMPTS[5]
    [g] = llm.generate(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, logprobs=5))
    _check_logprobs(llm, prompt, g.outputs[0], 5)
    assert all(e[t].rank == 1 for t, e in zip(g.outputs[0].token_ids, g.outputs[0].logprobs))
    # sampled tokens (often not the top one), logprobs of the raw logits (not temperature-scaled)
    [s] = llm.generate(prompt, _seeded(seed=11, temperature=1.5, top_p=1.0, top_k=0, max_tokens=16, logprobs=3))
    _check_logprobs(llm, prompt, s.outputs[0], 3)
    assert any(e[t].rank > 1 for t, e in zip(s.outputs[0].token_ids, s.outputs[0].logprobs))


def test_logprobs_per_request_in_a_mixed_batch(llm):
    ks = [None, 0, 2, 5, None, 20]
    prompts = PROMPTS[:len(ks)]
    params = [_seeded(seed=i, temperature=1.0, max_tokens=8, logprobs=k) for i, k in enumerate(ks)]
    outs = llm.generate(prompts, params)
    for p, k, out in zip(prompts, ks, outs):
        c = out.outputs[0]
        if k is None:
            assert c.logprobs is None
        else:
            _check_logprobs(llm, p, c, k)


# --------------------------------------------------------------------------------------------
# penalties


def _repeats(seq) -> int:
    return len(seq) - len(set(seq))


def _seen_before(prompt, seq) -> int:
    return sum(t in prompt or t in seq[:j] for j, t in enumerate(seq))


def _penalized_greedy_matches_hf(prompt, got, rep=1.0, freq=0.0, pres=0.0) -> None:
    """Each greedy token is the argmax of HF's logits after vLLM's penalties for that prefix."""
    logits = hf_logits(ARCH, list(prompt) + got)
    for i, tok in enumerate(got):
        row = logits[len(prompt) - 1 + i].clone()
        out = got[:i]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V).float() if out else torch.zeros(V)
        if rep != 1.0:
            seen = counts > 0
            seen[torch.tensor(list(prompt))] = True
            row = torch.where(seen, torch.where(row > 0, row / rep, row * rep), row)
        row = row - freq * counts - pres * (counts > 0).float()
        top2 = torch.topk(row, 2).values
        assert tok == int(row.argmax()) or float(top2[0] - top2[1]) < 1e-3, (i, tok, int(row.argmax()))


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.0}, {"frequency_penalty": 1.5},
                                {"repetition_penalty": 3.0}, {"presence_penalty": -2.0},
                                {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.5}],
                         ids=["presence", "frequency", "repetition", "negative-presence", "all"])
def test_penalties_follow_hf_logits(llm, kw):
    prompts = [REPEATY_PROMPT, PROMPTS[2], PROMPTS[6]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, **kw))
    for p, out in zip(prompts, outs):
        _penalized_greedy_matches_hf(p, out.outputs[0].token_ids, kw.get("repetition_penalty", 1.0),
                                     kw.get("frequency_penalty", 0.0), kw.get("presence_penalty", 0.0))


def test_penalties_change_outputs_in_the_expected_direction(llm):
    prompts = [REPEATY_PROMPT] + PROMPTS

    def run(**kw):
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, **kw))
        return [o.outputs[0].token_ids for o in outs]

    base = run()
    assert _repeats(base[0]) >= 10  # the greedy baseline repeats itself a lot
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        pen = run(**kw)
        assert _repeats(pen[0]) < _repeats(base[0]), kw
        assert sum(map(_repeats, pen)) < sum(map(_repeats, base)), kw
    rep = run(repetition_penalty=3.0)
    assert sum(_seen_before(p, s) for p, s in zip(prompts, rep)) < sum(_seen_before(p, s) for p, s in zip(prompts, base)) / 2
    neg = run(presence_penalty=-2.0)
    assert sum(map(_repeats, neg)) > sum(map(_repeats, base))
    # a penalty on one request leaves the others in the batch alone
    mixed = llm.generate(prompts[:2], [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24,
                                                      presence_penalty=2.0),
                                       SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)])
    assert mixed[1].outputs[0].token_ids == base[1]
