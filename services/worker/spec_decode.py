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

Adaptive, because a verify is not free: on CPU a decode-only step runs the compiled one-token
step and a verifying step the layer-by-layer path, 2-3x its time at batch 1 (measured). The
speculator keeps each request's acceptance rate (an EMA; new requests start from the runner's
overall rate) and the runner's step times, decode-only and verifying, per batch size. A pure
decode step keeps its drafts only when the tokens it expects, B + sum over requests of
a + a^2 + ... + a^k, over the verify time beat B tokens over the decode time by MIN_GAIN; a step that
prefills anyway (not the compiled path) always keeps them. A request that proposed and had
nothing accepted also pauses for 1, 3, 7, 15 steps. Requests that are not allowed to propose
still probe (one step in PROBE_EVERY at most, whatever the batch), so a rate that fell can recover.
"""

from __future__ import annotations

import numpy as np

MAX_BACKOFF_STEPS = 15
PROBE_EVERY = 16
EMA = 0.2  # weight of the newest observation
DEFAULT_VERIFY_RATIO = 2.5  # verify / decode step time until both are measured at a batch size
# the expected speed-up a verify must promise: the model ignores the proposer's and the extra
# sample rows' own time, and a no-repeat workload measured slower at a promised 1.07
MIN_GAIN = 1.15


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
    __slots__ = ("misses", "skip", "alpha", "since")

    def __init__(self, alpha: float) -> None:
        self.misses = 0
        self.skip = 0
        self.alpha = alpha  # acceptance rate per draft token (EMA)
        self.since = 0  # steps since it last verified drafts


def expected_accepted(alpha: float, k: int) -> float:
    """Accepted drafts out of k when each holds with probability alpha given the ones before."""
    return sum(alpha ** j for j in range(1, k + 1))


class Speculator:
    """Which requests propose this step and how many tokens; how many of their drafts held."""

    def __init__(self, k: int, proposer) -> None:
        self.k = k
        self.proposer = proposer
        self.costly = hasattr(proposer, "propose_batch")  # a model's forwards, not a lookup
        self._backoff: dict[str, _Backoff] = {}
        self.alpha = 0.6  # the runner's acceptance rate, the prior of a new request
        self._times: dict[tuple[int, bool], float] = {}  # (batch size, verifying) -> step seconds (EMA)
        self._since_probe = 0  # pure decode steps since the last probe (one per PROBE_EVERY at most)

    def forget(self, live: set[str] | dict, new: list[str] = ()) -> None:
        """Drop the state of requests the runner no longer holds, and of those that came anew
        (a preempted or failed-over request is new, with other blocks)."""
        for rid in [r for r in self._backoff if r not in live]:
            del self._backoff[rid]
        for rid in new:
            self._backoff.pop(rid, None)
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(live, new)

    def _state(self, rid: str) -> _Backoff:
        b = self._backoff.get(rid)
        if b is None:
            b = self._backoff[rid] = _Backoff(self.alpha)
        return b

    def budget(self, rid: str, reserved: int) -> int:
        """Draft tokens request `rid` may propose now (0 while it backs off)."""
        b = self._state(rid)
        b.since += 1
        if b.skip > 0:
            b.skip -= 1
            return 0
        return min(self.k, reserved)

    def worth_it(self, batch: int, pure_decode: bool, proposals: dict[str, int]) -> bool:
        """Whether a step of `batch` requests should verify these proposals (req_id -> drafts)."""
        if not proposals or not pure_decode:
            return bool(proposals)
        self._since_probe += 1
        td, tv = self._times.get((batch, False)), self._times.get((batch, True))
        if self._since_probe >= PROBE_EVERY and (tv is None or any(self._state(r).since >= PROBE_EVERY
                                                                   for r in proposals)):
            self._since_probe = 0
            return True  # a probe: keeps the rates and the verify time measured
        ratio = tv / td if td and tv else DEFAULT_VERIFY_RATIO
        gain = sum(expected_accepted(self._state(r).alpha, n) for r, n in proposals.items())
        return (batch + gain) / ratio > MIN_GAIN * batch

    def timed(self, batch: int, verifying: bool, seconds: float) -> None:
        """A pure decode step's time (verifying or not)."""
        key = (batch, verifying)
        old = self._times.get(key)
        self._times[key] = seconds if old is None else old + EMA * (seconds - old)

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
        b = self._state(rid)
        b.since = 0
        rate = accepted / drafted
        b.alpha += EMA * (rate - b.alpha)
        self.alpha += EMA / 4 * (rate - self.alpha)
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
    from zeroserve.services.worker.draft_model import DraftProposer

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
