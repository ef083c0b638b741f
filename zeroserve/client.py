"""Talk to a running zeroserve cluster: ``AsyncClient`` (asyncio) and ``Client`` (blocking, thread-safe).

    from zeroserve import Client, SamplingParams

    with Client("tcp://127.0.0.1:7000") as c:
        out = c.generate("Hello", SamplingParams(max_tokens=32))        # -> RequestOutput
        for d in c.stream("Hello", {"max_tokens": 32}):                 # -> StreamDelta, one per Output
            print(d.text, end="", flush=True)

    async with AsyncClient() as c:
        outs = await asyncio.gather(*(c.generate(p) for p in prompts))
        async for d in c.stream("Hello"):
            ...

How it works
------------
One DEALER socket (a random identity that survives reconnects) connected to the scheduler's
client ROUTER, and two background tasks on the event loop the client is first used on:

* the receiver decodes every message once and routes it: ``Outputs`` items and ``Error``\\ s by
  ``request_id`` to the live request they belong to (a blocking ``generate`` only appends the
  item; it is assembled once, when the request finishes; a stream gets the item queued and
  turns it into a ``StreamDelta`` when the consumer asks for it), ``Pong`` / ``StatsReply`` /
  ``ModelsReply`` to the futures waiting for them. Items of requests this client no longer
  tracks (aborted, timed out) are dropped.
* the liveness ticker runs only while requests are live: it sends ``Ping`` every second (the
  scheduler aborts the requests of a client silent for 10 s) and fails every live request
  with ``ClusterUnavailable`` once nothing at all came from the scheduler for ``timeout_s``.

Every way a request can end early on the client side (``abort()``, ``request_timeout_s``, the
cluster going silent, leaving a stream with ``break`` / ``aclose()``, cancelling the task that
waits for it, ``close()``) sends ``Abort`` so the scheduler frees its KV blocks at once.

``Client`` runs an ``AsyncClient`` on a private event loop in one background thread; any
number of user threads may call it at the same time. ``close()`` stops that thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import zmq
import zmq.asyncio

from common import protocol as P
from common.errors import ClusterUnavailable, InvalidRequest, RequestTimeout, ZeroserveError
from common.outputs import CompletionOutput, Logprob, RequestOutput
from common.sampling_params import SamplingParams
from common.transport import CURVE_CLIENT_ENV, CURVE_KEYS_ENV, curve_client_keys, make_socket, tcp_addr

__all__ = ["DEFAULT_ADDRESS", "AsyncClient", "AsyncStream", "Client", "StreamDelta", "SyncStream"]

log = logging.getLogger("zeroserve.client")

DEFAULT_ADDRESS = "tcp://127.0.0.1:7000"
PING_INTERVAL_S = 1.0  # the scheduler's client_timeout (10 s) counts on this
_INT32_MAX = 2**31 - 1


# ------------------------------------------------------------------------------------------------
# Public result type for streams
# ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class StreamDelta:
    """What one ``Output`` item of the scheduler adds to completion ``index`` of a request.

    ``text`` and ``token_ids`` are deltas; the last delta of each index has ``finish_reason``
    ("stop", "length" or "abort"). ``logprobs`` (one dict per new token, like
    ``CompletionOutput.logprobs``) is None unless ``SamplingParams.logprobs`` was set.
    ``prompt_token_ids`` / ``num_cached_tokens`` ride on the first delta of the request only.
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# ------------------------------------------------------------------------------------------------
# Validation (client side too: obvious mistakes fail before anything is sent)
# ------------------------------------------------------------------------------------------------


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "extra")
_PARAM_DEFAULTS = SamplingParams().to_dict()
_DEFAULT_PARAMS = SamplingParams()


def _wire_params(sp: SamplingParams) -> dict[str, Any]:
    """``P.encode_params(sp)`` (compact: fields at their default left out) without
    ``dataclasses.asdict``'s deep copies, which cost more than the rest of a submit together."""
    if sp is _DEFAULT_PARAMS:
        return {}
    d = {}
    for name in _PARAM_FIELDS:
        v = getattr(sp, name)
        dv = _PARAM_DEFAULTS[name]
        if v != dv or type(v) is not type(dv):
            d[name] = v
    return d


def _check_params(params: Any) -> SamplingParams:
    if params is None:
        return _DEFAULT_PARAMS  # shared, never handed to the user
    if isinstance(params, SamplingParams):
        params.validate()  # it may have been changed since it was built
        return params
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    raise InvalidRequest(f"params must be a SamplingParams or a dict of its fields, got {type(params).__name__}")


def _check_prompt(prompt: Any) -> tuple[str | None, np.ndarray | None]:
    """-> (text, None) or (None, token ids as int32); the same prompt forms as ``LLM.generate``."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise InvalidRequest(f"a dict prompt's 'prompt' must be text, got {type(prompt).__name__}")
        else:
            raise InvalidRequest("a dict prompt needs 'prompt_token_ids' (a list of token ids) or 'prompt' (text)")
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("the prompt is empty; send some text or token ids")
        return prompt, None
    if not isinstance(prompt, (list, tuple, np.ndarray)):
        raise InvalidRequest(f"a prompt is text, a list of token ids or {{'prompt_token_ids': [...]}}, "
                             f"got {type(prompt).__name__}")
    try:
        arr = np.asarray(prompt)
    except (ValueError, OverflowError):
        arr = np.asarray([], dtype=object)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise InvalidRequest("prompt token ids must be a non-empty flat list of integers")
    if int(arr.min()) < 0 or int(arr.max()) > _INT32_MAX:
        raise InvalidRequest(f"prompt token ids must be in [0, {_INT32_MAX}] (and below the model's vocab size)")
    return None, arr.astype(np.int32)


def _check_timeout(name: str, v: Any, allow_none: bool = True) -> float | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise InvalidRequest(f"{name} must be a positive number of seconds{' or None' if allow_none else ''}, "
                             f"got {v!r}")
    return float(v)


def _logprob_dicts(item: P.Output) -> list[dict[int, Logprob]]:
    """Rebuild vLLM-style logprobs from the raw arrays: column 0 is the sampled token (with its
    rank), columns 1..k the top-k with rank j. A chunk that carries no arrays gets empty dicts,
    so the list stays one entry per token."""
    n = len(item.token_ids)
    if item.logprobs is None:
        return [{} for _ in range(n)]
    ids = item.logprob_token_ids.tolist()
    vals = item.logprobs.tolist()
    ranks = item.ranks.tolist() if item.ranks is not None else [None] * n
    out = []
    for row_ids, row_vals, rank in zip(ids, vals, ranks):
        entry = {row_ids[0]: Logprob(row_vals[0], rank)}
        for j in range(1, len(row_ids)):
            if row_ids[j] not in entry:
                entry[row_ids[j]] = Logprob(row_vals[j], j)
        out.append(entry)
    return out


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
        "n",
        "num_cached",
        "parts",
        "prompt",
        "prompt_ids",
        "queue",
        "remaining",
        "rid",
        "sent_ids",
        "stop",
        "streaming",
        "t0",
        "timer",
        "waiter",
        "want_lp",
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

    def feed(self, item: P.Output) -> bool:
        """Take one Output item; True when every completion has finished."""
        if self.prompt_ids is None and item.prompt_token_ids is not None:
            self.prompt_ids = item.prompt_token_ids
            self.num_cached = item.num_cached_tokens
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
        d = StreamDelta(self.rid, item.index, item.text, item.token_ids.tolist(), item.finish_reason,
                        item.stop_reason, _logprob_dicts(item) if self.want_lp else None)
        if self.first_delta:
            self.first_delta = False
            d.prompt_token_ids = self._prompt_ids()
            d.num_cached_tokens = self.num_cached
        return d

    def _prompt_ids(self) -> list[int]:
        if self.prompt_ids is not None:
            return self.prompt_ids.tolist()
        return self.sent_ids.tolist() if self.sent_ids is not None else []

    def result(self) -> RequestOutput:
        outs = []
        for i, items in enumerate(self.parts):
            if not items:
                toks: list[int] = []
            elif len(items) == 1:
                toks = items[0].token_ids.tolist()
            else:
                toks = np.concatenate([it.token_ids for it in items]).tolist()
            lps = None
            if self.want_lp:
                lps = []
                for it in items:
                    lps.extend(_logprob_dicts(it))
            outs.append(CompletionOutput(i, "".join([it.text for it in items]), toks, self.finish[i], lps,
                                         self.stop[i]))
        return RequestOutput(self.rid, self.prompt, self._prompt_ids(), outs, finished=True,
                             num_cached_tokens=self.num_cached)


def _swallow(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("send failed: %s", fut.exception())


# ------------------------------------------------------------------------------------------------
# AsyncClient
# ------------------------------------------------------------------------------------------------


class AsyncClient:
    """asyncio client for a zeroserve cluster; see the module docstring.

    ``address``: the scheduler's client port (``tcp://H:P`` or a port number).
    ``timeout_s``: how long the scheduler may stay silent before calls fail with
    ``ClusterUnavailable``. ``request_timeout_s``: default limit on one request's total time
    (``RequestTimeout``); None = no limit. A client belongs to the event loop it is first used
    on; create one per loop (or use ``Client`` from threads).
    ``curve_keys``: a CURVE key directory (``zeroserve keys DIR``) when the scheduler uses CURVE;
    None = ``$ZEROSERVE_CURVE_KEYS`` if set, ``False`` = plain even then. ``curve_client_name``:
    whose key to use (``clients/NAME.key_secret``); None = ``$ZEROSERVE_CURVE_CLIENT`` or "client".
    A missing key file raises ``CurveKeyError`` here, naming the file.
    """

    def __init__(self, address: str | int = DEFAULT_ADDRESS, timeout_s: float = 10.0,
                 request_timeout_s: float | None = None, *, curve_keys: str | os.PathLike | bool | None = None,
                 curve_client_name: str | None = None) -> None:
        try:
            self.address = tcp_addr(address)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if curve_keys is None:
            curve_keys = os.environ.get(CURVE_KEYS_ENV) or None
        self.curve = curve_client_keys(curve_keys or None,
                                       curve_client_name or os.environ.get(CURVE_CLIENT_ENV) or None)
        self.timeout_s = _check_timeout("timeout_s", timeout_s, allow_none=False)
        self.request_timeout_s = _check_timeout("request_timeout_s", request_timeout_s)
        self.identity = f"client-{os.urandom(6).hex()}".encode()
        self._ping_s = min(PING_INTERVAL_S, self.timeout_s / 4)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._reqs: dict[str, _Req] = {}
        self._pongs: dict[int, asyncio.Future] = {}
        self._replies: dict[type, collections.deque] = {P.StatsReply: collections.deque(),
                                                        P.ModelsReply: collections.deque()}
        self._nonces = itertools.count(1)
        self._last_rx = 0.0
        self._live_evt: asyncio.Event | None = None
        self._closed = False

    # ---------------------------------------------------------------- lifecycle
    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise ZeroserveError("this client is closed; create a new one")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            ctx = zmq.asyncio.Context()
            try:
                sock = make_socket(ctx, zmq.DEALER, connect=self.address, identity=self.identity,
                                   **(self.curve.socket_kwargs() if self.curve else {}))
            except zmq.ZMQError as e:
                ctx.term()
                raise InvalidRequest(f"cannot connect to {self.address}: {e}; give the scheduler's client address "
                                     "as tcp://HOST:PORT") from None
            self._loop, self._ctx, self._sock = loop, ctx, sock
            self._last_rx = loop.time()
            self._live_evt = asyncio.Event()
            self._tasks = [loop.create_task(self._receiver(), name="zeroserve-client-recv"),
                           loop.create_task(self._ticker(), name="zeroserve-client-liveness")]
        elif loop is not self._loop:
            raise RuntimeError("this AsyncClient belongs to another event loop; create one client per event "
                               "loop (or use zeroserve.Client, which any thread may share)")
        return loop

    async def close(self) -> None:
        """Abort live requests (they raise ZeroserveError), stop the background tasks, close the socket."""
        if self._closed:
            return
        self._closed = True
        if self._loop is None:
            return
        live = list(self._reqs.values())
        for r in live:
            self._end(r, ZeroserveError(f"the client was closed while request {r.rid!r} was running"), abort=True)
        err = "the client was closed while waiting for the scheduler's answer"
        for fut in list(self._pongs.values()) + [f for q in self._replies.values() for f in q]:
            if not fut.done():
                fut.set_exception(ZeroserveError(err))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close(linger=200 if live else 0)  # give the Aborts a moment to leave
        self._ctx.term()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _unavailable(self) -> ClusterUnavailable:
        hint = (f"with CURVE: is client key {self.curve.name!r} in the scheduler's allowed/ folder, and "
                f"{self.curve.server_public_key_file.name} the scheduler's key?" if self.curve else
                "if the scheduler uses CURVE, pass curve_keys= (or set ZEROSERVE_CURVE_KEYS)")
        return ClusterUnavailable(f"no answer from the scheduler at {self.address} for {self.timeout_s:g} s; "
                                  f"is `zeroserve up` running? ({hint})")

    # ---------------------------------------------------------------- sending
    def _send(self, msg: Any) -> None:
        """Queue a message without waiting (the loop thread owns the socket)."""
        self._send_frames(P.encode(msg))

    def _send_frames(self, frames: list) -> None:
        sock = self._sock
        if sock is None or sock.closed:
            return
        try:
            fut = sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as e:
            log.debug("send failed: %s", e)
            return
        if fut.done():
            _swallow(fut)
        else:
            fut.add_done_callback(_swallow)

    # ---------------------------------------------------------------- requests
    def _submit(self, prompt: Any, params: Any, request_id: str | None, request_timeout_s: float | None,
                streaming: bool) -> _Req:
        text, ids = _check_prompt(prompt)
        sp = _check_params(params)
        timeout = _check_timeout("request_timeout_s", request_timeout_s)
        if timeout is None:
            timeout = self.request_timeout_s
        if request_id is None:
            request_id = os.urandom(12).hex()
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id must be a non-empty string, got {request_id!r}")
        loop = self._ensure_started()
        if request_id in self._reqs:
            raise InvalidRequest(f"request id {request_id!r} is already running on this client; use a unique id "
                                 "or leave request_id unset")
        frames = P.encode(P.Submit(request_id=request_id, prompt=text, prompt_token_ids=ids,
                                   params=_wire_params(sp), stream=streaming, timeout_s=timeout))
        r = _Req(request_id, sp, streaming, loop.time(), text, ids, None if streaming else loop.create_future())
        if timeout is not None:
            r.timer = loop.call_later(timeout, self._on_request_timeout, r, timeout)
        if not self._reqs:
            self._live_evt.set()
        self._reqs[request_id] = r
        self._send_frames(frames)
        return r

    def _end(self, r: _Req, error: BaseException | None = None, *, abort: bool = False,
             local_reason: str | None = None) -> None:
        """The request ends here (finished, failed, aborted): forget it, wake whoever waits."""
        if r.ended:
            return
        r.ended = True
        if self._reqs.get(r.rid) is r:
            del self._reqs[r.rid]
        if r.timer is not None:
            r.timer.cancel()
        if abort:
            self._send(P.Abort(request_id=r.rid))
        if local_reason is not None:
            r.end_local(local_reason)
        r.error = error
        r.wake()

    def _cancel_request(self, r: _Req) -> None:
        """The caller gave up on it (break, aclose, cancellation): Abort, no more output."""
        self._end(r, asyncio.CancelledError(), abort=True)

    def _on_request_timeout(self, r: _Req, timeout: float) -> None:
        self._end(r, RequestTimeout(f"request {r.rid!r} did not finish within {timeout:g} s (request_timeout_s); "
                                    "allow more time, lower max_tokens, or check `zeroserve status` for a "
                                    "busy cluster"), abort=True)

    async def generate(self, prompt: Any, params: SamplingParams | dict | None = None, request_id: str | None = None,
                       *, request_timeout_s: float | None = None) -> RequestOutput:
        """Run one request to the end -> RequestOutput (n > 1 completions in index order)."""
        r = self._submit(prompt, params, request_id, request_timeout_s, streaming=False)
        try:
            await r.done
        except asyncio.CancelledError:
            self._cancel_request(r)
            raise
        if r.error is not None:
            raise r.error
        return r.result()

    def stream(self, prompt: Any, params: SamplingParams | dict | None = None, request_id: str | None = None,
               *, request_timeout_s: float | None = None) -> AsyncStream:
        """An async iterator of StreamDelta; the request is sent on the first ``__anext__``.
        Leaving early (break, ``aclose()``, cancellation) aborts the request."""
        _check_prompt(prompt)  # fail fast, before anything is iterated
        params = _check_params(params)
        _check_timeout("request_timeout_s", request_timeout_s)
        return AsyncStream(self, prompt, params, request_id, request_timeout_s)

    async def abort(self, request_id: str) -> None:
        """Abort a running request of this client: a waiting ``generate`` returns what it has so far,
        a stream ends, with finish_reason "abort" for each unfinished completion."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id must be a non-empty string, got {request_id!r}")
        self._ensure_started()
        self._send(P.Abort(request_id=request_id))
        r = self._reqs.get(request_id)
        if r is not None:
            self._end(r, local_reason="abort")

    # ---------------------------------------------------------------- control
    async def health(self) -> dict:
        """Ping the scheduler -> {"ok", "scheduler_id", "protocol_version", "latency_ms", "address"}."""
        loop = self._ensure_started()
        nonce = next(self._nonces)
        fut = loop.create_future()
        self._pongs[nonce] = fut
        t0 = loop.time()
        self._send(P.Ping(nonce=nonce))
        try:
            pong = await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            raise self._unavailable() from None
        finally:
            self._pongs.pop(nonce, None)
        out = {"ok": pong.protocol_version == P.PROTOCOL_VERSION, "scheduler_id": pong.scheduler_id,
               "protocol_version": pong.protocol_version, "latency_ms": round((loop.time() - t0) * 1000.0, 3),
               "address": self.address}
        if not out["ok"]:
            out["error"] = (f"the scheduler speaks protocol version {pong.protocol_version}, this client "
                            f"{P.PROTOCOL_VERSION}; install the same zeroserve release on both sides")
        return out

    async def _ask(self, msg: Any, reply_type: type) -> Any:
        loop = self._ensure_started()
        fut = loop.create_future()
        q = self._replies[reply_type]
        q.append(fut)
        self._send(msg)
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            raise self._unavailable() from None
        finally:
            try:
                q.remove(fut)
            except ValueError:
                pass

    async def stats(self) -> dict:
        """The scheduler's stats (queue, groups, throughput...)."""
        return (await self._ask(P.StatsRequest(), P.StatsReply)).stats

    async def models(self) -> list[dict]:
        """The served models: [{"id", "max_model_len", "groups"}, ...]."""
        return (await self._ask(P.ModelsRequest(), P.ModelsReply)).models

    # ---------------------------------------------------------------- background tasks
    async def _receiver(self) -> None:
        sock, loop, reqs = self._sock, self._loop, self._reqs
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if sock.closed:
                    return
                log.warning("receive failed: %s", e)
                await asyncio.sleep(0.01)
                continue
            self._last_rx = loop.time()
            try:
                msg = P.decode(frames)
            except P.ProtocolError as e:
                log.warning("dropped a bad message from the scheduler: %s", e.reason)
                continue
            try:
                t = type(msg)
                if t is P.Outputs:
                    for item in msg.items:
                        r = reqs.get(item.request_id)
                        if r is not None and r.feed(item):
                            self._end(r)
                elif t is P.Pong:
                    fut = self._pongs.pop(msg.nonce, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif t is P.Error:
                    self._on_error(msg)
                elif t in self._replies:
                    q = self._replies[t]
                    while q:
                        fut = q.popleft()
                        if not fut.done():
                            fut.set_result(msg)
                            break
                else:
                    log.warning("unexpected %s from the scheduler; dropped", t.__name__)
            except Exception:  # a bug here must not stop every request of this client
                log.exception("failed to handle %s", type(msg).__name__)

    def _on_error(self, m: P.Error) -> None:
        if m.request_id is not None:
            r = self._reqs.get(m.request_id)
            if r is not None:
                self._end(r, m.to_exception())
            return
        # not about a request: the answer to a stats/models question that failed
        waiting = [f for q in self._replies.values() for f in q if not f.done()]
        for f in waiting:
            f.set_exception(m.to_exception())
        if not waiting:
            log.warning("the scheduler reported: [%s] %s", m.code, m.message)

    async def _ticker(self) -> None:
        """While requests are live: Ping every interval, fail them all when the scheduler is silent."""
        loop = self._loop
        last_ping = loop.time()
        while True:
            if not self._reqs:
                self._live_evt.clear()
                await self._live_evt.wait()
                last_ping = loop.time()  # the Submit itself tells the scheduler we are alive
            now = loop.time()
            if now - last_ping >= self._ping_s:
                last_ping = now
                self._send(P.Ping(nonce=next(self._nonces)))
            last_rx = self._last_rx
            deadline = math.inf
            dead = []
            for r in self._reqs.values():
                due = max(last_rx, r.t0) + self.timeout_s
                if due <= now:
                    dead.append(r)
                elif due < deadline:
                    deadline = due
            for r in dead:
                self._end(r, self._unavailable(), abort=True)
            await asyncio.sleep(max(0.0, min(last_ping + self._ping_s, deadline) - loop.time()) + 0.001)


class AsyncStream:
    """Async iterator of StreamDelta for one request (from ``AsyncClient.stream``).

    Also an async context manager; ``aclose()`` (or leaving the ``async with``, or dropping the
    iterator after ``break``) aborts the request if it is still running."""

    def __init__(self, client: AsyncClient, prompt: Any, params: SamplingParams, request_id: str | None,
                 request_timeout_s: float | None) -> None:
        self._client = client
        self._args: tuple | None = (prompt, params, request_id, request_timeout_s)
        self._req: _Req | None = None
        self._closed = False

    @property
    def request_id(self) -> str | None:
        """The request id (known once the request was sent, i.e. after the first ``__anext__``)."""
        return self._req.rid if self._req is not None else (self._args[2] if self._args else None)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self._closed:
            raise StopAsyncIteration
        r = self._req
        if r is None:
            prompt, params, rid, timeout = self._args
            self._args = None
            try:
                r = self._req = self._client._submit(prompt, params, rid, timeout, streaming=True)
            except BaseException:
                self._closed = True
                raise
        while True:
            if self._closed:  # aclose() from another task while this one waited
                raise StopAsyncIteration
            if r.queue:
                return r.delta(r.queue.popleft())
            if r.ended:
                self._closed = True
                if r.error is not None and not isinstance(r.error, asyncio.CancelledError):
                    raise r.error
                raise StopAsyncIteration
            fut = r.waiter = self._client._loop.create_future()
            try:
                await fut
            except asyncio.CancelledError:
                self._closed = True
                self._client._cancel_request(r)
                raise
            finally:
                r.waiter = None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        r = self._req
        if r is not None and not r.ended:
            self._client._cancel_request(r)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _abort_soon(self) -> None:
        """Thread-safe, never blocks: abort the request on the client's loop if it still runs."""
        r = self._req
        if self._closed or r is None or r.ended:
            return
        self._closed = True
        loop = self._client._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._client._cancel_request, r)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never raise from a finalizer
            self._abort_soon()


# ------------------------------------------------------------------------------------------------
# Client (blocking): an AsyncClient on a private loop in one background thread
# ------------------------------------------------------------------------------------------------


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            loop.run_until_complete(asyncio.sleep(0))  # start calls handed over just before stop()
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


async def _next_batch(it: AsyncStream) -> list[StreamDelta]:
    """The next delta plus whatever else is already queued (one thread hop for a burst); [] = end."""
    try:
        out = [await it.__anext__()]
    except StopAsyncIteration:
        return []
    r = it._req
    while r.queue and not it._closed:
        out.append(r.delta(r.queue.popleft()))
    return out


class Client:
    """Blocking client with the same API as ``AsyncClient``; safe to share between threads.

    ``stream()`` returns a normal iterator; leaving it early (``break`` and dropping it,
    ``close()``, or a ``with`` block) aborts the request. ``close()`` stops the background thread.
    ``curve_keys`` / ``curve_client_name``: CURVE, as in ``AsyncClient``.
    """

    def __init__(self, address: str | int = DEFAULT_ADDRESS, timeout_s: float = 10.0,
                 request_timeout_s: float | None = None, *, curve_keys: str | os.PathLike | bool | None = None,
                 curve_client_name: str | None = None) -> None:
        self._ac = AsyncClient(address, timeout_s, request_timeout_s, curve_keys=curve_keys,
                               curve_client_name=curve_client_name)
        self._loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=_run_loop, args=(self._loop,), name="zeroserve-client", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return self._ac.address

    @property
    def closed(self) -> bool:
        return self._closed

    def _call(self, coro: Any) -> Any:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("the blocking Client cannot be called from its own event loop thread")
        with self._lock:  # close() cannot slip in between the check and the hand-over
            if self._closed:
                coro.close()
                raise ZeroserveError("this client is closed; create a new one")
            try:
                fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            except RuntimeError:  # the loop is gone (dropped without close())
                coro.close()
                raise ZeroserveError("this client is closed; create a new one") from None
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise ZeroserveError("the client was closed while the call was running") from None
        except BaseException:
            fut.cancel()  # KeyboardInterrupt & co: cancel the task (which aborts its request)
            raise

    def generate(self, prompt: Any, params: SamplingParams | dict | None = None, request_id: str | None = None,
                 *, request_timeout_s: float | None = None) -> RequestOutput:
        return self._call(self._ac.generate(prompt, params, request_id, request_timeout_s=request_timeout_s))

    def stream(self, prompt: Any, params: SamplingParams | dict | None = None, request_id: str | None = None,
               *, request_timeout_s: float | None = None) -> SyncStream:
        return SyncStream(self, self._ac.stream(prompt, params, request_id, request_timeout_s=request_timeout_s))

    def abort(self, request_id: str) -> None:
        self._call(self._ac.abort(request_id))

    def health(self) -> dict:
        return self._call(self._ac.health())

    def stats(self) -> dict:
        return self._call(self._ac.stats())

    def models(self) -> list[dict]:
        return self._call(self._ac.models())

    def close(self) -> None:
        """Abort live requests, close the socket and stop the background thread (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if threading.current_thread() is self._thread:
            raise RuntimeError("the blocking Client cannot be closed from its own event loop thread")
        try:
            asyncio.run_coroutine_threadsafe(self._ac.close(), self._loop).result(timeout=10)
        except (concurrent.futures.TimeoutError, RuntimeError, zmq.ZMQError, ZeroserveError) as e:  # still stop it
            log.warning("closing the client: %s", e)
        try:
            self._loop.call_soon_threadsafe(self._loop.stop)
        except RuntimeError:
            pass
        self._thread.join(timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # forgotten close(): stop the thread without waiting for it
        with contextlib.suppress(Exception):  # never raise from a finalizer
            if not self._closed and not self._loop.is_closed():
                self._closed = True
                loop, ac = self._loop, self._ac

                def shutdown() -> None:
                    loop.create_task(ac.close()).add_done_callback(lambda _: loop.stop())

                loop.call_soon_threadsafe(shutdown)


class SyncStream:
    """Iterator of StreamDelta for one request (from ``Client.stream``). ``close()`` (or a
    ``with`` block, or dropping it after ``break``) aborts the request if it still runs."""

    def __init__(self, client: Client, astream: AsyncStream) -> None:
        self._client = client
        self._astream = astream
        self._buf: collections.deque[StreamDelta] = collections.deque()
        self._done = False

    @property
    def request_id(self) -> str | None:
        return self._astream.request_id

    def __iter__(self) -> Iterator[StreamDelta]:
        return self

    def __next__(self) -> StreamDelta:
        if self._buf:
            return self._buf.popleft()
        if self._done:
            raise StopIteration
        try:
            batch = self._client._call(_next_batch(self._astream))
        except BaseException:
            self._done = True
            raise
        if not batch:
            self._done = True
            raise StopIteration
        self._buf.extend(batch)
        return self._buf.popleft()

    def close(self) -> None:
        self._buf.clear()
        if self._done:
            return
        self._done = True
        if self._client.closed:
            return
        self._client._call(self._astream.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never raise from a finalizer
            if not self._done:
                self._done = True
                self._astream._abort_soon()
