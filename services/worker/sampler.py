"""One vectorized sampling pass for a whole batch, every parameter per request (vLLM semantics).

Pipeline for `sample(logits, t)`, all rows at once, no Python loop over rows or tokens:

1. logprobs (when asked) are taken from the RAW logits: `log_softmax(logits)`.
2. penalties: repetition (prompt + output tokens: logit > 0 -> logit / p, else logit * p),
   frequency (`-= f * count_in_output`), presence (`-= p * (count_in_output > 0)`).
3. banned (row, token) pairs -> -inf (min_tokens: eos + stop token ids).
3b. structured outputs: tokens whose bit is clear in the row's grammar bitmask -> -inf. The
   grammar outranks the bans: a row the bans would leave without any token (min_tokens banning
   the EOS a finished grammar needs) keeps the grammar's tokens alone.
4. greedy rows (temperature < 1e-5) take `argmax` (ties -> lowest index).
5. random rows: `/ temperature` -> min_p (drop prob < min_p * max_prob) -> top_k -> top_p
   (smallest set of mass >= top_p, top token always kept) -> exponential race.

Randomness is a pure function of (seed, position, token index): a splitmix64-style mixer on
int64 tensors (wrapping arithmetic, logical shifts by masking) gives 52 random bits per
(row, token), turned into u in (0, 1) and then E = -log(u) ~ Exp(1). The sampled token is
`argmax(probs / E)`, which picks token i with probability probs[i]. Nothing depends on the
batch composition, the row order, a generator state or the device's RNG, so a request gets
the same tokens alone, in any batch, after a preemption/recompute, and on CPU or CUDA (only
integer and elementwise torch ops).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from zeroserve.common.sampling_params import _GREEDY_EPS, SamplingParams
from zeroserve.kernels.token_bitmask import apply_token_bitmask_

__all__ = ["SamplingTensors", "SamplerOutput", "sample", "random_uniform", "GREEDY_EPS"]

GREEDY_EPS = _GREEDY_EPS


# ---------------------------------------------------------------------------------------------
# counter-based random numbers


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    c &= (1 << 64) - 1
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_M1 = _i64(0xBF58476D1CE4E5B9)
_M2 = _i64(0x94D049BB133111EB)
_SEED_SALT = _i64(0x5DEECE66DA3B9F27)
_TOKEN_MUL = _i64(0xD6E8FEB86659FD93)


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic on signed ints)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: Tensor) -> Tensor:
    """splitmix64 finalizer: a bijection on 64-bit words with full avalanche (wrapping int64)."""
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def _mix64_(x: Tensor, tmp: Tensor) -> Tensor:
    """`_mix64` in place on x, with tmp (same shape) as scratch: no allocation on big tensors."""
    for s, m in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(x, s, out=tmp)
        tmp.bitwise_and_((1 << (64 - s)) - 1)
        x.bitwise_xor_(tmp)
        if m is not None:
            x.mul_(m)
    return x


def _row_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    """[B] int64 key per (seed, position)."""
    k = _mix64(seeds.to(torch.int64) ^ _SEED_SALT)
    return _mix64(k + positions.to(torch.int64) * _GOLDEN)


def _uniform_(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """[B, V] float64 uniforms in (0, 1). SplitMix64 streams: the row's key is the state, token i
    takes output i + 1 (`mix(key + (i + 1) * gamma)`). Computed in place in one buffer."""
    keys = _row_keys(seeds, positions)
    gamma = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device).mul_(_TOKEN_MUL)
    h = keys[:, None] + gamma[None, :]
    tmp = torch.empty_like(h)
    _mix64_(h, tmp)
    torch.bitwise_right_shift(h, 12, out=tmp)
    tmp.bitwise_and_((1 << 52) - 1)  # 52 bits: (bits + 0.5) needs 53, exact in float64, never 0 nor 1
    u = h.view(torch.float64)  # reuse h's storage (same element size)
    u.copy_(tmp)
    return u.add_(0.5).mul_(2.0 ** -52)


def random_uniform(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """[B, V] float64 uniforms in the open interval (0, 1), a pure function of
    (seeds[b], positions[b], token index). Exposed for tests and other consumers."""
    return _uniform_(seeds, positions, vocab_size)


def _exponential_noise(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """[B, V] float32 Exp(1) samples, strictly positive and finite."""
    return _uniform_(seeds, positions, vocab_size).log_().neg_().to(torch.float32)


# ---------------------------------------------------------------------------------------------
# batch parameters


@dataclass
class SamplingTensors:
    """Per-step sampling parameters, one tensor per parameter (not per request)."""

    temperature: Tensor  # [B] fp32, 0 => greedy row
    top_k: Tensor | None  # [B] int64, 0 => off; None if no row uses it
    top_p: Tensor | None  # [B] fp32, 1 => off
    min_p: Tensor | None  # [B] fp32, 0 => off
    repetition_penalty: Tensor | None  # [B] fp32, 1 => off
    frequency_penalty: Tensor | None  # [B] fp32, 0 => off
    presence_penalty: Tensor | None  # [B] fp32, 0 => off
    prompt_token_ids: Tensor | None  # [B, Lp] int64, pad -1 (only with repetition penalty)
    output_token_ids: Tensor | None  # [B, Lo] int64, pad -1 (only when any penalty is used)
    seeds: Tensor  # [B] int64
    positions: Tensor  # [B] int64, index in the sequence of the token being sampled
    banned_rows: Tensor | None  # [K] int64   (row, token) pairs forced to -inf
    banned_tokens: Tensor | None  # [K] int64
    num_logprobs: int | None  # max top-N asked by any row; None or < 0 => no logprobs at all
    all_greedy: bool
    bitmask_rows: Tensor | None = None  # [K] int64: the rows under a grammar
    bitmask: Tensor | None = None  # [K, ceil(V/32)] int32: bit t of word t // 32 = token t allowed

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        seeds,
        positions,
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        eos_ids: list[int] | None,
        device: torch.device | str = "cpu",
    ) -> "SamplingTensors":
        """Build the batch tensors from per-request params.

        `seeds`/`positions`: one int per row (list or tensor). `eos_ids`: the model's EOS token
        ids (shared by all rows). Rows whose output is shorter than `min_tokens` get their EOS ids
        (unless `ignore_eos`) and `stop_token_ids` banned. Optional tensors are built only when
        some row needs them."""
        B = len(params)
        if not (len(prompt_ids) == len(output_ids) == B):
            raise ValueError("params, prompt_ids and output_ids must have one entry per row")
        dev = torch.device(device)
        greedy = [p.greedy for p in params]
        rand = [not g for g in greedy]

        def f32(vals) -> Tensor:
            return torch.tensor(vals, dtype=torch.float32, device=dev)

        def i64(vals) -> Tensor:
            if isinstance(vals, Tensor):
                return vals.to(device=dev, dtype=torch.int64)
            return torch.tensor(list(vals), dtype=torch.int64, device=dev)

        def padded(rows: list[list[int]]) -> Tensor:
            width = max((len(r) for r in rows), default=0)
            return torch.tensor([list(r) + [-1] * (width - len(r)) for r in rows], dtype=torch.int64,
                                device=dev).reshape(B, width)

        temperature = f32([0.0 if g else float(p.temperature) for p, g in zip(params, greedy)])
        use_top_k = any(r and p.top_k > 0 for p, r in zip(params, rand))
        use_top_p = any(r and p.top_p < 1.0 for p, r in zip(params, rand))
        use_min_p = any(r and p.min_p > 0.0 for p, r in zip(params, rand))
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_freq = any(p.frequency_penalty != 0.0 for p in params)
        use_pres = any(p.presence_penalty != 0.0 for p in params)

        rows: list[int] = []
        toks: list[int] = []
        eos = list(eos_ids or [])
        for i, (p, out) in enumerate(zip(params, output_ids)):
            if p.min_tokens and len(out) < p.min_tokens:
                ban = set(p.stop_token_ids or [])
                if not p.ignore_eos:
                    ban.update(eos)
                for tok in sorted(ban):
                    rows.append(i)
                    toks.append(tok)

        nl = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            top_k=i64([p.top_k if r else 0 for p, r in zip(params, rand)]) if use_top_k else None,
            top_p=f32([float(p.top_p) if r else 1.0 for p, r in zip(params, rand)]) if use_top_p else None,
            min_p=f32([float(p.min_p) if r else 0.0 for p, r in zip(params, rand)]) if use_min_p else None,
            repetition_penalty=f32([float(p.repetition_penalty) for p in params]) if use_rep else None,
            frequency_penalty=f32([float(p.frequency_penalty) for p in params]) if use_freq else None,
            presence_penalty=f32([float(p.presence_penalty) for p in params]) if use_pres else None,
            prompt_token_ids=padded(prompt_ids) if use_rep else None,
            output_token_ids=padded(output_ids) if (use_rep or use_freq or use_pres) else None,
            seeds=i64(seeds),
            positions=i64(positions),
            banned_rows=i64(rows) if rows else None,
            banned_tokens=i64(toks) if rows else None,
            num_logprobs=max(nl) if nl else -1,
            all_greedy=all(greedy),
        )


@dataclass
class SamplerOutput:
    sampled: Tensor  # [B] int64
    logprob_token_ids: Tensor | None = None  # [B, 1+N] int64; col 0 = sampled token, 1..N = top-N
    logprobs: Tensor | None = None  # [B, 1+N] fp32, of the raw logits
    ranks: Tensor | None = None  # [B] int64, rank of the sampled token (1 = most likely)


# ---------------------------------------------------------------------------------------------
# the pass


def _token_mask(ids: Tensor, B: int, V: int) -> Tensor:
    """[B, V] bool: token v occurs in row b of `ids` ([B, L], pad < 0)."""
    ids = torch.where(ids < 0, V, ids)  # pads land in a dropped extra column
    m = torch.zeros(B, V + 1, dtype=torch.bool, device=ids.device)
    if ids.shape[1]:
        m.scatter_(1, ids, True)
    return m[:, :V]


def _token_counts(ids: Tensor, B: int, V: int, dtype: torch.dtype) -> Tensor:
    ids = torch.where(ids < 0, V, ids)
    c = torch.zeros(B, V + 1, dtype=dtype, device=ids.device)
    if ids.shape[1]:
        c.scatter_add_(1, ids, torch.ones(ids.shape, dtype=dtype, device=ids.device))
    return c[:, :V]


def apply_penalties(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Repetition, then frequency, then presence penalty. Returns a new tensor when any applies
    (never modifies `logits`)."""
    B, V = logits.shape
    out_ids = t.output_token_ids
    if out_ids is None:
        out_ids = torch.empty(B, 0, dtype=torch.int64, device=logits.device)
    if t.repetition_penalty is not None:
        seen = _token_mask(out_ids, B, V)
        if t.prompt_token_ids is not None:
            seen = seen | _token_mask(t.prompt_token_ids, B, V)
        p = t.repetition_penalty.to(logits.dtype)[:, None]
        penalized = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalized, logits)
    if t.frequency_penalty is not None or t.presence_penalty is not None:
        counts = _token_counts(out_ids, B, V, logits.dtype)
        if t.frequency_penalty is not None:
            logits = logits - t.frequency_penalty.to(logits.dtype)[:, None] * counts
        if t.presence_penalty is not None:
            logits = logits - t.presence_penalty.to(logits.dtype)[:, None] * (counts > 0).to(logits.dtype)
    return logits


def _apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """One stable descending sort serves both; masked entries become -inf."""
    B, V = logits.shape
    srt, idx = torch.sort(logits, dim=-1, descending=True, stable=True)
    ranks = torch.arange(V, device=logits.device)[None, :]
    if top_k is not None:
        k = torch.where(top_k <= 0, V, top_k)[:, None]
        srt = srt.masked_fill(ranks >= k, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(srt, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
        drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None] & (ranks > 0)
        srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, srt)


def _apply_grammar(x: Tensor, logits: Tensor, unbanned: Tensor, t: SamplingTensors) -> Tensor:
    """x with its grammar rows masked (x itself when the pass owns it; `unbanned`: x before the bans)."""
    if x is logits:
        x = x.clone()  # the caller's logits stay as they are
    dead = apply_token_bitmask_(x, t.bitmask_rows, t.bitmask)
    if bool(dead.any()):  # the bans left no allowed token: the grammar's tokens alone
        rows = t.bitmask_rows[dead.to(t.bitmask_rows.device)]
        fix = unbanned.index_select(0, rows)
        apply_token_bitmask_(fix, torch.arange(len(rows), device=fix.device), t.bitmask[dead.to(t.bitmask.device)])
        x.index_copy_(0, rows, fix)
    return x


def sample(logits: Tensor, t: SamplingTensors) -> SamplerOutput:
    """Sample one token per row of `logits` [B, V] under the per-row parameters in `t`."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    B, V = logits.shape
    want_lp = t.num_logprobs is not None and t.num_logprobs >= 0
    raw_lp = torch.log_softmax(logits, dim=-1) if want_lp else None

    x = apply_penalties(logits, t)
    unbanned = x  # a grammar row the bans leave empty falls back to it: the bans must not touch it
    grammar = t.bitmask is not None and t.bitmask_rows.numel()
    if t.banned_rows is not None and t.banned_rows.numel():
        x = x.clone() if x is logits or grammar else x
        x.index_put_((t.banned_rows, t.banned_tokens), torch.tensor(float("-inf"), device=x.device))
    if grammar:
        x = _apply_grammar(x, logits, unbanned, t)

    greedy_tok = torch.argmax(x, dim=-1)
    if t.all_greedy:
        sampled = greedy_tok
    else:
        greedy_row = t.temperature < GREEDY_EPS
        temp = torch.where(greedy_row, torch.ones_like(t.temperature), t.temperature)
        x = x / temp[:, None]
        if t.min_p is not None:
            probs = torch.softmax(x, dim=-1)
            thresh = t.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            x = x.masked_fill(probs < thresh, float("-inf"))
        if t.top_k is not None or t.top_p is not None:
            x = _apply_top_k_top_p(x, t.top_k, t.top_p)
        probs = torch.softmax(x, dim=-1)
        del x
        rand_tok = torch.argmax(probs.div_(_exponential_noise(t.seeds, t.positions, V)), dim=-1)
        sampled = torch.where(greedy_row, greedy_tok, rand_tok)

    out = SamplerOutput(sampled=sampled)
    if want_lp:
        chosen = raw_lp.gather(1, sampled[:, None])  # [B, 1]
        n = min(int(t.num_logprobs), V)
        if n > 0:
            top_lp, top_ids = torch.topk(raw_lp, n, dim=-1)
            out.logprob_token_ids = torch.cat([sampled[:, None], top_ids], dim=1)
            out.logprobs = torch.cat([chosen, top_lp], dim=1)
        else:
            out.logprob_token_ids = sampled[:, None].clone()
            out.logprobs = chosen
        out.ranks = (raw_lp > chosen).sum(dim=-1) + 1
    return out
