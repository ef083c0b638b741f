"""Speculative decoding in the worker: propose draft tokens, verify them in the target's forward.

Per step, each decoding request the scheduler reserved lookahead slots for (Step.
num_lookahead_tokens) may get up to that many draft tokens d_1..d_k from a proposer: n-gram
prompt lookup (below) or a draft model (services/worker/draft_model.py). The runner appends
them to the request's tokens, runs the target over last token + drafts in the same flat batch
as everything else, and samples a token at each of the k+1 positions, each with its own
(seed, position) randomness and penalties over the tokens before it.

Verification: s_j is exactly the token non-speculative decoding would produce after the
sequence + d_1..d_j, because the sampler is a pure function of (logits, seed, position). So the
drafts are accepted while s_j == d_{j+1}, and the step yields s_0..s_a (a = accepted drafts,
s_a the target's own token at the first mismatch, or the bonus token after all k). Greedy and
seeded sampling alike give the very tokens decoding without speculation gives, independent of
batching; the output distribution is unchanged. This is rejection sampling with the draft as a
point mass coupled to the target through shared randomness: a draft is accepted with
probability p(d) (a draft model's own tokens come from the same (seed, position) noise, so a
draft close to the target agrees with it as often as the two distributions overlap). The
rejected drafts' K/V stay in their slots past num_computed, where the next step overwrites them.

Adaptive: a request whose proposal was wholly rejected stops proposing for 1, 3, 7, 15 steps
(doubling while it keeps missing), so a workload without repeats costs a lookup, not a
(k+1)-token verify, on most steps.
"""

from __future__ import annotations

import numpy as np

MAX_BACKOFF_STEPS = 15


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from
    `max_n` down to `min_n`) and propose the tokens that followed it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        if k <= 0 or L < self.min_n + 1:
            return []
        arr = np.asarray(tokens, np.int64)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = arr[L - n:]
            # windows starting at 0..L-n-1 (the suffix itself excluded); candidates where the first token matches
            starts = np.flatnonzero(arr[:L - n] == suffix[0])
            if not starts.size:
                continue
            hits = starts[(arr[starts[:, None] + np.arange(n)] == suffix).all(axis=1)]
            if hits.size:  # the latest occurrence: the most recent context
                s = int(hits[-1]) + n
                return arr[s:s + k].tolist()
        return []


class _Backoff:
    __slots__ = ("misses", "skip")

    def __init__(self) -> None:
        self.misses = 0
        self.skip = 0


class Speculator:
    """Which requests propose this step and how many tokens; how many of their drafts held."""

    def __init__(self, k: int, proposer) -> None:
        self.k = k
        self.proposer = proposer
        self._backoff: dict[str, _Backoff] = {}

    def forget(self, live: set[str] | dict, new: list[str] = ()) -> None:
        """Drop the state of requests the runner no longer holds, and of those that came anew
        (a preempted or failed-over request is new, with other blocks)."""
        for rid in [r for r in self._backoff if r not in live]:
            del self._backoff[rid]
        for rid in new:
            self._backoff.pop(rid, None)
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(live, new)

    def budget(self, rid: str, reserved: int) -> int:
        """Draft tokens request `rid` may propose now (0 while it backs off)."""
        b = self._backoff.get(rid)
        if b is not None and b.skip > 0:
            b.skip -= 1
            return 0
        return min(self.k, reserved)

    def propose(self, items: list[tuple[str, list[int], object, int]]) -> list[list[int]]:
        """items: (req_id, tokens, runner state, max drafts) -> drafts per item (maybe empty)."""
        if hasattr(self.proposer, "propose_batch"):
            return self.proposer.propose_batch(items)
        return [self.proposer.propose(toks, k) for _, toks, _, k in items]

    def verified(self, rid: str, base_len: int, drafted: int, accepted: int) -> None:
        if hasattr(self.proposer, "accepted"):
            self.proposer.accepted(rid, base_len, drafted, accepted)
        if drafted == 0:
            return
        b = self._backoff.setdefault(rid, _Backoff())
        if accepted == 0:
            b.misses += 1
            b.skip = min(MAX_BACKOFF_STEPS, (1 << b.misses) - 1)
        else:
            b.misses = 0


def accepted_length(samples: list[int], drafts: list[int]) -> int:
    """Drafts that hold: the longest prefix where the target's own token equals the draft."""
    a = 0
    for s, d in zip(samples, drafts):
        if s != d:
            break
        a += 1
    return a


def make_speculator(args, runner) -> Speculator | None:
    """The runner's speculator from the engine args (None: speculation off)."""
    method = getattr(args, "speculative_method", "none")
    if method == "none":
        return None
    k = args.num_speculative_tokens
    if method == "ngram":
        return Speculator(k, NgramProposer(args.prompt_lookup_min, args.prompt_lookup_max))
    from services.worker.draft_model import DraftProposer

    return Speculator(k, DraftProposer(args.speculative_model, runner))


def sample_positions(sample_rows: np.ndarray, qsl: np.ndarray, drafts: dict[int, list[int]]):
    """The flat-batch token indices to sample at: a request's last token, or its last token and
    every draft (k + 1 rows). -> (token index per row, request row per sample row, offset j)."""
    if not drafts:
        return qsl[1:][sample_rows] - 1, sample_rows, np.zeros(len(sample_rows), np.int64)
    idx, owner, off = [], [], []
    for i in sample_rows.tolist():
        n = len(drafts.get(i, ()))
        end = int(qsl[i + 1])
        idx.extend(range(end - n - 1, end))
        owner.extend([i] * (n + 1))
        off.extend(range(n + 1))
    return np.asarray(idx, np.int64), np.asarray(owner, np.int64), np.asarray(off, np.int64)
