"""The scheduler's side of speculative decoding: lookahead slots, multi-token results, counters.

The worker proposes draft tokens and verifies them (services/worker/spec_decode.py); the policy
only has to (1) reserve KV slots for up to K lookahead tokens of each decoding request, so the
worker can write the drafts' K/V in the verifying forward, (2) take 1..K+1 tokens per request
from a result (all but the last have their KV computed), and (3) count drafts and acceptances
for Prometheus (vLLM's spec_decode_* counters). No torch here: the scheduler imports none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from zeroserve.common.messages import StepResult
from zeroserve.services.scheduler.request import Request


def speculates(req: Request) -> bool:
    """Requests that decode without speculation: logprobs (one row per step and request) and
    grammars (the bitmask is for one position; the matcher would have to be advanced and rolled
    back across the drafts)."""
    return req.params.logprobs is None and req.constraint is None


def lookahead_for(req: Request, k: int, budget: int) -> int:
    """Lookahead tokens to reserve for a request about to decode its last token: at most k, no
    more than the step's token budget has room for, and never past its length limit (the step
    then adds up to lookahead + 1 tokens)."""
    if k <= 0 or not speculates(req):
        return 0
    return max(0, min(k, budget - 1, req.max_len - req.num_tokens - 1))


@dataclass
class SpecStats:
    """Cumulative counters (vLLM's names): drafts = requests that proposed in a step; the
    per-position list counts accepted drafts by their index in the proposal."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.extend([0] * (drafted - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


def result_tokens(result: StepResult) -> list[tuple[list[int], int]]:
    """Per request of the result: (its new tokens this step, drafts it proposed)."""
    first = result.sampled_token_ids.tolist()
    if result.num_spec_tokens is None:
        return [([t], 0) for t in first]
    extra = result.spec_token_ids.tolist()
    counts = result.num_spec_tokens.tolist()
    drafted = result.num_draft_tokens.tolist()
    out, off = [], 0
    for t, n, d in zip(first, counts, drafted):
        out.append(([t, *extra[off:off + n]], d))
        off += n
    return out


def check_spec_result(step_lookahead: dict[str, int], result: StepResult, vocab: int) -> str | None:
    """What is wrong with a result's speculative fields against its step (None: nothing): a
    request proposing more drafts than it had lookahead slots for, or tokens outside the vocabulary."""
    if result.num_draft_tokens is None:
        return None
    for rid, d, n, t in zip(result.req_ids, result.num_draft_tokens.tolist(), result.num_spec_tokens.tolist(),
                            result.sampled_token_ids.tolist()):
        if d > step_lookahead.get(rid, 0):
            return f"proposes {d} draft tokens for request {rid!r}, which had {step_lookahead.get(rid, 0)} slots"
        if n and t < 0:
            return f"has draft tokens but no sample for request {rid!r}"
    s = result.spec_token_ids
    if s.size and (int(s.min()) < 0 or int(s.max()) >= vocab):
        return f"has speculative token ids outside [0, {vocab})"
    return None


def empty_lookahead(n: int) -> np.ndarray:
    return np.zeros(n, np.int32)
