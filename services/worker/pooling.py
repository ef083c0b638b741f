"""Embedding requests in a worker: the pooled final-normed hidden state of a prompt, returned
instead of a sampled token once the prompt is computed (StepResult.embeddings).

A long prompt is computed in chunks over several steps, so mean pooling keeps a running fp32
sum per request; a request the step re-sends in full (after a preemption or a failover, it
recomputes from position 0) starts its sum again. The scheduler never serves an embedding's
prompt from the prefix cache, so every position passes through here.
"""

from __future__ import annotations

import numpy as np
import torch

from zeroserve.common.messages import Step, StepResult


class Pooler:
    def __init__(self) -> None:
        self.pooling: dict[str, str] = {}  # embedding request -> "last" | "mean"
        self.sums: dict[str, torch.Tensor] = {}  # mean: the sum of its positions' states so far
        self.counts: dict[str, int] = {}

    def apply(self, step: Step) -> None:
        """The step's request changes (after the runner applied them to its own state)."""
        for rid in step.finished_req_ids:
            self._drop(rid)
        for n in step.new_reqs:
            self._drop(n.req_id)
            if n.pooling is not None:
                self.pooling[n.req_id] = n.pooling

    def _drop(self, rid: str) -> None:
        self.pooling.pop(rid, None)
        self.sums.pop(rid, None)
        self.counts.pop(rid, None)

    def pool(self, out: StepResult, req_ids: list[str], hidden: torch.Tensor, qsl: np.ndarray,
             sample_rows: np.ndarray) -> np.ndarray:
        """Fold this step's hidden rows [T, H] into the embedding requests' pools; those whose prompt
        is now computed (they are among `sample_rows`) get their vector into `out`. Returns the
        rows that still sample a token."""
        done = set(sample_rows.tolist())
        ids, vecs = [], []
        for i, rid in enumerate(req_ids):
            kind = self.pooling.get(rid)
            if kind is None:
                continue
            rows = hidden[int(qsl[i]):int(qsl[i + 1])]
            if kind == "mean":
                s = rows.float().sum(0)
                self.sums[rid] = self.sums[rid] + s if rid in self.sums else s
                self.counts[rid] = self.counts.get(rid, 0) + rows.shape[0]
            if i in done:
                vec = rows[-1].float() if kind == "last" else self.sums[rid] / self.counts[rid]
                ids.append(rid)
                vecs.append(vec.cpu().numpy())
        if not ids:
            return sample_rows
        out.embed_req_ids = ids
        out.embeddings = np.stack(vecs).astype(np.float32)
        return self.sampling_rows(req_ids, sample_rows)

    def sampling_rows(self, req_ids: list[str], sample_rows: np.ndarray) -> np.ndarray:
        """The rows of `sample_rows` that sample a token: not an embedding request's. (A pipeline
        stage before the last pools nothing; it asks this to know which tokens the last stage sends.)"""
        if not self.pooling:
            return sample_rows
        return np.asarray([r for r in sample_rows.tolist() if req_ids[r] not in self.pooling], np.int64)
