"""Shared test helpers: tiny model directories (cached per test process) and a small paged KV
cache that builds flat-batch AttentionMetadata the way the model runner does.

    from tests.helpers import cached_model_dir, make_model_dir, PagedKV

    d = cached_model_dir("qwen3")                       # built once per process, reused
    d = make_model_dir(tmp_path, "llama", tie_word_embeddings=True)   # a private copy
    kv = PagedKV(model, num_blocks=32)                   # block ids handed out in reverse order
    ids, pos, meta, last = kv.step([("a", prompt), ("b", [tok])])
    hidden = model(ids, pos, kv.caches, meta); logits = model.compute_logits(hidden[last])
"""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroserve.kernels.metadata import AttentionMetadata

_CACHE_ROOT: Path | None = None


@pytest.fixture(autouse=False, scope="module")
def torch_single_thread():
    """Run a module's tiny-model math on one intra-op thread (restored afterwards).

    Tiny matmuls gain nothing from threads, and on a busy 2-core box OpenMP spin-waiting made
    the same tests ~20x slower. Use it with `pytestmark = pytest.mark.usefixtures("torch_single_thread")`
    after importing it into the test module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_model_dir(path: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0,
                   shards: int = 1, **overrides: Any) -> Path:
    """Write a tiny random HF model dir at `path` (a subfolder named after the arch when `path`
    already exists and is not empty)."""
    from zeroserve.services.tiny_model import make_tiny_model

    path = Path(path)
    if path.exists() and any(path.iterdir()):
        path = path / f"{arch}-{size}-{seed}"
    return make_tiny_model(path, arch=arch, seed=seed, size=size, shards=shards, **overrides)


def cached_model_dir(arch: str = "llama", size: str = "tiny", seed: int = 0, shards: int = 1,
                     **overrides: Any) -> Path:
    """Like make_model_dir, but built once per test process and shared (treat it as read-only)."""
    global _CACHE_ROOT
    if _CACHE_ROOT is None:
        _CACHE_ROOT = Path(tempfile.mkdtemp(prefix="zeroserve-test-models-"))
        atexit.register(shutil.rmtree, _CACHE_ROOT, True)
    key = json.dumps([arch, size, seed, shards, overrides], sort_keys=True, default=str)
    d = _CACHE_ROOT / hashlib.sha1(key.encode()).hexdigest()[:16]
    if not (d / "config.json").is_file():
        from zeroserve.services.tiny_model import make_tiny_model

        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_model(tmp, arch=arch, seed=seed, size=size, shards=shards, **overrides)
        tmp.rename(d)
    return d


def load_our_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   backend: str = "torch", **tp: Any):
    """(ModelConfig, our model) for a model dir."""
    from zeroserve.common.model_config import ModelConfig
    from zeroserve.kernels.dispatch import get_ops
    from zeroserve.services.worker.model import load_model

    cfg = ModelConfig.from_dir(model_dir)
    return cfg, load_model(cfg, device, dtype, get_ops(backend, device), **tp)


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", dtype=dtype)
    return m.eval()


@torch.no_grad()
def hf_logits(hf_model, token_ids: Sequence[int]) -> torch.Tensor:
    """HF logits [len, vocab] fp32 for every position of one sequence (one full causal forward)."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    return hf_model(input_ids=ids).logits[0].float()


class PagedKV:
    """Per-layer paged KV caches + a block allocator + flat-batch metadata, for tests.

    Blocks are handed out from the END of the pool (ids num_blocks-1, num_blocks-2, ...), so a
    request's block table is never contiguous or increasing; `order="random"` shuffles them."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 16, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", order: str = "reversed", seed: int = 0):
        self.block_size = block_size
        self.device = torch.device(device)
        dtype = dtype or next(model.parameters()).dtype
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.caches = [(torch.zeros(shape, dtype=dtype, device=self.device),
                        torch.zeros(shape, dtype=dtype, device=self.device)) for _ in range(model.num_layers)]
        free = list(range(num_blocks))
        if order == "reversed":
            free.reverse()
        elif order == "random":
            g = torch.Generator().manual_seed(seed)
            free = [free[i] for i in torch.randperm(num_blocks, generator=g).tolist()]
        self.free = free  # pop(0) = next block handed out
        self.tables: dict[Any, list[int]] = {}
        self.num_cached: dict[Any, int] = {}
        self.tokens: dict[Any, list[int]] = {}

    def _ensure(self, rid, n_tokens: int) -> None:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.block_size < n_tokens:
            if not self.free:
                raise RuntimeError("PagedKV out of blocks")
            table.append(self.free.pop(0))

    def release(self, rid) -> None:
        self.free.extend(self.tables.pop(rid, []))
        self.num_cached.pop(rid, None)
        self.tokens.pop(rid, None)

    def step(self, items: Sequence[tuple[Any, Sequence[int]]]):
        """items: (request id, new token ids to compute this step), in batch order.

        Returns (input_ids[T], positions[T], meta, last_rows[B]) where last_rows[b] is the row of
        request b's last token (the one whose logits predict the next token)."""
        ids, pos, slots, seq_lens, qsl, last = [], [], [], [], [0], []
        for rid, new in items:
            start = self.num_cached.get(rid, 0)
            n = len(new)
            self._ensure(rid, start + n)
            table = self.tables[rid]
            for i in range(n):
                p = start + i
                ids.append(int(new[i]))
                pos.append(p)
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            self.num_cached[rid] = start + n
            self.tokens.setdefault(rid, []).extend(int(t) for t in new)
            seq_lens.append(start + n)
            qsl.append(qsl[-1] + n)
            last.append(qsl[-1] - 1)
        width = max(len(self.tables[rid]) for rid, _ in items)
        bt = torch.full((len(items), width), -1, dtype=torch.int32)
        for b, (rid, _) in enumerate(items):
            t = self.tables[rid]
            bt[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device
        q_lens = [qsl[i + 1] - qsl[i] for i in range(len(items))]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=bt.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                meta, torch.tensor(last, dtype=torch.int64, device=dev))


@torch.no_grad()
def run_step(model, kv: PagedKV, items: Sequence[tuple[Any, Sequence[int]]], all_rows: bool = False):
    """One forward of our model over a flat batch; returns logits of each request's last token
    ([B, vocab]) or, with all_rows, of every token ([T, vocab])."""
    ids, pos, meta, last = kv.step(items)
    hidden = model(ids, pos, kv.caches, meta)
    return model.compute_logits(hidden if all_rows else hidden[last])


def random_prompt(n: int, vocab: int = 512, seed: int = 0, low: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n,), generator=g).tolist()


# Greedy decoding is only reproducible across batch shapes where the best token wins clearly:
# a different batch (or a recompute after a failover, or a prefix-cache hit) sums fp32 in
# another order, and a near-tie between the top two logits can flip. Tests that compare greedy
# runs made under different batching keep only requests whose every choice has a margin.
TIE_MARGIN = 1e-3


def greedy_margin(completion) -> float:
    """Smallest gap between the best and the second-best logprob along a greedy completion
    (generated with ``logprobs >= 1`` so each step lists at least two candidates)."""
    gaps = []
    for step in completion.logprobs:
        top = sorted((lp.logprob for lp in step.values()), reverse=True)
        gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return min(gaps, default=float("inf"))


def tie_free(model_dir, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], keep: int,
             **engine_args) -> list[tuple[int, Any]]:
    """(index, RequestOutput) of the first ``keep`` prompts whose greedy completions (ignore_eos)
    have no near-tie; the outputs serve as references."""
    from zeroserve import LLM, SamplingParams

    llm = LLM(str(model_dir), **engine_args)
    outs = llm.generate([list(p) for p in prompts],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in max_tokens])
    good = [(i, o) for i, o in enumerate(outs) if greedy_margin(o.outputs[0]) >= TIE_MARGIN]
    assert len(good) >= keep, f"only {len(good)} of {len(prompts)} prompts are free of near-ties; draw more"
    return good[:keep]


def greedy_jobs(model_dir, seed: int = 5, n: int = 24, vocab: int = 512,
                num_kv_blocks: int = 256) -> list[tuple[list[int], dict]]:
    """n greedy jobs (prompt ids, params) for a cluster under fire: runs that batch them
    differently must agree, so none may meet a near-tie."""
    import random

    rng = random.Random(seed)
    draw = [([rng.randrange(3, vocab) for _ in range(rng.randint(1, 120))], rng.randint(8, 24)) for _ in range(n + 8)]
    kept = tie_free(model_dir, [p for p, _ in draw], [m for _, m in draw], n, num_kv_blocks=num_kv_blocks)
    return [(draw[i][0], {"temperature": 0.0, "max_tokens": draw[i][1], "ignore_eos": True}) for i, _ in kept]


async def stream_jobs(address: str, jobs, timeout_s: float = 240.0) -> list[tuple[list[int], str, str | None]]:
    """Stream every job at once through one AsyncClient -> (token ids, text, finish reason) each."""
    import asyncio

    from zeroserve import AsyncClient

    async def one(c, prompt, params):
        toks, text, reason = [], "", None
        async for d in c.stream(prompt, params):
            toks += d.token_ids
            text += d.text
            reason = d.finish_reason or reason
        return toks, text, reason

    async with AsyncClient(address, timeout_s=30.0) as c:
        return await asyncio.wait_for(asyncio.gather(*(one(c, p, sp) for p, sp in jobs)), timeout_s)
