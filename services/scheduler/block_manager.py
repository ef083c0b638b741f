"""KV block accounting for one worker group: ref-counted blocks and a prefix cache.

The prefix cache keys every full block by (hash of the previous block's key, its tokens):
a lookup compares the tokens themselves, so a hash collision can never serve wrong KV. The
first block's "previous key" is the request's LoRA adapter (`cache_root`): the same tokens
under another adapter have other K/V, so they never share blocks. An adapter is known by its
directory (two names for one directory share, a name reloaded from another directory does not).
Free blocks that hold cached content stay findable until they are reused, least recently
freed first (LRU).

Memory follows use, not capacity: a worker may announce millions of blocks, so blocks never
handed out are one range (`_fresh`..`num_blocks`), and reference counts, cache keys and the
LRU hold only blocks that were allocated at some point. Fresh blocks go out before any freed
one (as if every block sat at the LRU's front in id order), which keeps cached content longest.
"""

from __future__ import annotations

from collections import OrderedDict

from zeroserve.services.scheduler.request import Request


def cache_root(lora_path: str | None) -> int:
    """The chain's first link: 0 for the base model, else the hash of the adapter's directory."""
    return 0 if lora_path is None else hash(("lora", lora_path))


def _root(req: Request) -> int:
    return cache_root(req.lora_path)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._fresh = 0  # blocks [_fresh, num_blocks) were never handed out
        self._refs: dict[int, int] = {}  # block -> references, for blocks that have any
        self.block_key: dict[int, tuple] = {}  # block -> cache key of its content (cached blocks only)
        self.free: OrderedDict[int, None] = OrderedDict()  # freed blocks, least recently freed first
        self.cache: dict[tuple, int] = {}  # key -> block id
        self.hits = 0  # prompt tokens served from the cache, for stats and tests
        self.queries = 0

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + self.num_blocks - self._fresh

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def ref_cnt(self) -> list[int]:
        """Every block's reference count (a copy, O(num_blocks): for tests and debugging)."""
        return [self._refs.get(b, 0) for b in range(self.num_blocks)]

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

    def lookup(self, token_ids: list[int], lora_path: str | None = None) -> list[int]:
        """Block ids caching the longest full-block prefix of `token_ids` (under the adapter at `lora_path`).
        Every full block counts, the last one too: where the whole sequence is cached, its last
        token is computed again for its logits and its K/V, already in the shared block, is not
        written (take_cached; NewRequest.num_cached_kv_tokens), so a repeated prompt costs one
        token, not a block."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for key in self._chain_keys(token_ids, len(token_ids) // self.block_size, cache_root(lora_path)):
            block = self.cache.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_cached_prefix_tokens(self, token_ids: list[int], lora_path: str | None = None) -> int:
        """Prefix-cache hit length for routing decisions (no side effects)."""
        return min(len(self.lookup(token_ids, lora_path)) * self.block_size, max(len(token_ids) - 1, 0))

    def take_cached(self, req: Request, blocks: list[int]) -> int:
        """Give `req` (which holds no blocks yet) the cached prefix `blocks`; it computes from the
        blocks' end, or from its last token where they hold every token (the logits are needed).
        -> how many tokens' K/V the blocks hold (the worker writes none of those again)."""
        assert not req.block_ids
        for b in blocks:
            self._incref(b)
        req.block_ids = list(blocks)
        req.num_computed_tokens = min(len(blocks) * self.block_size, req.num_tokens - 1)
        req.num_cached_tokens = req.num_computed_tokens
        self.queries += req.num_prompt_tokens
        self.hits += req.num_computed_tokens
        if self.enable_prefix_caching:
            prev = 0
            req.block_hashes = []
            for key in self._chain_keys(req.token_ids, len(blocks), _root(req)):
                prev = hash(key)
                req.block_hashes.append(prev)
        return len(blocks) * self.block_size

    def share(self, req: Request, blocks: list[int], num_tokens: int) -> None:
        """Copy-free sharing of a sibling's computed prefix (n > 1)."""
        assert not req.block_ids
        for b in blocks:
            self._incref(b)
        req.block_ids = list(blocks)
        req.num_computed_tokens = num_tokens
        req.block_hashes = []
        if self.enable_prefix_caching:
            for key in self._chain_keys(req.token_ids, num_tokens // self.block_size, _root(req)):
                req.block_hashes.append(hash(key))

    def commit_full_blocks(self, req: Request, num_computed: int) -> None:
        """Register the blocks that `num_computed` tokens have filled, so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed, req.num_tokens) // self.block_size
        start = len(req.block_hashes)
        if num_full <= start:
            return
        prev = req.block_hashes[-1] if start else _root(req)
        for i, key in enumerate(self._chain_keys(req.token_ids, num_full, prev, start), start):
            block = req.block_ids[i]
            if key not in self.cache and block not in self.block_key:
                self.cache[key] = block
                self.block_key[block] = key
            req.block_hashes.append(hash(key))

    def adopt_cached(self, token_ids: list[int], blocks: list[int], lora_path: str | None = None) -> int:
        """Blocks a worker's cache still holds for `token_ids` (full blocks, in order, computed
        under the adapter at `lora_path`: they join its chain, as lookup reads it) from before
        this block manager existed (a restarted scheduler, adoption.py): free, findable in the
        prefix cache until reused, and handed out after every block that holds nothing. Returns
        how many were added; a block already taken for other content ends the chain."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for key, b in zip(self._chain_keys(token_ids, len(blocks), cache_root(lora_path)), blocks):
            if key in self.cache:  # a prefix two sequences share: reported by each
                continue
            if b in self._refs or b in self.block_key:
                break
            while self._fresh <= b:  # never-used blocks before it go first, as fresh ones would
                if self._fresh != b:
                    self.free[self._fresh] = None
                    self.free.move_to_end(self._fresh, last=False)
                self._fresh += 1
            self.free[b] = None
            self.free.move_to_end(b)  # evicted last
            self.cache[key] = b
            self.block_key[b] = key
            n += 1
        return n

    # ---- allocation -----------------------------------------------------------------------
    def _incref(self, block: int) -> None:
        n = self._refs.get(block, 0)
        if n == 0:
            self.free.pop(block, None)
        self._refs[block] = n + 1

    def _pop_free(self) -> int:
        if self._fresh < self.num_blocks:
            block = self._fresh
            self._fresh += 1
        else:
            block, _ = self.free.popitem(last=False)  # least recently freed
            key = self.block_key.pop(block, None)
            if key is not None and self.cache.get(key) == block:  # evict its cached content
                del self.cache[key]
        self._refs[block] = 1
        return block

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(req, num_new_tokens) <= self.num_free_blocks

    def allocate(self, req: Request, num_new_tokens: int) -> list[int]:
        """Add the blocks `req` needs for `num_new_tokens` more tokens; returns the new ids."""
        need = self.blocks_needed(req, num_new_tokens)
        if need > self.num_free_blocks:
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
        n = self._refs[block] - 1
        if n == 0:
            del self._refs[block]
            self.free[block] = None
        else:
            self._refs[block] = n

    def reset(self) -> None:
        """Forget everything (the group's workers lost their KV)."""
        self.__init__(self.num_blocks, self.block_size, self.enable_prefix_caching)
