"""The batch layout every attention kernel reads: where each token of a flat batch lives in the
paged KV cache. Its own module so that the op modules and the dispatch point both import it
without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where every token of a flat batch lives in the paged KV cache."""

    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset; < 0 = padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache after this step
    query_start_loc: torch.Tensor  # [B + 1] int32, row offsets of each request's queries
    max_query_len: int
    max_seq_len: int
