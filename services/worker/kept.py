"""What a worker keeps for a restarted scheduler: the sequences whose KV is still in its cache.

When the scheduler restarts, a worker's KV cache still holds every running sequence's prompt and
tokens so far. Rank 0 of a one-shard group reports them in its next HELLO (`Hello.kept`: token
ids whose KV is computed, and their blocks); the new scheduler puts their full blocks in its
prefix cache (services/scheduler/adoption.py `seed_prefix_cache`), so the requests clients
re-attach find them there and prefill only the rest. Bounded in size (the newest
`MAX_KEPT_SEQS` sequences, each what its blocks hold) and in time (reported in the HELLOs of
`KEPT_TTL_S` after the restart, while nothing has been written over those blocks: the worker
runs no step until the new scheduler has the report).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from zeroserve.common import messages as P

KEPT_TTL_S = 30.0  # a report older than this is dropped (clients re-attach within their timeout_s, 10 s)


class Kept:
    """The snapshot taken when the scheduler restarted, and until when it is reported."""

    def __init__(self) -> None:
        self.seqs: list[P.KeptSeq] = []
        self.until = 0.0

    def take(self, states: Iterable, block_size: int, now: float | None = None) -> None:
        """Snapshot the runner's request states (token_ids, num_computed, block_ids, lora_path):
        the full blocks whose KV is computed, and the adapter it was computed under, newest
        requests last."""
        seqs = []
        for st in states:
            full = min(st.num_computed, len(st.token_ids)) // block_size
            if full and len(st.block_ids) >= full:
                seqs.append(P.KeptSeq(token_ids=np.asarray(st.token_ids[:full * block_size], np.int32),
                                      block_ids=np.asarray(st.block_ids[:full], np.int32),
                                      lora_path=st.lora_path))
        self.seqs = seqs[-P.MAX_KEPT_SEQS:]
        self.until = (time.monotonic() if now is None else now) + KEPT_TTL_S

    def report(self, now: float | None = None) -> list[P.KeptSeq]:
        """What the next HELLO says (nothing once the time limit passed)."""
        if self.seqs and (time.monotonic() if now is None else now) > self.until:
            self.seqs = []
        return self.seqs

    def clear(self) -> None:
        """The scheduler has it (we were welcomed): a later restart takes a new snapshot."""
        self.seqs = []
