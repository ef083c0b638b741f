"""KV block accounting for one worker group: ref-counted blocks and a prefix cache.

The prefix cache keys every full block by (hash of the previous block's key, its tokens):
a lookup compares the tokens themselves, so a hash collision can never serve wrong KV.
Free blocks that hold cached content stay findable until they are reused, least recently
freed first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict

from services.scheduler.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks  # cache key of a block's content
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cache: dict[tuple, int] = {}  # key -> block id
        self.hits = 0  # prompt tokens served from the cache, for stats and tests
        self.queries = 0

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        return max(0, _cdiv(req.num_computed_tokens + num_new_tokens, self.block_size) - len(req.block_ids))

    # ---- prefix cache ---------------------------------------------------------------------
    def _chain_keys(self, token_ids: list[int], num_full: int, prev_hash: int = 0, start: int = 0):
        bs = self.block_size
        for i in range(start, num_full):
            key = (prev_hash, tuple(token_ids[i * bs:(i + 1) * bs]))
            yield key
            prev_hash = hash(key)

    def lookup(self, token_ids: list[int]) -> list[int]:
        """Block ids caching the longest full-block prefix of `token_ids`, leaving at least
        one token to compute (the last one's logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for key in self._chain_keys(token_ids, (len(token_ids) - 1) // self.block_size):
            block = self.cache.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Prefix-cache hit length for routing decisions (no side effects)."""
        return len(self.lookup(token_ids)) * self.block_size

    def take_cached(self, req: Request, blocks: list[int]) -> None:
        """Give `req` (which holds no blocks yet) the cached prefix `blocks`."""
        assert not req.block_ids
        for b in blocks:
            self._incref(b)
        req.block_ids = list(blocks)
        req.num_computed_tokens = len(blocks) * self.block_size
        req.num_cached_tokens = req.num_computed_tokens
        self.queries += req.num_prompt_tokens
        self.hits += req.num_computed_tokens
        if self.enable_prefix_caching:
            prev = 0
            req.block_hashes = []
            for key in self._chain_keys(req.token_ids, len(blocks)):
                prev = hash(key)
                req.block_hashes.append(prev)

    def share(self, req: Request, blocks: list[int], num_tokens: int) -> None:
        """Copy-free sharing of a sibling's computed prefix (n > 1)."""
        assert not req.block_ids
        for b in blocks:
            self._incref(b)
        req.block_ids = list(blocks)
        req.num_computed_tokens = num_tokens
        req.block_hashes = []
        if self.enable_prefix_caching:
            for key in self._chain_keys(req.token_ids, num_tokens // self.block_size):
                req.block_hashes.append(hash(key))

    def commit_full_blocks(self, req: Request, num_computed: int) -> None:
        """Register the blocks that `num_computed` tokens have filled, so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed, req.num_tokens) // self.block_size
        start = len(req.block_hashes)
        if num_full <= start:
            return
        prev = req.block_hashes[-1] if start else 0
        for i, key in enumerate(self._chain_keys(req.token_ids, num_full, prev, start), start):
            block = req.block_ids[i]
            if key not in self.cache and self.block_key[block] is None:
                self.cache[key] = block
                self.block_key[block] = key
            req.block_hashes.append(hash(key))

    # ---- allocation -----------------------------------------------------------------------
    def _incref(self, block: int) -> None:
        if self.ref_cnt[block] == 0:
            self.free.pop(block, None)
        self.ref_cnt[block] += 1

    def _pop_free(self) -> int:
        block, _ = self.free.popitem(last=False)  # least recently freed
        key = self.block_key[block]
        if key is not None:  # evict its cached content
            if self.cache.get(key) == block:
                del self.cache[key]
            self.block_key[block] = None
        self.ref_cnt[block] = 1
        return block

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(req, num_new_tokens) <= len(self.free)

    def allocate(self, req: Request, num_new_tokens: int) -> list[int]:
        """Add the blocks `req` needs for `num_new_tokens` more tokens; returns the new ids."""
        need = self.blocks_needed(req, num_new_tokens)
        if need > len(self.free):
            raise RuntimeError("allocate() without can_allocate()")
        new = [self._pop_free() for _ in range(need)]
        req.block_ids.extend(new)
        return new

    def release(self, req: Request) -> None:
        """Drop `req`'s references; tail blocks go first to the LRU end (evicted first)."""
        for b in reversed(req.block_ids[req.num_released:]):
            self._decref(b)
        req.block_ids = []
        req.block_hashes = []
        req.num_released = 0

    def release_leading(self, req: Request, num_blocks: int) -> int:
        """Give back `req`'s first `num_blocks` blocks, which no layer will read again (every
        layer slides past them); their ids stay in `req.block_ids` for the worker's positional
        block table, their content stays in the prefix cache until reused. -> blocks freed."""
        start = req.num_released
        for b in req.block_ids[start:num_blocks]:
            self._decref(b)
        req.num_released = max(start, min(num_blocks, len(req.block_ids)))
        return req.num_released - start

    def _decref(self, block: int) -> None:
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self.free[block] = None

    def reset(self) -> None:
        """Forget everything (the group's workers lost their KV)."""
        self.__init__(self.num_blocks, self.block_size, self.enable_prefix_caching)
