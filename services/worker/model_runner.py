"""The worker's numerics: per-request state, flat batches, the model and the sampler.

A step names requests by id and carries only what the worker lacks (docs/architecture.md):
new requests in full, running ones as new block ids. The runner appends the tokens it samples
to its own copy of each sequence, so decode steps need no token ids from the scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from zeroserve.common.config import EngineArgs
from zeroserve.common.messages import Step, StepResult
from zeroserve.common.model_config import ModelConfig
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.kernels.metadata import AttentionMetadata
from zeroserve.kernels.dispatch import get_ops, resolve_backend
from zeroserve.services.worker import numerics
from zeroserve.services.worker.dtype import resolve_dtype, resolve_kv_dtype
from zeroserve.services.worker.lora import acquire_slots, make_lora
from zeroserve.services.worker.model import load_model
from zeroserve.services.worker.pooling import Pooler
from zeroserve.services.worker.sampler import SamplingTensors, sample
from zeroserve.services.worker.spec_decode import accepted_length, make_speculator, sample_positions

DEFAULT_CPU_KV_BYTES = 1 << 30


class _ReqState:
    __slots__ = ("token_ids", "num_prompt_tokens", "params", "seed", "block_ids", "num_computed", "lora_slot",
                 "lora_path")

    def __init__(self, token_ids, num_prompt_tokens, params, seed, block_ids, num_computed, lora_slot=-1,
                 lora_path=None):
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = num_prompt_tokens
        self.params: SamplingParams = params
        self.seed = seed
        self.block_ids: list[int] = list(block_ids)
        self.num_computed = num_computed
        self.lora_slot = lora_slot  # its adapter's slot in services/worker/lora.py (-1: base model)
        self.lora_path = lora_path  # its adapter (NewRequest.lora_path), for what a restart keeps (kept.py)


@dataclass(slots=True)
class _Batch:
    """One step as a flat batch: rows are requests in `step.req_ids()` order, tokens laid end to
    end (row i owns tokens qsl[i]:qsl[i + 1])."""

    states: list[_ReqState]
    counts: np.ndarray  # tokens per row this step, drafts included (the verify lowers rejected ones)
    drafts: dict[int, list[int]]  # row -> draft tokens appended for this forward
    seq_lens: np.ndarray  # per row: computed tokens after this step
    qsl: np.ndarray  # query start locations, B + 1
    T: int  # tokens in the step
    pure_decode: bool  # every row one decode token plus its drafts
    row_of_tok: np.ndarray
    positions: np.ndarray
    input_ids: np.ndarray
    table: np.ndarray  # block table, B x max blocks
    slots: np.ndarray  # KV slot per token
    sample_rows: np.ndarray  # rows whose sequence is fully computed after this step

    @property
    def B(self) -> int:
        return len(self.states)


class ModelRunner:
    def __init__(self, args: EngineArgs, model_cfg: ModelConfig, tp_rank: int = 0, tp_size: int = 1,
                 tp_group=None, device: str | None = None, pp_rank: int = 0) -> None:
        self.args = args
        self.cfg = model_cfg
        self.device = torch.device(device or args.device)
        self.pp_size = getattr(args, "pp_size", 1)
        self.dtype = resolve_dtype(args.dtype, self.device, model_cfg)
        self.backend = resolve_backend(args.attention_backend, self.device)
        self.ops = get_ops(self.backend, self.device)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # quantization: None/"auto" | "none" | "int8" | "int4" (services/worker/model/quantize.py)
        self.model = load_model(model_cfg, self.device, self.dtype, self.ops, tp_rank=tp_rank,
                                tp_size=tp_size, tp_group=tp_group,
                                quantization=getattr(args, "quantization", None),
                                expert_parallel=getattr(args, "enable_expert_parallel", False),
                                pp_rank=pp_rank, pp_size=self.pp_size)
        # a pipeline stage's links to its neighbours (services/worker/pipeline.py), set once the
        # group's torch.distributed world exists; None: the whole model is here
        self.link = None
        self.block_size = args.block_size
        self.kv_dtype = resolve_kv_dtype(getattr(args, "kv_cache_dtype", "auto"), self.dtype)
        self.num_blocks = self._kv_capacity()
        shape = (self.num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            for _ in range(self.model.num_layers)
        ]
        self.numeric_mode = ""
        self.matmul_dtype = numerics.configure(self)  # sets numeric_mode: the same on every start
        self.reqs: dict[str, _ReqState] = {}
        self.eos_token_ids = list(model_cfg.eos_token_ids)
        self.vocab_size = model_cfg.vocab_size
        self.num_steps = 0
        self.spec = make_speculator(args, self)  # None: no speculative decoding
        self.lora = make_lora(args, self)  # None: no LoRA adapters
        self.pooler = Pooler()  # embedding requests (services/worker/pooling.py)

    @property
    def num_lookahead_tokens(self) -> int:
        """Draft tokens this runner verifies per request per step (HELLO tells the scheduler)."""
        return self.spec.k if self.spec is not None else 0

    # ---- capacity ---------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        m = self.model
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * torch.finfo(self.kv_dtype).bits // 8

    def param_bytes(self) -> int:
        return self.model.weight_bytes()  # float parameters + packed (quantized) weights

    def _kv_capacity(self) -> int:
        a = self.args
        if a.num_kv_blocks is not None:
            return a.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * a.gpu_memory_utilization) - (total - free) - (1 << 30)  # 1 GiB for activations
        else:
            budget = a.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        blocks = budget // per_block
        if blocks < 1:
            raise MemoryError(
                f"no room for the KV cache: one block needs {per_block} bytes, the budget is {budget}; "
                "raise kv_cache_memory_bytes / gpu_memory_utilization or give num_kv_blocks")
        return int(blocks)

    # ---- one step ---------------------------------------------------------------------------
    def check_step(self, step: Step) -> str | None:
        """Why this step cannot run here (None: it can), checked before any state changes: token
        ids outside the vocabulary (the embedding would index out of range), block ids outside
        the KV cache, cached requests this worker does not hold."""
        v, nb = self.vocab_size, self.num_blocks
        for n in step.new_reqs:
            t = n.token_ids
            if t.size and (int(t.min()) < 0 or int(t.max()) >= v):
                return f"request {n.req_id!r} has token ids outside the vocabulary [0, {v})"
            b = n.block_ids
            if b.size and (int(b.min()) < 0 or int(b.max()) >= nb):
                return f"request {n.req_id!r} has block ids outside the KV cache [0, {nb})"
        c = step.cached
        b = c.new_block_ids
        if b.size and (int(b.min()) < 0 or int(b.max()) >= nb):
            return f"cached requests have block ids outside the KV cache [0, {nb})"
        dropped = set(step.finished_req_ids)
        for rid in c.req_ids:
            if rid not in self.reqs or rid in dropped:
                return f"step names request {rid!r}, which this worker does not hold"
        if step.token_bitmask is not None:
            width = (v + 31) // 32
            if step.token_bitmask.shape[1] != width:
                return f"token_bitmask rows have {step.token_bitmask.shape[1]} words; this vocabulary needs {width}"
            in_step = set(step.req_ids())
            missing = [r for r in step.bitmask_req_ids if r not in in_step]
            if missing or len(set(step.bitmask_req_ids)) != len(step.bitmask_req_ids):
                return f"token_bitmask names requests not in the step (or twice): {missing[:4]}"
        return None

    def apply_state(self, step: Step) -> None:
        for rid in step.finished_req_ids:
            st = self.reqs.pop(rid, None)
            if st is not None and st.lora_slot >= 0:
                self.lora.release(st.lora_slot)
        slots = acquire_slots(self.lora, step.new_reqs)
        for n, slot in zip(step.new_reqs, slots):
            old = self.reqs.get(n.req_id)  # sent again in full (a resync): its old slot's pin goes
            if old is not None and old.lora_slot >= 0:
                self.lora.release(old.lora_slot)
            self.reqs[n.req_id] = _ReqState(n.token_ids.tolist(), n.num_prompt_tokens, n.params, n.seed,
                                            n.block_ids.tolist(), n.num_computed_tokens, slot, n.lora_path)
        c = step.cached
        for rid, computed, blocks in zip(c.req_ids, c.num_computed_tokens.tolist(), c.blocks_per_request()):
            st = self.reqs.get(rid)
            if st is None:
                raise ValueError(f"step names request {rid!r}, which this worker does not hold")
            st.block_ids.extend(blocks.tolist())
            st.num_computed = computed
        self.pooler.apply(step)

    def _grammar_rows(self, step: Step, sampled_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sample rows the step's bitmask rows belong to, and the bitmask, on the device."""
        pos = {rid: k for k, rid in enumerate(sampled_ids)}
        try:
            rows = [pos[rid] for rid in step.bitmask_req_ids]
        except KeyError as e:
            raise ValueError(f"step has a bitmask for request {e.args[0]!r}, which samples no token in it") from None
        return (torch.tensor(rows, dtype=torch.int64, device=self.device),
                torch.tensor(step.token_bitmask, device=self.device))  # a copy: the wire's buffer is read-only

    @torch.inference_mode()
    def execute(self, step: Step) -> StepResult:
        """Run one step; the result has one entry per request in `step.req_ids()` order.

        The steps, in order: the scheduler's state deltas (apply_state), the flat inputs with
        this step's drafts (_prepare_inputs), the forward (_forward), the embedding requests'
        pooling where they would sample (Pooler.pool), sampling with grammar rows and the
        speculative verify (_sample), the bookkeeping (_advance). A pipeline stage before the
        last (services/worker/pipeline.py) passes its layers' output on in _forward and, instead
        of pooling and sampling, takes the last stage's tokens (_follow)."""
        t0 = time.perf_counter()
        if self.link is not None and self.link.owed:  # a pipelined stage: tokens owed to requests it names
            self.link.settle([*step.cached.req_ids, *(n.req_id for n in step.new_reqs), *step.finished_req_ids])
        self.apply_state(step)
        req_ids = step.req_ids()
        if not req_ids:
            return StepResult(seq=step.seq)
        b = self._prepare_inputs(step, req_ids)
        hidden = self._forward(b)
        out = StepResult(seq=step.seq, req_ids=req_ids, sampled_token_ids=np.full(b.B, -1, np.int32),
                         num_tokens=b.T)
        if hidden is None:  # an earlier pipeline stage: the last one pools and samples
            self._follow(b, out)
        else:
            if self.pooler.pooling:  # embedding requests pool their hidden states instead of sampling
                b.sample_rows = self.pooler.pool(out, req_ids, hidden, b.qsl, b.sample_rows)
            if len(b.sample_rows):
                self._sample(step, b, hidden, out)
        self._advance(b, out, t0)
        return out

    def _prepare_inputs(self, step: Step, req_ids: list[str]) -> _Batch:
        """The step as one flat batch: per-row token counts (with drafts), positions, token ids,
        block tables, slot mapping and the rows that sample."""
        states = [self.reqs[r] for r in req_ids]
        B = len(states)
        bs = self.block_size
        counts = np.concatenate([step.cached.num_scheduled_tokens.astype(np.int64),
                                 np.fromiter((n.num_scheduled_tokens for n in step.new_reqs), np.int64,
                                             len(step.new_reqs))])
        # speculative decoding: drafts are appended to their requests' tokens for this forward
        drafts = self._propose(step, req_ids, states, counts) if self.spec is not None else {}
        for i, d in drafts.items():
            counts[i] += len(d)
        starts = np.fromiter((s.num_computed for s in states), np.int64, B)
        seq_lens = starts + counts
        qsl = np.zeros(B + 1, np.int64)
        np.cumsum(counts, out=qsl[1:])
        T = int(qsl[-1])
        # every row one decode token plus its drafts (no prefill in the step)
        pure_decode = T == B + sum(len(d) for d in drafts.values())
        # flat positions and token ids
        row_of_tok = np.repeat(np.arange(B), counts)
        if self.lora is not None:  # each token's adapter slot, for the layers' LoRA deltas
            self.lora.set_batch(np.fromiter((s.lora_slot for s in states), np.int32, B)[row_of_tok])
        positions = np.arange(T, dtype=np.int64) - np.repeat(qsl[:-1] - starts, counts)
        input_ids = np.fromiter(
            (t for s, a, n in zip(states, starts.tolist(), counts.tolist()) for t in s.token_ids[a:a + n]),
            np.int64, T)
        # block tables and slot mapping
        max_blocks = max(len(s.block_ids) for s in states)
        table = np.zeros((B, max_blocks), np.int32)
        nblocks = np.empty(B, np.int64)
        for i, s in enumerate(states):
            table[i, :len(s.block_ids)] = s.block_ids
            nblocks[i] = len(s.block_ids)
        # the attention kernels read the cache by these ids without bounds checks
        if table.size and (int(table.min()) < 0 or int(table.max()) >= self.num_blocks):
            raise ValueError(f"block id outside the KV cache (0..{self.num_blocks - 1}) in step")
        if (seq_lens > nblocks * bs).any():
            raise ValueError("a request's tokens exceed its blocks in step")
        slots = table[row_of_tok, positions // bs].astype(np.int64) * bs + positions % bs
        nc = len(step.cached.req_ids)  # new requests' rows follow the cached ones
        for i, n in enumerate(step.new_reqs):
            if n.num_cached_kv_tokens > n.num_computed_tokens:  # computed for its logits, K/V cached already
                a = int(qsl[nc + i])
                rows = slice(a, a + min(n.num_cached_kv_tokens - n.num_computed_tokens, int(counts[nc + i])))
                slots[rows] = -1  # a slot < 0 is not written: the block is shared, its content stays
        # which requests produce a token: their sequence is fully computed after this step
        num_tokens = np.fromiter((len(s.token_ids) for s in states), np.int64, B)
        sample_rows = np.nonzero(seq_lens == num_tokens)[0]
        return _Batch(states, counts, drafts, seq_lens, qsl, T, pure_decode, row_of_tok, positions, input_ids,
                      table, slots, sample_rows)

    def _forward(self, b: _Batch) -> torch.Tensor | None:
        """The model over the flat batch: final hidden states, one row per token. A pipeline
        stage after the first starts from the previous stage's output; one before the last passes
        its layers' output on and returns None."""
        dev = self.device
        m_table, m_lens, m_qsl, m_qlen = b.table, b.seq_lens, b.qsl, int(b.counts.max())
        if b.drafts and b.pure_decode:
            # a decode step with drafts: every token becomes a one-token query with its causal
            # length (the layer writes all K/V before it attends), so the verify runs the decode
            # path (on CPU the compiled step) at batch T instead of the prefill path
            m_table, m_lens, m_qsl, m_qlen = b.table[b.row_of_tok], b.positions + 1, np.arange(b.T + 1), 1
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(b.slots).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(np.ascontiguousarray(m_table)).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(m_lens.astype(np.int32)).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(m_qsl.astype(np.int32)).to(dev, non_blocking=True),
            max_query_len=m_qlen,
            max_seq_len=int(b.seq_lens.max()),
        )
        input_ids = torch.from_numpy(b.input_ids).to(dev, non_blocking=True)
        positions = torch.from_numpy(b.positions).to(dev, non_blocking=True)
        if self.link is None:
            return self.model(input_ids, positions, self.kv_caches, meta)
        m = self.model
        inter = None
        if not m.stage.first:
            inter = self.link.recv_hidden(b.T, self.cfg.hidden_size, self.dtype, m.carries_residual)
        hidden = m(input_ids, positions, self.kv_caches, meta, intermediate=inter)
        if m.stage.last:
            return hidden
        self.link.send_hidden(*hidden)
        return None

    def _sample(self, step: Step, b: _Batch, hidden: torch.Tensor, out: StepResult) -> None:
        """Sample the rows that produce a token (and every draft position), verify the drafts,
        append the new tokens to the requests and pack tokens and logprobs into `out`."""
        dev = self.device
        states, drafts = b.states, b.drafts
        flat, owner, offs = sample_positions(b.sample_rows, b.qsl, drafts)
        idx = torch.from_numpy(flat).to(dev)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        ss = [states[i] for i in owner.tolist()]
        # a draft row j samples position base + j after the drafts before it (base: the
        # length without drafts), with penalties over exactly those tokens
        ends = [len(s.token_ids) - len(drafts.get(i, ())) + j for s, i, j in zip(ss, owner.tolist(), offs.tolist())]
        st = SamplingTensors.from_requests(
            params=[s.params for s in ss],
            seeds=[s.seed for s in ss],
            positions=ends,
            prompt_ids=[s.token_ids[:s.num_prompt_tokens] for s in ss],
            output_ids=[s.token_ids[s.num_prompt_tokens:e] for s, e in zip(ss, ends)],
            eos_ids=self.eos_token_ids,
            device=dev,
        )
        if step.token_bitmask is not None:
            st.bitmask_rows, st.bitmask = self._grammar_rows(step, [out.req_ids[i] for i in owner.tolist()])
        res = sample(logits, st)
        toks = res.sampled.to("cpu", torch.int32).numpy()
        sample_rows = b.sample_rows
        if drafts:
            toks, sample_rows = self._verify(out, states, out.req_ids, drafts, owner, toks, b.counts)
        else:
            for s, t in zip(ss, toks.tolist()):
                s.token_ids.append(t)
        if self.link is not None:  # the last pipeline stage: the earlier ones follow its samples
            self.link.send_tokens(toks)
        out.sampled_token_ids[sample_rows] = toks
        if res.logprobs is not None:
            B, k = b.B, res.logprobs.shape[1]
            out.logprob_token_ids = np.zeros((B, k), np.int32)
            out.logprobs = np.zeros((B, k), np.float32)
            out.ranks = np.zeros(B, np.int32)
            first = np.flatnonzero(offs == 0)  # a request's own row (one per request with logprobs)
            out.logprob_token_ids[sample_rows] = res.logprob_token_ids[first].to("cpu", torch.int32).numpy()
            out.logprobs[sample_rows] = res.logprobs[first].float().cpu().numpy()
            out.ranks[sample_rows] = res.ranks[first].to("cpu", torch.int32).numpy()

    def _follow(self, b: _Batch, out: StepResult) -> None:
        """A pipeline stage before the last: the tokens the last stage sampled (embedding
        requests pool there and sample none), appended to this stage's copy of each request, now
        or, pipelined, once they arrive (StageLink.follow); its result carries none (the last
        stage's answers)."""
        b.sample_rows = rows = self.pooler.sampling_rows(out.req_ids, b.sample_rows)
        if not len(rows):
            return
        self.link.follow(out.req_ids, [b.states[i] for i in rows.tolist()])
        if not self.link.pipelined:  # taken now: the in-process engine reads them as its result
            out.sampled_token_ids[rows] = [b.states[i].token_ids[-1] for i in rows.tolist()]

    def _advance(self, b: _Batch, out: StepResult, t0: float) -> None:
        """Count the step's tokens as computed (the verify has taken rejected drafts off) and
        time it; a pure decode step's time feeds the speculator's cost model."""
        for s, n in zip(b.states, b.counts.tolist()):
            s.num_computed += n
        self.num_steps += 1
        out.step_time_s = time.perf_counter() - t0
        if self.spec is not None and b.pure_decode and len(b.sample_rows) == b.B:
            self.spec.timed(b.B, bool(b.drafts), out.step_time_s)  # a pure decode step

    # ---- speculative decoding (services/worker/spec_decode.py) --------------------------------
    def _propose(self, step: Step, req_ids: list[str], states: list[_ReqState], counts: np.ndarray) -> dict:
        """Drafts per batch row for the decoding requests that have lookahead slots, appended to
        their tokens (verification takes the rejected ones off again)."""
        self.spec.forget(self.reqs, [n.req_id for n in step.new_reqs])
        reserved = step.lookahead()
        if not reserved:
            return {}
        constrained = set(step.bitmask_req_ids)
        items, rows = [], []
        for i, rid in enumerate(req_ids[:len(step.cached.req_ids)]):
            la = reserved.get(rid, 0)
            s = states[i]
            # only a request that decodes its last token now, without logprobs or a grammar
            if not la or counts[i] != 1 or s.num_computed + 1 != len(s.token_ids) or s.params.logprobs is not None \
                    or rid in constrained:
                continue
            # never past the request's blocks, whatever the step claims
            k = min(self.spec.budget(rid, la), len(s.block_ids) * self.block_size - len(s.token_ids))
            if k > 0:
                items.append((rid, s.token_ids, s, k))
                rows.append(i)
        pure = bool((counts == 1).all())
        if self.spec.costly and not self.spec.worth_it(len(states), pure, {it[0]: it[3] for it in items}):
            return {}  # a draft model's proposal costs forwards: decide before making it
        proposed = {}
        for i, (rid, _, s, k), d in zip(rows, items, self.spec.propose(items)):
            d = [int(t) for t in d[:k] if 0 <= int(t) < self.vocab_size]
            if d:
                proposed[i] = d
        if not self.spec.costly and not self.spec.worth_it(len(states), pure,
                                                           {req_ids[i]: len(d) for i, d in proposed.items()}):
            return {}
        for i, d in proposed.items():
            states[i].token_ids.extend(d)
        return proposed

    def _verify(self, out: StepResult, states, req_ids, drafts: dict, owner: np.ndarray, toks: np.ndarray,
                counts: np.ndarray):
        """Accept each request's drafts up to the first disagreement with its own samples; the
        requests' tokens, computed counts and the result's speculative fields follow. Returns
        the first new token per sampling request and those requests' rows."""
        B = len(states)
        per: dict[int, list[int]] = {}
        for i, t in zip(owner.tolist(), toks.tolist()):
            per.setdefault(i, []).append(t)
        rows = np.fromiter(per, np.int64, len(per))
        firsts = np.empty(len(rows), np.int32)
        num_spec = np.zeros(B, np.int32)
        num_draft = np.zeros(B, np.int32)
        extra: list[int] = []
        for r, (i, samples) in enumerate(per.items()):
            s, d = states[i], drafts.get(i, [])
            base = len(s.token_ids) - len(d)
            a = accepted_length(samples, d)
            new = samples[:a + 1]
            del s.token_ids[base:]
            s.token_ids.extend(new)
            firsts[r] = new[0]
            if d:
                counts[i] -= len(d) - a  # only the accepted drafts' K/V count as computed
                num_spec[i], num_draft[i] = a, len(d)
                extra.extend(new[1:])
                self.spec.verified(req_ids[i], base, len(d), a)
        out.spec_token_ids = np.asarray(extra, np.int32)
        out.num_spec_tokens, out.num_draft_tokens = num_spec, num_draft
        return firsts, rows
