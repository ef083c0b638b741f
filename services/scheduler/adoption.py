"""Adoption: a restarted scheduler carries on with the requests its predecessor left open.

Nothing a new scheduler needs is lost with the old one: every client knows what it asked and
what it received. A client re-attaches each open request with `Reattach` (zeroserve/liveness.py
sends it when a Pong names a new scheduler): the original Submit under a fresh request id, the
prompt token ids and seed from the first Output, and per completion the token ids and text
characters it received. The new scheduler admits it as a request whose sequences already hold
those tokens, exactly as a preempted request recomputes: the prompt and the tokens so far are
prefilled, and decoding goes on at the next position. Seeded sampling is a pure function of
(seed, position, logits), so greedy and seeded streams go on with the tokens the old scheduler
would have sent; a grammar matcher takes the received tokens again; the detokenizer gets each
sequence's history and text offset, as after a detokenizer restart (delivery.py), so the text
deltas start where the client's stopped. Nothing is sent twice: the client already has the
prompt ids (no second first-Output) and every token up to its count.

The recompute is cut short where the KV survived: a worker that rejoins after the restart
reports the sequences its cache still holds (`Hello.kept`), and `seed_prefix_cache` puts their
full blocks in the group's prefix cache, where the re-attached requests find them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from zeroserve.common import messages as P
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.log import get_logger
from zeroserve.common.prompts import check_token_ids
from zeroserve.services.scheduler.request import Status

if TYPE_CHECKING:
    from zeroserve.services.scheduler.block_manager import BlockManager
    from zeroserve.services.scheduler.delivery import Live

log = get_logger("scheduler")


def as_submit(m: P.Reattach) -> tuple[P.Submit, dict[int, P.ResumeSeq] | None]:
    """The Submit to admit for a re-attached request, and what each completion already has
    (None: no output had reached the client, so it runs from scratch like any Submit). With
    output, the prompt is the token ids the first Output reported (a text or chat prompt is not
    tokenized again: the ids are what the tokens so far continue) and the seed the one it
    reported, so a request the old scheduler seeded samples alike here."""
    sub = m.submit
    if m.prompt_token_ids is None:
        return sub, None
    params = sub.params
    if m.seed is not None and params.seed is None:
        params = msgspec.structs.replace(params, seed=m.seed)
    sub = msgspec.structs.replace(sub, prompt=None, prompt_token_ids=m.prompt_token_ids, messages=None, tools=None,
                                  params=params)
    return sub, {s.index: s for s in m.seqs}


def resume(live: Live, seqs: dict[int, P.ResumeSeq], vocab_size: int) -> None:
    """Give each freshly fanned-out sequence of `live` what its client already received: its
    tokens (recomputed on the group it is routed to), its delivery counts (the next Output
    starts after them), a grammar matcher advanced past them; a completion that had ended is
    done. Raises InvalidRequest for a state no run of this request can have produced."""
    unknown = set(seqs) - {s.req.index for s in live.seqs}
    if unknown:
        raise InvalidRequest(f"re-attached completions {sorted(unknown)} do not exist for n={len(live.seqs)}")
    for s in live.seqs:
        got = seqs.get(s.req.index)
        if got is None:
            continue
        req = s.req
        toks = got.token_ids.tolist()
        check_token_ids(toks, vocab_size, "re-attached token ids")
        if got.finish_reason is None and req.num_tokens + len(toks) >= req.max_len:
            raise InvalidRequest(f"completion {req.index} re-attached with {len(toks)} tokens, which leave no "
                                 "room under its max_tokens / max_model_len, yet it had not ended")
        if got.finish_reason is None and req.constraint is not None:
            for t in toks:
                if not req.constraint.accept(t):
                    raise InvalidRequest(f"re-attached token {t} of completion {req.index} is outside its grammar")
        req.token_ids.extend(toks)
        s.sent = s.delivered = len(toks)
        s.chars = got.chars
        s.lp = [None] * len(toks)  # rows are indexed by position: the received ones are never sent again
        if got.finish_reason is not None:
            req.status = Status.FINISHED
            req.finish_reason = s.finish_reason = got.finish_reason
            s.done = True
    live.sent_first = True  # the client has the prompt ids and first-token time already


def seed_prefix_cache(bm: BlockManager, kept: list[P.KeptSeq], vocab_size: int) -> int:
    """A group that joins a restarted scheduler with KV still in its cache (`Hello.kept`,
    services/worker/kept.py): its full blocks go into the new block manager's prefix cache, so
    the requests clients re-attach skip recomputing them (their first step looks their tokens
    up there, as any request's does). Only for a group whose blocks hold what the tokens say:
    one shard, every layer attending to all positions (a sliding window frees leading blocks
    the worker still lists), no draft slots past the accepted tokens. Returns the blocks added."""
    n = 0
    bs = bm.block_size
    for k in kept:
        toks, blocks = k.token_ids.tolist(), k.block_ids.tolist()
        if (len(toks) != len(blocks) * bs or any(not 0 <= b < bm.num_blocks for b in blocks)
                or any(not 0 <= t < vocab_size for t in toks)):
            log.warning("a kept sequence that does not fit this group's cache; its blocks are not reused",
                        tokens=len(toks), blocks=len(blocks))
            continue
        n += bm.adopt_cached(toks, blocks, k.lora_path)
    return n
