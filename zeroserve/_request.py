"""What the client keeps per request, and the checks it runs before anything is sent."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from zeroserve.common import messages as P
from zeroserve.common.chat import check_messages
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.outputs import Logprob, RequestOutput, completion_from_items, embedding_from_items, item_logprobs
from zeroserve.common.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams, unset_fields

log = logging.getLogger("zeroserve.client")

# ------------------------------------------------------------------------------------------------
# Public result type for streams
# ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class StreamDelta:
    """What one ``Output`` item of the scheduler adds to completion ``index`` of a request.

    ``text`` and ``token_ids`` are deltas; the last delta of each index has ``finish_reason``
    ("stop", "length" or "abort"). ``logprobs`` (one dict per new token, like
    ``CompletionOutput.logprobs``) is None unless ``SamplingParams.logprobs`` was set.
    ``prompt_token_ids`` / ``num_cached_tokens`` / ``first_token_latency`` (seconds from the
    scheduler's receipt of the request to its first token leaving the scheduler) ride on the first
    delta of the request only.
    """

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_token_ids: list[int] | None = None
    num_cached_tokens: int = 0
    first_token_latency: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# ------------------------------------------------------------------------------------------------
# Validation (client side too: obvious mistakes fail before anything is sent)
# ------------------------------------------------------------------------------------------------


_DEFAULT_PARAMS = SamplingParams()


def _check_params(params: Any) -> SamplingParams:
    if params is None:
        return _DEFAULT_PARAMS  # shared, never handed to the user
    if isinstance(params, SamplingParams):
        params.validate()  # it may have been changed since it was built
        return params
    if isinstance(params, dict):
        mt = params.get("min_tokens")
        if "max_tokens" not in params and isinstance(mt, int) and not isinstance(mt, bool) and mt > 16:
            params = {**params, "max_tokens": mt}  # unset: the model's default (or 16) applies, raised to it
        return SamplingParams.from_dict(params)
    raise InvalidRequest(f"params must be a SamplingParams or a dict of its fields, got {type(params).__name__}")


def _model_defaults(params: Any, model_defaults: Any) -> list[str]:
    """The fields the model's generation config may fill: by default those ``params`` leaves
    unset (all for None, those a dict does not name, none for a SamplingParams); True = all of
    them, False = none, or a list of field names."""
    if model_defaults is None:
        return list(unset_fields(params))
    if model_defaults is True or model_defaults is False:
        return list(MODEL_DEFAULT_FIELDS) if model_defaults else []
    if isinstance(model_defaults, (list, tuple)) and all(k in MODEL_DEFAULT_FIELDS for k in model_defaults):
        return list(dict.fromkeys(model_defaults))
    raise InvalidRequest(f"model_defaults must be True, False or a list of {list(MODEL_DEFAULT_FIELDS)}, "
                         f"got {model_defaults!r:.200}")


class Conversation:
    """The prompt form of a chat request: the scheduler applies the model's chat template."""

    __slots__ = ("messages", "tools")

    def __init__(self, messages: Any, tools: list[dict] | None = None) -> None:
        self.messages = [P.ChatMessage(**m) for m in check_messages(messages)]
        self.tools = tools  # checked function definitions (common/tools.py) for the template


def _check_timeout(name: str, v: Any, allow_none: bool = True) -> float | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise InvalidRequest(f"{name} must be a positive number of seconds{' or None' if allow_none else ''}, "
                             f"got {v!r}")
    return float(v)


# ------------------------------------------------------------------------------------------------
# One live request, as the receiver sees it
# ------------------------------------------------------------------------------------------------


class _Req:
    __slots__ = (
        "done",
        "ended",
        "error",
        "fin",
        "finish",
        "first_delta",
        "first_latency",
        "frames",
        "n",
        "nonce0",
        "num_cached",
        "parts",
        "prompt",
        "prompt_ids",
        "queue",
        "remaining",
        "retries",
        "rid",
        "sent_ids",
        "sid",
        "started",
        "stop",
        "streaming",
        "t0",
        "timer",
        "waiter",
        "want_lp",
        "wire",
    )

    def __init__(self, rid: str, sp: SamplingParams, streaming: bool, t0: float, prompt: str | None,
                 sent_ids: np.ndarray | None, done: asyncio.Future | None) -> None:
        self.rid = rid
        self.n = sp.n
        self.want_lp = sp.logprobs is not None
        self.streaming = streaming
        self.t0 = t0
        self.prompt = prompt
        self.sent_ids = sent_ids
        self.prompt_ids: np.ndarray | None = None
        self.num_cached = 0
        self.first_latency: float | None = None
        self.parts: list[list[P.Output]] | None = None if streaming else [[] for _ in range(self.n)]
        self.queue: collections.deque | None = collections.deque() if streaming else None
        self.waiter: asyncio.Future | None = None  # stream consumer waiting for an item
        self.done = done  # generate: resolved (always with None) when the request ends
        self.fin = [False] * self.n
        self.finish: list[str | None] = [None] * self.n
        self.stop: list[int | str | None] = [None] * self.n
        self.remaining = self.n
        self.ended = False
        self.error: BaseException | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.first_delta = True
        # which scheduler holds it (learnt from the first Pong to a Ping sent after the Submit;
        # a Pong from another scheduler means the request was lost with the old one)
        self.wire = rid  # the request id on the wire: rid, or rid~k for the k-th re-submission
        self.frames: list | None = None  # the encoded Submit, kept while it may be re-submitted
        self.nonce0 = 0  # the last Ping nonce issued before the Submit left
        self.sid: str | None = None
        self.retries = 0
        self.started = False  # an Output arrived: no longer safe to re-submit

    def feed(self, item: P.Output) -> bool:
        """Take one Output item; True when every completion has finished."""
        self.started = True
        if self.prompt_ids is None and item.prompt_token_ids is not None:
            self.prompt_ids = item.prompt_token_ids
            self.num_cached = item.num_cached_tokens
            self.first_latency = item.first_token_latency
        i = item.index
        if i >= self.n:
            log.warning("output for completion %d of request %r, which asked for n=%d; dropped", i, self.rid, self.n)
            return False
        if self.streaming:
            self.queue.append(item)
            w = self.waiter
            if w is not None and not w.done():
                w.set_result(None)
        else:
            self.parts[i].append(item)
        if item.finish_reason is not None and not self.fin[i]:
            self.fin[i] = True
            self.finish[i] = item.finish_reason
            self.stop[i] = item.stop_reason
            self.remaining -= 1
            return self.remaining == 0
        return False

    def end_local(self, reason: str) -> None:
        """Finish every completion not finished yet with ``reason`` (a local abort)."""
        for i in range(self.n):
            if not self.fin[i]:
                if self.streaming:
                    self.queue.append(P.Output(request_id=self.rid, index=i, finish_reason=reason))
                self.fin[i] = True
                self.finish[i] = reason
        self.remaining = 0

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def delta(self, item: P.Output) -> StreamDelta:
        d = StreamDelta(self.rid, item.index, item.text, item.token_ids, item.finish_reason,
                        item.stop_reason, item_logprobs(item) if self.want_lp else None)
        if self.first_delta:
            self.first_delta = False
            d.prompt_token_ids = self._prompt_ids()
            d.num_cached_tokens = self.num_cached
            d.first_token_latency = self.first_latency
        return d

    def _prompt_ids(self) -> list[int]:
        if self.prompt_ids is not None:
            return self.prompt_ids.tolist()
        return self.sent_ids.tolist() if self.sent_ids is not None else []

    def result(self) -> RequestOutput:
        outs = [completion_from_items(i, items, self.finish[i], self.stop[i], self.want_lp)
                for i, items in enumerate(self.parts)]
        return RequestOutput(self.rid, self.prompt, self._prompt_ids(), outs, finished=True,
                             num_cached_tokens=self.num_cached, first_token_latency=self.first_latency,
                             embedding=embedding_from_items(self.parts[0]) if self.parts else None)
