"""What one step tells a worker (SchedulerOutput) and its wire form (protocol.Step).

The policy builds a SchedulerOutput; the in-process engine hands it straight to the model
runner, the cluster scheduler turns it into a `Step` message with `to_message`, and a worker
turns the message back with `from_message`. Per-request state lives on the worker, so a step
carries deltas only (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common import protocol as P
from common.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt + tokens generated before (after a preemption or failover)
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: list[str] = field(default_factory=list)  # the worker drops their state

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def empty(self) -> bool:
        return not self.num_scheduled_tokens


def to_message(seq: int, group: str, so: SchedulerOutput) -> P.Step:
    new = [
        P.NewRequest(
            req_id=n.req_id, token_ids=np.asarray(n.token_ids, np.int32), num_prompt_tokens=n.num_prompt_tokens,
            params=n.params.to_dict(), seed=n.seed, block_ids=np.asarray(n.block_ids, np.int32),
            num_computed_tokens=n.num_computed_tokens, num_scheduled_tokens=so.num_scheduled_tokens[n.req_id])
        for n in so.new_reqs
    ]
    c = so.cached_reqs
    cached = P.CachedRequests.build(
        [x.req_id for x in c], [x.num_computed_tokens for x in c],
        [so.num_scheduled_tokens[x.req_id] for x in c], [x.new_block_ids for x in c])
    return P.Step(seq=seq, group=group, new_reqs=new, cached_reqs=cached, finished_req_ids=list(so.finished_req_ids))


def from_message(step: P.Step) -> SchedulerOutput:
    """Raises InvalidRequest if a new request's params do not validate."""
    so = SchedulerOutput(finished_req_ids=list(step.finished_req_ids))
    for n in step.new_reqs:
        so.new_reqs.append(NewRequestData(
            n.req_id, n.token_ids.tolist(), n.num_prompt_tokens, SamplingParams.from_dict(n.params), n.seed,
            n.block_ids.tolist(), n.num_computed_tokens))
        so.num_scheduled_tokens[n.req_id] = n.num_scheduled_tokens
    c = step.cached_reqs
    for rid, nc, ns, blocks in zip(c.req_ids, c.num_computed_tokens.tolist(), c.num_scheduled_tokens.tolist(),
                                   c.new_block_ids()):
        so.cached_reqs.append(CachedRequestData(rid, blocks.tolist(), nc))
        so.num_scheduled_tokens[rid] = ns
    return so
