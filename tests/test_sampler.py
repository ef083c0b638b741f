"""Sampler: vectorized per-request sampling, counter-based seeded randomness, penalties, logprobs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from zeroserve.common.sampling_params import SamplingParams
from zeroserve.services.worker.sampler import SamplingTensors, apply_penalties, random_uniform, sample

V = 64


def _tensors(params, logits_rows=None, seeds=None, positions=None, prompts=None, outputs=None, eos=(0,)):
    B = len(params)
    return SamplingTensors.from_requests(
        params=params,
        seeds=seeds if seeds is not None else [1000 + i for i in range(B)],
        positions=positions if positions is not None else [10] * B,
        prompt_ids=prompts if prompts is not None else [[1, 2, 3]] * B,
        output_ids=outputs if outputs is not None else [[]] * B,
        eos_ids=list(eos),
        device="cpu",
    )


def _logits(B, V=V, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * scale


# --------------------------------------------------------------------------------- the hash


def _py_mix(x: int) -> int:
    m = (1 << 64) - 1
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def _py_uniform(seed: int, pos: int, tok: int) -> float:
    m = (1 << 64) - 1
    k = _py_mix(seed ^ 0x5DEECE66DA3B9F27)
    k = _py_mix((k + pos * 0x9E3779B97F4A7C15) & m)
    h = _py_mix((k + (tok + 1) * 0xD6E8FEB86659FD93) & m)
    return ((h >> 12) + 0.5) * 2.0**-52


def test_hash_matches_unsigned_reference_and_is_open_interval():
    seeds = torch.tensor([0, 1, 2**63 - 1, 123456789, 2**40 + 7])
    pos = torch.tensor([0, 5, 100000, 2**31, 17])
    u = random_uniform(seeds, pos, 50)
    for b in range(len(seeds)):
        for tok in (0, 1, 13, 49):
            assert u[b, tok].item() == _py_uniform(int(seeds[b]), int(pos[b]), tok)
    big = random_uniform(torch.arange(200), torch.arange(200) * 7, 1000)
    assert (big > 0).all() and (big < 1).all()
    assert abs(big.mean().item() - 0.5) < 0.005
    assert abs(big.var().item() - 1 / 12) < 0.002
    # deciles of a uniform: each holds ~10%
    hist = torch.histc(big.float(), bins=10, min=0, max=1) / big.numel()
    assert (hist - 0.1).abs().max() < 0.005


# --------------------------------------------------------------------------------- greedy


def test_all_greedy_is_argmax_with_lowest_index_ties():
    logits = _logits(6)
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1.0  # tie -> 5
    t = _tensors([SamplingParams(temperature=0)] * 6)
    assert t.all_greedy and t.top_k is None and t.top_p is None and t.min_p is None
    out = sample(logits, t)
    assert out.sampled.tolist() == logits.argmax(-1).tolist()
    assert out.sampled[2].item() == 5
    assert out.logprobs is None and out.ranks is None


def test_top_k_1_equals_greedy():
    logits = _logits(32, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(32)]
    for pos in range(5):
        out = sample(logits, _tensors(params, positions=[pos] * 32))
        assert torch.equal(out.sampled, logits.argmax(-1))


def test_temperature_to_zero_equals_greedy():
    B = 16
    logits = _logits(B, seed=2)
    top = logits.argmax(-1)
    logits[torch.arange(B), top] += 0.2  # gap >= 0.2 over the runner-up
    for temp in (1e-6, 1e-3):
        params = [SamplingParams(temperature=temp, seed=i) for i in range(B)]
        t = _tensors(params)
        assert t.all_greedy == (temp < 1e-5)
        for pos in range(5):
            t.positions = torch.full((B,), pos)
            assert torch.equal(sample(logits, t).sampled, top)


# --------------------------------------------------------------------------------- seeds


def _other_params(i: int) -> SamplingParams:
    choices = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, top_k=5, seed=7),
        SamplingParams(temperature=0.5, top_p=0.5, min_p=0.05),
        SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=1.0, presence_penalty=-1.0, logprobs=3),
        SamplingParams(temperature=2.0, top_k=20, top_p=0.95, repetition_penalty=0.7),
        SamplingParams(temperature=0.9, min_p=0.2, min_tokens=3, stop_token_ids=[4]),
    ]
    return choices[i % len(choices)]


@pytest.mark.parametrize("target", [
    SamplingParams(temperature=0.8, seed=42),
    SamplingParams(temperature=1.2, top_k=10, top_p=0.9, seed=3),
    SamplingParams(temperature=0.7, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.5, seed=99),
])
def test_seeded_row_is_batch_and_row_order_invariant(target):
    rng = random.Random(0)
    prompt = [rng.randrange(V) for _ in range(7)]
    out_ids: list[int] = []
    alone: list[int] = []
    batched: list[int] = []
    base = _logits(1, seed=5, scale=1.0)
    for step in range(25):
        pos = len(prompt) + step
        logits_row = base + 0.05 * step  # the "model" is deterministic in the step
        t1 = _tensors([target], seeds=[target.seed], positions=[pos], prompts=[prompt], outputs=[out_ids])
        a = sample(logits_row, t1).sampled.item()
        # the same row inside a batch of 8 with other params, at a random row, shuffled others
        others = [_other_params(rng.randrange(100)) for _ in range(7)]
        row = rng.randrange(8)
        params = others[:row] + [target] + others[row:]
        logits = _logits(8, seed=100 + step, scale=1.0)
        logits[row] = logits_row[0]
        seeds = [rng.randrange(2**63) for _ in range(8)]
        seeds[row] = target.seed
        positions = [rng.randrange(1000) for _ in range(8)]
        positions[row] = pos
        prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 12))] for _ in range(8)]
        prompts[row] = prompt
        outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 12))] for _ in range(8)]
        outputs[row] = out_ids
        tb = _tensors(params, seeds=seeds, positions=positions, prompts=prompts, outputs=outputs)
        b = sample(logits, tb).sampled[row].item()
        alone.append(a)
        batched.append(b)
        out_ids = out_ids + [a]
    assert alone == batched
    # a recompute (same seed, same positions, same logits) replays exactly
    replay: list[int] = []
    out_ids = []
    for step in range(25):
        t1 = _tensors([target], seeds=[target.seed], positions=[len(prompt) + step], prompts=[prompt],
                      outputs=[out_ids])
        tok = sample(base + 0.05 * step, t1).sampled.item()
        replay.append(tok)
        out_ids = out_ids + [tok]
    assert replay == alone
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_differ_and_positions_differ():
    logits = torch.zeros(1, 1000)  # uniform
    p = SamplingParams(temperature=1.0)

    def run(seed, offset=0):
        return [sample(logits, _tensors([p], seeds=[seed], positions=[offset + i])).sampled.item()
                for i in range(20)]

    a, b = run(1), run(2)
    assert a == run(1)
    assert a != b
    assert sum(x == y for x, y in zip(a, b)) <= 2
    assert len(set(a)) >= 15  # positions decorrelate


# --------------------------------------------------------------------------------- distribution

_CHI2_DF7_P1E4 = 29.88  # chi-square quantile, 7 degrees of freedom, p = 1e-4


def _chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    exp = probs * n
    keep = exp > 0
    return float((((counts - exp) ** 2)[keep] / exp[keep]).sum())


@pytest.mark.parametrize("vary", ["positions", "seeds"])
def test_empirical_distribution_matches_softmax(vary):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    T = 0.7
    N = 40000
    p = SamplingParams(temperature=T)
    if vary == "positions":
        seeds, positions = [12345] * N, list(range(N))
    else:
        seeds, positions = list(range(N)), [3] * N
    t = _tensors([p] * N, seeds=seeds, positions=positions, prompts=[[]] * N, outputs=[[]] * N)
    out = sample(logits.expand(N, -1).contiguous(), t).sampled
    counts = torch.bincount(out, minlength=8).float()
    probs = torch.softmax(logits[0] / T, -1)
    assert _chi2(counts, probs, N) < _CHI2_DF7_P1E4


def _ref_filter(logits: torch.Tensor, T: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Naive reference: probabilities after min_p -> top_k -> top_p for one row."""
    x = logits / T
    probs = torch.softmax(x, -1)
    keep = [probs[i] >= min_p * probs.max() for i in range(len(x))]
    order = sorted(range(len(x)), key=lambda i: (-x[i].item(), i))
    kept = [i for i in order if keep[i]]
    if top_k > 0:
        kept = kept[:top_k]
    if top_p < 1.0:
        z = sum(math.exp(x[i].item()) for i in kept)
        acc, final = 0.0, []
        for i in kept:
            if acc >= top_p * z and final:
                break
            final.append(i)
            acc += math.exp(x[i].item())
        kept = final
    mask = torch.full_like(x, float("-inf"))
    mask[kept] = 0.0
    return torch.softmax(x + mask, -1)


@pytest.mark.parametrize("kw,support", [
    (dict(top_k=3), {0, 6, 1}),
    (dict(top_p=0.6), {0, 6}),
    (dict(top_p=0.75), {0, 6, 1}),
    (dict(min_p=0.3), {0, 6, 1}),
    (dict(min_p=0.1, top_k=4, top_p=0.9), {0, 6, 1, 2}),
])
def test_top_k_top_p_min_p_restrict_support_exactly(kw, support):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    T = 1.0
    N = 20000
    p = SamplingParams(temperature=T, **kw)
    ref = _ref_filter(logits[0], T, kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    assert {i for i in range(8) if ref[i] > 0} == support  # the reference agrees with the hand count
    t = _tensors([p] * N, seeds=[77] * N, positions=list(range(N)), prompts=[[]] * N, outputs=[[]] * N)
    out = sample(logits.expand(N, -1).contiguous(), t).sampled
    assert set(out.tolist()) == support
    counts = torch.bincount(out, minlength=8).float()
    df = len(support) - 1
    assert _chi2(counts, ref, N) < {1: 15.2, 2: 18.5, 3: 21.2}[df]  # p = 1e-4 quantiles


def test_top_p_one_keeps_all_tokens_even_tiny_ones():
    logits = torch.tensor([[0.0, 0.0, -3.0]])
    N = 4000
    t = _tensors([SamplingParams(temperature=1.0, top_p=1.0, top_k=0)] * N, positions=list(range(N)),
                 seeds=[5] * N, prompts=[[]] * N, outputs=[[]] * N)
    out = sample(logits.expand(N, -1).contiguous(), t).sampled
    assert set(out.tolist()) == {0, 1, 2}


# --------------------------------------------------------------------------------- penalties


def _ref_penalties(logits, params, prompts, outputs):
    out = logits.clone()
    for b, p in enumerate(params):
        row = out[b]
        if p.repetition_penalty != 1.0:
            for tok in set(prompts[b]) | set(outputs[b]):
                v = row[tok].item()
                row[tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for tok in set(outputs[b]):
            c = outputs[b].count(tok)
            row[tok] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_each_penalty_changes_exactly_the_right_logits():
    B = 6
    logits = _logits(B, seed=9)
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(repetition_penalty=0.6),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-1.2),
        SamplingParams(repetition_penalty=1.2, frequency_penalty=-0.4, presence_penalty=0.9),
        SamplingParams(),  # untouched
    ]
    prompts = [[1, 2, 2, 5], [3, 63], [7, 8], [9], [10, 11, 12], [1, 2, 3]]
    outputs = [[5, 6, 6], [], [4, 4, 4, 8], [4, 4, 0], [11, 13, 13, 13], [1, 1]]
    t = _tensors(params, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits, t)
    ref = _ref_penalties(logits, params, prompts, outputs)
    assert torch.allclose(got, ref, atol=1e-6)
    changed = (got != logits)
    expect_changed = [
        {1, 2, 5, 6}, {3, 63}, {4, 8}, {4, 0}, {10, 11, 12, 13}, set(),
    ]
    for b in range(B):
        assert set(torch.nonzero(changed[b]).flatten().tolist()) == expect_changed[b]
    # penalties apply to greedy rows too: the sampler's argmax is the reference argmax
    greedy = [SamplingParams(**{**p.to_dict(), "temperature": 0.0}) for p in params]
    out = sample(logits, _tensors(greedy, prompts=prompts, outputs=outputs))
    assert torch.equal(out.sampled, ref.argmax(-1))


def test_penalty_tensors_only_built_when_needed():
    t = _tensors([SamplingParams(temperature=0.5), SamplingParams(frequency_penalty=0.1)])
    assert t.repetition_penalty is None and t.prompt_token_ids is None and t.presence_penalty is None
    assert t.frequency_penalty is not None and t.output_token_ids is not None
    t = _tensors([SamplingParams(temperature=0.5, repetition_penalty=1.1)], outputs=[[3, 4]])
    assert t.prompt_token_ids.tolist() == [[1, 2, 3]] and t.output_token_ids.tolist() == [[3, 4]]
    t = _tensors([SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.1)])
    assert t.top_k is None and t.top_p is None and t.min_p is None  # greedy rows ignore them


# --------------------------------------------------------------------------------- banned


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    B = 200
    logits = torch.zeros(B, V)
    logits[:, 0] = 20.0  # eos
    logits[:, 4] = 19.0  # stop token
    logits[:, 9] = 18.0
    eos = [0, 1]
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, min_tokens=5, stop_token_ids=[4])
              for i in range(B)]
    t = _tensors(params, outputs=[[7, 7]] * B, eos=eos, positions=list(range(B)))
    assert t.banned_rows is not None and len(t.banned_rows) == 3 * B
    out = sample(logits, t).sampled
    assert not ({0, 1, 4} & set(out.tolist()))
    assert (out == 9).float().mean() > 0.5
    # ignore_eos: eos may be sampled, the stop token is still banned
    t = _tensors([SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[4], ignore_eos=True)],
                 outputs=[[7]], eos=eos)
    assert sample(logits[:1], t).sampled.item() == 0
    logits2 = logits[:1].clone()
    logits2[0, 0] = -5
    assert sample(logits2, t).sampled.item() == 9
    # reached min_tokens: nothing banned
    t = _tensors([SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])], outputs=[[7, 7]], eos=eos)
    assert t.banned_rows is None
    assert sample(logits[:1], t).sampled.item() == 0


def test_explicit_banned_pairs_never_sampled():
    B = 500
    logits = _logits(B, seed=11, scale=0.5)
    rows = torch.arange(B).repeat_interleave(3)
    toks = torch.stack([logits.argmax(-1), (logits.argmax(-1) + 1) % V, torch.full((B,), 7)], 1).flatten()
    t = _tensors([SamplingParams(temperature=1.0)] * B, positions=list(range(B)))
    t.banned_rows, t.banned_tokens = rows, toks
    out = sample(logits, t).sampled
    banned = set(zip(rows.tolist(), toks.tolist()))
    assert not any((b, tok) in banned for b, tok in enumerate(out.tolist()))


# --------------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_top_n_and_rank_are_correct():
    B = 10
    logits = _logits(B, seed=13)
    params = [SamplingParams(temperature=0.9, top_k=7, repetition_penalty=1.4, logprobs=5 if i % 3 else None,
                             seed=i) for i in range(B)]
    params[0] = SamplingParams(temperature=0, logprobs=2, frequency_penalty=1.0)
    t = _tensors(params, outputs=[[1, 2, 2]] * B, positions=list(range(B)))
    assert t.num_logprobs == 5
    out = sample(logits, t)
    raw = torch.log_softmax(logits, -1)
    assert out.logprob_token_ids.shape == (B, 6) and out.logprobs.shape == (B, 6)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled)
    assert torch.allclose(out.logprobs, raw.gather(1, out.logprob_token_ids), atol=1e-6)
    top_lp, _ = torch.sort(raw, -1, descending=True)
    assert torch.allclose(out.logprobs[:, 1:], top_lp[:, :5], atol=1e-6)
    for b in range(B):
        s = out.sampled[b].item()
        assert out.ranks[b].item() == 1 + sum(1 for v in raw[b].tolist() if v > raw[b, s].item())
    # rank 1 for an unpenalized greedy pick
    t = _tensors([SamplingParams(temperature=0, logprobs=0)])
    o = sample(logits[:1], t)
    assert o.ranks.tolist() == [1] and o.logprob_token_ids.shape == (1, 1)
    assert torch.allclose(o.logprobs[0, 0], raw[0].max())


def test_bf16_logits_are_accepted():
    logits = _logits(4, seed=3).to(torch.bfloat16)
    t = _tensors([SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=1.0, seed=1)] * 2)
    out = sample(logits, t)
    assert out.logprobs.dtype == torch.float32
    assert out.sampled[0].item() == logits[0].float().argmax().item()


# --------------------------------------------------------------------------------- mixed batch


def test_mixed_batch_in_one_call():
    B = 12
    logits = _logits(B, seed=21)
    params = []
    for i in range(B):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0))
        elif kind == 1:
            params.append(SamplingParams(temperature=1.0, top_k=3, seed=i))
        elif kind == 2:
            params.append(SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=1.0))
        else:
            params.append(SamplingParams(temperature=0.8, top_p=0.5, frequency_penalty=0.5, logprobs=2))
    prompts = [[i, i + 1] for i in range(B)]
    outputs = [[i + 2, i + 2, 30] for i in range(B)]
    t = _tensors(params, prompts=prompts, outputs=outputs)
    before = logits.clone()
    out = sample(logits, t)
    assert torch.equal(logits, before)  # the caller's logits are never modified
    pen = _ref_penalties(logits, params, prompts, outputs)
    assert out.sampled.shape == (B,) and out.sampled.dtype == torch.int64
    for b, p in enumerate(params):
        s = out.sampled[b].item()
        if p.greedy:
            assert s == pen[b].argmax().item()
        elif p.top_k == 3:
            assert s in pen[b].topk(3).indices.tolist()
        else:
            ref = _ref_filter(pen[b], p.temperature, 0, p.top_p, 0.0)
            assert ref[s] > 0
    assert out.logprobs.shape == (B, 3)
