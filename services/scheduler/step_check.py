"""Whether a worker group's StepResult answers the step it claims to, before any state takes it.

A group that answers nonsense (requests out of order, a token where none was due or outside the
vocabulary or the request's grammar) is given up (services/scheduler/groups.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroserve.common import messages as P
from zeroserve.common.errors import InvalidRequest
from zeroserve.services.scheduler.speculative import check_spec_result

if TYPE_CHECKING:
    from zeroserve.common.model_config import ModelConfig
    from zeroserve.services.scheduler.request import Request

__all__ = ["BadStepResult", "check_result", "grammar_violation"]


class BadStepResult(InvalidRequest):
    """A StepResult that does not answer the step it claims to (its group is given up)."""


def grammar_violation(step: P.Step, m: P.StepResult) -> str | None:
    """A constrained request's sampled token whose bit is clear in the step's bitmask (the worker
    ignored its grammar), before any state takes the token."""
    if step.token_bitmask is None:
        return None
    pos = {rid: k for k, rid in enumerate(m.req_ids)}
    for row, rid in enumerate(step.bitmask_req_ids):
        t = int(m.sampled_token_ids[pos[rid]]) if rid in pos else -1
        if t >= 0 and not (int(step.token_bitmask[row, t >> 5]) >> (t & 31)) & 1:
            return f"samples token {t} for request {rid!r}, which its grammar does not allow"
    return None


def check_result(step: P.Step, m: P.StepResult, cfg: ModelConfig, requests: dict[str, Request]) -> str | None:
    """What is wrong with a result for `step` (None: nothing): the step's requests in its
    order, a token id in [0, vocab) exactly where a sample was due (-1 elsewhere), logprob
    ids in the vocabulary (num_tokens and step_time_s are only reported, not used)."""
    ids = step.req_ids()
    if m.req_ids != ids:
        return f"names requests {m.req_ids[:4]}... instead of the step's {ids[:4]}... (in that order)"
    vocab = cfg.vocab_size
    tok = m.sampled_token_ids
    if tok.size and (int(tok.min()) < -1 or int(tok.max()) >= vocab):
        return f"samples token ids outside [0, {vocab}) (or -1 for no sample)"
    if m.logprob_token_ids is not None and m.logprob_token_ids.size and (
            int(m.logprob_token_ids.min()) < 0 or int(m.logprob_token_ids.max()) >= vocab):
        return f"has logprob token ids outside [0, {vocab})"
    # a sample is due where the request's tokens are all computed after this step
    c = step.cached
    ends = [(rid, done + n) for rid, done, n in zip(c.req_ids, c.num_computed_tokens.tolist(),
                                                     c.num_scheduled_tokens.tolist())]
    reqs = requests
    due = []
    for rid, end in ends:
        r = reqs.get(rid)
        due.append(None if r is None else end == r.num_tokens)  # None: ended meanwhile, either way
    due += [n.num_computed_tokens + n.num_scheduled_tokens == n.token_ids.shape[0] for n in step.new_reqs]
    # an embedding request is due its vector where others are due a sample, and never samples
    embeds = set(m.embed_req_ids)
    for rid, d, t in zip(ids, due, tok.tolist()):
        r = reqs.get(rid)
        if r is not None and r.pooling is not None:
            if t >= 0 or (d is not None and d != (rid in embeds)):
                return f"has no embedding or a sample for embedding request {rid!r} (due one: {d})"
            embeds.discard(rid)
        elif d is not None and d != (t >= 0):
            return (f"has {'no sample' if d else f'a sample ({t})'} for request {rid!r}, which "
                    f"{'was due one' if d else 'was not due one'}")
    if embeds - {rid for rid, d in zip(ids, due) if d is None}:
        return f"has embeddings for requests that are no embedding requests of the step: {sorted(embeds)[:4]}"
    hidden = cfg.hidden_size
    if m.embeddings is not None and m.embeddings.shape[1] != hidden:
        return f"has embeddings of width {m.embeddings.shape[1]}; the model's hidden size is {hidden}"
    return check_spec_result(step.lookahead(), m, vocab) or grammar_violation(step, m)
