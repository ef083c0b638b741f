"""A draft model for speculative decoding: a smaller model with the target's tokenizer.

It keeps its own paged KV cache with the target's block layout, addressed by the very block
ids the scheduler gave each request (the lookahead slots included), so it needs no blocks of
its own. Per request it remembers how many of the sequence's tokens its cache holds; a
proposal first catches up on the tokens it has not seen (the whole prompt the first time, then
the tokens the last step added), then runs k one-token steps, batched over the requests. Its
tokens come from the worker's sampler with each request's own parameters and (seed, position)
randomness, so a draft close to the target draws the same tokens as the target does.
"""

from __future__ import annotations

import numpy as np
import torch

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.model_config import ModelConfig
from zeroserve.kernels.metadata import AttentionMetadata
from zeroserve.services.worker.model import load_model
from zeroserve.services.worker.sampler import SamplingTensors, sample


class DraftProposer:
    def __init__(self, path: str, runner) -> None:
        cfg = ModelConfig.from_dir(path)
        target = runner.cfg
        if cfg.vocab_size != target.vocab_size:
            raise InvalidRequest(f"speculative_model {path!r} has a vocabulary of {cfg.vocab_size} tokens; the "
                                 f"target's has {target.vocab_size}: a draft model must share the target's tokenizer")
        self.runner = runner
        self.device = runner.device
        self.model = load_model(cfg, self.device, runner.dtype, runner.ops,
                                quantization=getattr(runner.args, "quantization", None))
        shape = (runner.num_blocks, runner.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.kv = [(torch.zeros(shape, dtype=runner.dtype, device=self.device),
                    torch.zeros(shape, dtype=runner.dtype, device=self.device)) for _ in range(self.model.num_layers)]
        self.computed: dict[str, int] = {}  # req_id -> tokens of its sequence in this cache

    def forget(self, live, new=()) -> None:
        for rid in [r for r in self.computed if r not in live]:
            del self.computed[rid]
        for rid in new:  # its blocks are others now: this cache holds nothing of it
            self.computed.pop(rid, None)

    def _forward(self, items: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """One forward over (new tokens, their start position, block ids) per request ->
        logits at each request's last new token [R, V]."""
        bs = self.runner.block_size
        counts = np.fromiter((len(t) for t, _, _ in items), np.int64, len(items))
        starts = np.fromiter((a for _, a, _ in items), np.int64, len(items))
        qsl = np.zeros(len(items) + 1, np.int64)
        np.cumsum(counts, out=qsl[1:])
        positions = np.concatenate([np.arange(a, a + n) for a, n in zip(starts.tolist(), counts.tolist())])
        table = np.zeros((len(items), max(len(b) for _, _, b in items)), np.int32)
        for i, (_, _, b) in enumerate(items):
            table[i, :len(b)] = b
        row = np.repeat(np.arange(len(items)), counts)
        slots = table[row, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = starts + counts
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev), block_tables=torch.from_numpy(table).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()))
        ids = torch.tensor([t for toks, _, _ in items for t in toks], dtype=torch.int64, device=dev)
        hidden = self.model(ids, torch.from_numpy(positions).to(dev), self.kv, meta)
        return self.model.compute_logits(hidden.index_select(0, torch.from_numpy(qsl[1:] - 1).to(dev)))

    def _sample(self, logits: torch.Tensor, states, seqs: list[list[int]]) -> list[int]:
        st = SamplingTensors.from_requests(
            params=[s.params for s in states], seeds=[s.seed for s in states], positions=[len(q) for q in seqs],
            prompt_ids=[q[:s.num_prompt_tokens] for s, q in zip(states, seqs)],
            output_ids=[q[s.num_prompt_tokens:] for s, q in zip(states, seqs)],
            eos_ids=self.runner.eos_token_ids, device=self.device)
        return sample(logits, st).sampled.tolist()

    @torch.inference_mode()
    def propose_batch(self, items: list[tuple[str, list[int], object, int]]) -> list[list[int]]:
        """items: (req_id, tokens, runner state, k) -> up to k draft tokens each."""
        if not items:
            return []
        seqs = [list(toks) for _, toks, _, _ in items]
        states = [s for _, _, s, _ in items]
        # catch up: everything this cache lacks, up to and including the last token
        fwd = []
        for (rid, toks, s, _), q in zip(items, seqs):
            done = min(self.computed.get(rid, 0), len(q) - 1)
            fwd.append((q[done:], done, s.block_ids))
        drafts: list[list[int]] = [[] for _ in items]
        live = list(range(len(items)))
        logits = self._forward(fwd)
        for step in range(max(k for *_, k in items)):
            toks = self._sample(logits, [states[i] for i in live], [seqs[i] for i in live])
            for i, t in zip(live, toks):
                drafts[i].append(t)
                seqs[i].append(t)
            live = [i for i in live if len(drafts[i]) < items[i][3]]
            if not live:
                break
            logits = self._forward([([seqs[i][-1]], len(seqs[i]) - 1, states[i].block_ids) for i in live])
        for (rid, toks, _, _), d in zip(items, drafts):
            self.computed[rid] = len(toks) + len(d) - 1  # the last draft was never fed
        return drafts

    def accepted(self, rid: str, base_len: int, drafted: int, accepted: int) -> None:
        """After verification: this cache holds the sequence up to the accepted drafts."""
        if rid in self.computed:
            self.computed[rid] = min(self.computed[rid], base_len + accepted)
