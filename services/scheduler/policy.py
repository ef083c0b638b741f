"""Continuous batching for one worker group, free of any transport.

Each step spends a token budget: running requests first (decodes, then the next chunk of a
long prefill), then waiting requests in priority/FCFS order. Prompt tokens (prefills, new or
continuing) also share a smaller per-step budget, `max_num_prefill_tokens`: under load a step
that prefills every arrival at once holds back every running decode and every arrival's first
token for its whole length, while a few prompts per step, finished in order, give the first ones
their first token after a short step and keep decodes flowing (TTFT under load). When blocks run out, the most
recently admitted running request is preempted and later recomputed from its tokens (its
full blocks usually come back from the prefix cache). The same class runs inside the
in-process engine and inside the cluster scheduler.

Blocks are registered in the prefix cache when they are scheduled, so a request admitted
later in the same step may already reuse them: this is safe because the model writes every
token's K/V of a layer before that layer attends.

Pipelining (a group of several stages, services/scheduler/groups.py): several steps may be in
flight, each over requests no other in-flight step holds (`in_flight`): a request waits for its
step's result before it is scheduled again, and is never preempted while its step runs (its
blocks are in use). Blocks given back meanwhile (a finish, a preemption) may go to a request in
the next step: every stage computes its steps in order, so the earlier step is done with them
on each stage before the later one writes them. `schedule(parts=k)` takes about 1/k of the
requests it could run, so the group's k free pipeline slots get even micro-batches.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.prompts import check_prompt_length
import numpy as np

from zeroserve.common.messages import CachedRequests, NewRequest, Step, StepResult
from zeroserve.services.scheduler.block_manager import BlockManager
from zeroserve.services.scheduler.request import Request, Status
from zeroserve.services.scheduler.speculative import SpecStats, lookahead_for, result_tokens
from zeroserve.services.scheduler.structured import new_bitmask


class GrammarViolation(InvalidRequest):
    """A worker returned a token the request's grammar does not allow (it ignored the bitmask)."""


@dataclass
class TokenEvent:
    """One generated token accepted for a request (what the engine reports upward)."""

    req: Request
    token_id: int
    logprobs: tuple | None  # (token_ids row, logprobs row, rank) for this token, or None
    finished: bool
    embedding: np.ndarray | None = None  # an embedding request's pooled state (token_id -1, finished)


class _StepBuilder:
    """Collects one step's requests; `build()` makes the Step message (columnar for the running ones)."""

    def __init__(self, finished_req_ids: list[str], vocab_size: int) -> None:
        self.new: list[NewRequest] = []
        self.cached: list[tuple[str, int, int, list[int]]] = []  # req_id, computed, scheduled, new blocks
        self.finished = finished_req_ids
        self.vocab_size = vocab_size
        self.constrained: list[Request] = []  # sample in this step under a grammar
        self.lookahead: dict[str, int] = {}  # speculative decoding: reserved draft slots per request

    def scheduled(self, req: Request) -> None:
        """After a request's tokens are committed: it samples in this step when it is now fully
        computed; a constrained one then needs its bitmask in the step."""
        if req.constraint is not None and req.num_computed_tokens == req.num_tokens:
            self.constrained.append(req)

    def drop(self, req_id: str) -> None:
        """A request preempted in this very step leaves it (the worker may still hold it: finished)."""
        self.cached = [c for c in self.cached if c[0] != req_id]
        self.new = [n for n in self.new if n.req_id != req_id]
        self.constrained = [r for r in self.constrained if r.req_id != req_id]
        self.lookahead.pop(req_id, None)
        self.finished.append(req_id)

    def build(self) -> Step:
        c = self.cached
        cached = CachedRequests.build([x[0] for x in c], [x[1] for x in c], [x[2] for x in c], [x[3] for x in c])
        step = Step(seq=0, new_reqs=self.new, cached=cached, finished_req_ids=self.finished)
        if self.lookahead:
            step.num_lookahead_tokens = np.fromiter((self.lookahead.get(x[0], 0) for x in c), np.int32, len(c))
        if self.constrained:
            mask = new_bitmask(len(self.constrained), self.vocab_size)
            for i, req in enumerate(self.constrained):
                req.constraint.fill(mask, i)
            step.bitmask_req_ids = [r.req_id for r in self.constrained]
            step.token_bitmask = mask
        return step


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: list[int], vocab_size: int = 0,
                 kv_window: int | None = None, num_lookahead_tokens: int = 0,
                 max_num_prefill_tokens: int | None = None) -> None:
        self.bm = block_manager
        # speculative decoding: the group verifies up to this many draft tokens per request and
        # step (its workers' HELLO says so); 0 = off
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec = SpecStats()
        # every layer attends to at most the last kv_window positions (None: some layer reads all)
        self.kv_window = kv_window
        self.vocab_size = vocab_size  # the width of constrained requests' bitmasks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_prefill_tokens = min(max_num_prefill_tokens or max_num_batched_tokens, max_num_batched_tokens)
        # a sequence may never need more blocks than the whole cache holds
        self.max_model_len = min(max_model_len, block_manager.num_blocks * block_manager.block_size)
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._dropped: list[str] = []  # worker-side state to drop at the next step
        self.in_flight: set[str] = set()  # requests of the steps sent and not yet answered
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0  # tokens actually run through the model
        # LoRA: different adapters the running requests may use at once (0 = no limit); at most
        # the workers' slots (--max-loras), so every running request's adapter stays resident
        self.max_loras_per_batch = 0

    # ---- admission --------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        check_prompt_length(req.num_prompt_tokens, self.max_model_len)
        if req.req_id in self.requests:
            raise InvalidRequest(f"request id {req.req_id!r} is already in use")
        req.max_len = min(req.max_len, self.max_model_len)
        self.requests[req.req_id] = req
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        keys = [r.sort_key() for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, req.sort_key()), req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def needs_step(self) -> bool:
        """Work to run, or worker-side state to drop."""
        return bool(self.waiting or self.running or self._dropped)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self, parts: int = 1) -> Step:
        """The next step (seq 0, no group: the caller numbers and addresses it), over requests
        in no step in flight; with `parts` > 1 about 1/parts of those it could run."""
        out = _StepBuilder(self._dropped, self.vocab_size)
        self._dropped = []
        budget = self.max_num_batched_tokens
        prefill = self.max_num_prefill_tokens  # of which prompt tokens (more than one a request)
        preempted = False
        seats = self._share(parts)  # requests this step may take (None: no cap)

        if self.kv_window is not None:
            self._release_outside_window()

        # 1. running requests: decodes and continuing prefills
        i = 0
        while i < len(self.running) and budget > 0 and seats != 0:
            req = self.running[i]
            if req.req_id in self.in_flight:  # its step has not come back: not again until it has
                i += 1
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new > 1:  # a continuing prefill (a decode is one token)
                num_new = min(num_new, prefill)
            if num_new <= 0:  # waiting on a token the worker has not returned yet (or no prefill budget left)
                i += 1
                continue
            while not self.bm.can_allocate(req, num_new):
                victim = self._victim(i)  # the latest admitted not in flight gives way (req at worst)
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                break
            la = self._lookahead(req, num_new, budget)
            new_blocks = self.bm.allocate(req, num_new + la)
            out.cached.append((req.req_id, req.num_computed_tokens, num_new, new_blocks))
            if la:
                out.lookahead[req.req_id] = la
            self._commit(req, num_new)
            out.scheduled(req)
            budget -= num_new + la
            if num_new > 1:
                prefill -= num_new
            if seats is not None:
                seats -= 1
            i += 1

        # 2. waiting requests, in order, while budget, seats and blocks last
        if not preempted:
            j = 0
            while j < len(self.waiting) and min(budget, prefill) > 0 and len(self.running) < self.max_num_seqs \
                    and seats != 0:
                req = self.waiting[j]
                if not self._lora_fits(req):
                    j += 1  # its adapter would be one too many in the batch: later, when one frees
                    continue
                kv_cached = 0  # tokens whose K/V a cache hit brings (the worker writes none of them)
                if req.num_computed_tokens == 0 and not req.block_ids:
                    wait_for_sibling = self._share_from_sibling(req)
                    if wait_for_sibling:
                        j += 1
                        continue
                    # an embedding computes its whole prompt: a mean needs every position's state
                    if not req.block_ids and req.pooling is None:
                        cached = self.bm.lookup(req.token_ids, req.lora_path)
                        if cached:
                            kv_cached = self.bm.take_cached(req, cached)
                num_new = min(req.num_tokens - req.num_computed_tokens, budget, prefill)
                if not self.bm.can_allocate(req, num_new):
                    self.bm.release(req)  # give back cache hits; retried next step
                    req.num_computed_tokens = 0
                    req.num_cached_tokens = 0
                    break
                self.waiting.pop(j)
                self.bm.allocate(req, num_new)
                req.status = Status.RUNNING
                self.running.append(req)
                out.new.append(NewRequest(
                    req_id=req.req_id, token_ids=np.asarray(req.token_ids, np.int32),
                    num_prompt_tokens=req.num_prompt_tokens, params=req.params, seed=req.seed,
                    block_ids=np.asarray(req.block_ids, np.int32), num_computed_tokens=req.num_computed_tokens,
                    num_scheduled_tokens=num_new, lora_path=req.lora_path, pooling=req.pooling,
                    num_cached_kv_tokens=kv_cached))
                self._commit(req, num_new)
                out.scheduled(req)
                budget -= num_new
                prefill -= num_new
                if seats is not None:
                    seats -= 1
        step = out.build()
        self.in_flight.update(step.req_ids())
        return step

    def _share(self, parts: int) -> int | None:
        """Requests a step may take when `parts` steps share what could run now (None: all)."""
        if parts <= 1:
            return None
        free = sum(1 for r in self.running if r.req_id not in self.in_flight)
        n = free + min(len(self.waiting), max(0, self.max_num_seqs - len(self.running)))
        return max(1, -(-n // parts))

    def _victim(self, i: int) -> Request:
        """Take out of `running` the latest admitted request at index >= i that is in no step in
        flight (running[i], the one being scheduled, is not: it is the last resort)."""
        for k in range(len(self.running) - 1, i - 1, -1):
            if self.running[k].req_id not in self.in_flight:
                return self.running.pop(k)
        raise AssertionError("the request being scheduled is in a step in flight")

    def _lora_fits(self, req: Request) -> bool:
        lora = req.params.lora
        if lora is None or not self.max_loras_per_batch:
            return True
        used = {r.params.lora for r in self.running if r.params.lora is not None}
        return lora in used or len(used) < self.max_loras_per_batch

    def _lookahead(self, req: Request, num_new: int, budget: int) -> int:
        """Draft slots for a request that decodes its last token in this step, when its blocks
        can take them without preempting anyone (speculation never costs another request its seat)."""
        if not self.num_lookahead_tokens or num_new != 1 or req.num_computed_tokens + 1 != req.num_tokens:
            return 0
        la = lookahead_for(req, self.num_lookahead_tokens, budget)
        return la if la and self.bm.can_allocate(req, num_new + la) else 0

    def _release_outside_window(self) -> None:
        """Blocks before every layer's window go back to the pool. The next query of a running
        request is at position num_computed_tokens and reads keys > that - kv_window (HF's
        convention), so a block ending at or before that bound is never read again once the
        request's previous step is done (one in flight keeps its blocks until it returns).
        Siblings of n > 1 share prompt blocks and keep theirs."""
        bs, w = self.bm.block_size, self.kv_window
        for req in self.running:
            if req.siblings is None and req.req_id not in self.in_flight:
                self.bm.release_leading(req, max(0, (req.num_computed_tokens - w + 1) // bs))

    def _commit(self, req: Request, num_new: int) -> None:
        req.num_computed_tokens += num_new
        self.num_computed_tokens_total += num_new
        self.bm.commit_full_blocks(req, req.num_computed_tokens)

    def _share_from_sibling(self, req: Request) -> bool:
        """n > 1: later samples reuse sample 0's prompt blocks. True = not ready yet, wait."""
        if req.index == 0 or not req.siblings:
            return False
        first = req.siblings[0]
        if first.status == Status.WAITING or first.status == Status.PREEMPTED:
            return True
        if first.status == Status.RUNNING:
            if first.num_computed_tokens < req.num_prompt_tokens:
                return True
            # share the full blocks strictly before the last prompt token, which this sample
            # computes itself (into a block of its own) to get its own first token
            n_full = (req.num_prompt_tokens - 1) // self.bm.block_size
            if n_full:
                self.bm.share(req, first.block_ids[:n_full], n_full * self.bm.block_size)
                req.num_cached_tokens = req.num_computed_tokens
        return False

    def _preempt(self, req: Request, out: _StepBuilder) -> None:
        self.bm.release(req)
        req.num_computed_tokens = 0
        req.status = Status.PREEMPTED
        self.num_preemptions += 1
        out.drop(req.req_id)  # the worker may hold it from an earlier step (or this one)
        self._enqueue(req)

    # ---- results ----------------------------------------------------------------------------
    def update(self, step: Step, result: StepResult) -> list[TokenEvent]:
        """Accept the worker's sampled tokens for `step` (-1 = no sample for that request this step)."""
        self.returned(step)
        events: list[TokenEvent] = []
        logprobs = None
        if result.logprobs is not None:
            ranks = result.ranks if result.ranks is not None else np.zeros(len(result.req_ids), np.int32)
            logprobs = list(zip(result.logprob_token_ids, result.logprobs, ranks.tolist()))
        for k, (rid, (toks, drafted)) in enumerate(zip(result.req_ids, result_tokens(result))):
            if toks[0] < 0:
                continue
            req = self.requests.get(rid)
            if req is None or req.status != Status.RUNNING:
                continue  # finished or preempted meanwhile: the token is discarded
            self.spec.add(drafted, len(toks) - 1)
            for j, tok in enumerate(toks):
                if j:  # an accepted draft before it: its KV was computed in this step
                    self._commit(req, 1)
                if req.constraint is not None and not req.constraint.accept(tok):
                    raise GrammarViolation(f"token {tok} for request {rid!r} is outside its grammar's bitmask")
                req.token_ids.append(tok)
                finished = self._check_stop(req, tok)
                events.append(TokenEvent(req, tok, logprobs[k] if logprobs is not None else None, finished))
                if finished:
                    self._finish(req)
                    break
        for rid, vec in zip(result.embed_req_ids, result.embeddings if result.embeddings is not None else ()):
            req = self.requests.get(rid)
            if req is None or req.status != Status.RUNNING or req.pooling is None:
                continue  # finished or preempted meanwhile (or no embedding request): dropped
            req.finish_reason = "stop"
            events.append(TokenEvent(req, -1, None, True, embedding=vec))
            self._finish(req)  # no KV kept after the prefill: its blocks go back now
        return events

    def returned(self, step: Step) -> None:
        """`step` is no longer in flight (answered, or given up): its requests may run again."""
        self.in_flight.difference_update(step.req_ids())

    def _check_stop(self, req: Request, tok: int) -> bool:
        p = req.params
        n_out = req.num_output_tokens
        if req.constraint is not None and req.constraint.terminated:  # the grammar ended (on EOS)
            req.finish_reason, req.stop_reason = "stop", None
            return True
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                req.finish_reason, req.stop_reason = "stop", None
                return True
            if p.stop_token_ids and tok in p.stop_token_ids:
                req.finish_reason, req.stop_reason = "stop", tok
                return True
        if req.num_tokens >= req.max_len:
            req.finish_reason = "length"
            return True
        return False

    def finish_request(self, req_id: str, reason: str, stop_reason: int | str | None = None) -> Request | None:
        """End a request from outside (abort, stop string)."""
        req = self.requests.get(req_id)
        if req is None or req.finished:
            return None
        req.finish_reason, req.stop_reason = reason, stop_reason
        self._finish(req)
        return req

    def _finish(self, req: Request) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
            self._dropped.append(req.req_id)
        elif req in self.waiting:  # a preempted one was already dropped on the worker
            self.waiting.remove(req)
        self.bm.release(req)
        req.status = Status.FINISHED
        self.in_flight.discard(req.req_id)
        del self.requests[req.req_id]

    def drain_all(self) -> list[Request]:
        """Take every unfinished request out (their group died); they keep their tokens."""
        reqs = list(self.running) + list(self.waiting)
        for req in reqs:
            req.block_ids = []
            req.block_hashes = []
            req.num_released = 0
            req.num_computed_tokens = 0
            req.num_cached_tokens = 0
            req.status = Status.WAITING
        self.running.clear()
        self.waiting.clear()
        self.requests.clear()
        self._dropped = []
        self.in_flight.clear()
        self.bm.reset()
        return reqs

    def stats(self) -> dict:
        return {
            "waiting": len(self.waiting), "running": len(self.running),
            "kv_blocks_total": self.bm.num_blocks, "kv_blocks_used": self.bm.num_used_blocks,
            "kv_blocks_free": self.bm.num_free_blocks,
            "prefix_cache_hit_tokens": self.bm.hits, "prefix_cache_query_tokens": self.bm.queries,
            "num_preemptions": self.num_preemptions, "computed_tokens": self.num_computed_tokens_total,
            "spec_decode_num_drafts": self.spec.num_drafts,
            "spec_decode_num_draft_tokens": self.spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.spec.num_accepted_tokens,
        }
