"""Admission in the scheduler: a request's checks against its model, seeds and the n-way fan-out.

The prompt forms and checks every entry point shares (the client too) live in
common/prompts.py.
"""

from __future__ import annotations

import random

from zeroserve.common.prompts import MAX_PROMPT_TEXT_BYTES, check_token_ids, split_prompt
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.services.scheduler.request import Request
from zeroserve.services.scheduler.structured import Constraint

# the prompt forms' old home keeps their names (split_prompt, the size cap) for callers
__all__ = ["MAX_PROMPT_TEXT_BYTES", "check_params_for_model", "child_seed", "fan_out", "split_prompt"]


def child_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request: a fixed mix, so n > 1 samples differ but repeat."""
    if index == 0:
        return seed
    x = (seed ^ (index * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def check_params_for_model(params: SamplingParams, vocab_size: int) -> None:
    """What SamplingParams cannot check alone: ids must exist in this model's vocabulary."""
    if params.stop_token_ids:
        check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")


def fan_out(key: str, ids: list[int], params: SamplingParams, rng: random.Random, max_model_len: int,
            grammar: object = None) -> list[Request]:
    """The n sequences of request `key` (ids `key#i`): one seed for the request (the user's, or
    drawn), a derived one per sample, and prompt blocks shared among siblings. `grammar`: the
    compiled structured-outputs constraint (each sequence gets its own matcher of it)."""
    if (grammar is None) != (params.structured_outputs is None):
        raise ValueError("a constrained request needs its compiled grammar (and only it)")
    seed = params.seed if params.seed is not None else rng.getrandbits(63)
    reqs = [Request(f"{key}#{i}", ids, params, child_seed(seed, i), max_model_len, client_id=key, index=i)
            for i in range(params.n)]
    if grammar is not None:
        for r in reqs:
            r.constraint = Constraint(grammar)
    if params.n > 1:
        for r in reqs:
            r.siblings = reqs
    return reqs
