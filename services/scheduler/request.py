"""Per-request state the scheduling policy keeps (one Request per output sequence)."""

from __future__ import annotations

import enum
import time

from zeroserve.common.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, KV dropped; recomputes from its tokens
    FINISHED = "finished"


class Request:
    """One sequence: the prompt plus what it generated so far.

    A request with `n > 1` becomes n Requests (`index` 0..n-1) that share the prompt's blocks.
    """

    __slots__ = (
        "req_id", "client_id", "index", "params", "seed", "priority", "arrival_time",
        "token_ids", "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens",
        "block_ids", "block_hashes", "status", "finish_reason", "stop_reason", "max_len",
        "siblings", "constraint", "num_released", "pooling",
    )

    def __init__(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 max_model_len: int, client_id: str | None = None, index: int = 0, priority: int = 0,
                 arrival_time: float | None = None) -> None:
        self.req_id = req_id
        self.client_id = client_id if client_id is not None else req_id
        self.index = index
        self.params = params
        self.seed = seed
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # total length this sequence may reach (prompt + max_tokens, capped by the model)
        limit = params.max_tokens if params.max_tokens is not None else max_model_len
        self.max_len = min(max_model_len, self.num_prompt_tokens + limit)
        self.siblings: list["Request"] | None = None  # the n sequences of one client request
        # structured outputs: its grammar matcher (services/scheduler/structured.py), which has
        # taken every output token; it travels with the request through preemption and failover
        self.constraint = None
        # sliding-window models: leading blocks given back because no layer reads them again
        # (their ids stay in block_ids, so the worker's block table keeps its positions)
        self.num_released = 0
        # an embedding request ("last" / "mean"): prefill only, it ends with its pooled hidden state
        self.pooling: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def output_slice(self, start: int, stop: int) -> list[int]:
        """Output tokens [start, stop), copying only those (delivery asks every step)."""
        p = self.num_prompt_tokens
        return self.token_ids[p + start:p + stop]

    @property
    def hides_stop_token_text(self) -> bool:
        """It ended on a stop token id whose text stays out of the output (vLLM's rule)."""
        return isinstance(self.stop_reason, int) and not self.params.include_stop_str_in_output

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival_time, self.index)

    def __repr__(self) -> str:
        return f"Request({self.req_id}, {self.status.value}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
