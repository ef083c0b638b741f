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
* the liveness ticker (``zeroserve/liveness.py``) runs only while requests are live: it sends
  ``Ping`` every second (the scheduler aborts the requests of a client silent for 10 s) and
  fails every live request with ``ClusterUnavailable`` once nothing at all came from the
  scheduler for ``timeout_s``.
* every ``Pong`` names the scheduler (``scheduler_id``, new at each start; also in
  ``zeroserve/liveness.py``). A request belongs to the scheduler that answers the first Ping
  sent after its Submit; a Pong from another one means the scheduler restarted: the client
  re-attaches the request to the new one (the original Submit and what it received so far),
  which recomputes it and streams on from the next token. The caller's stream pauses for the
  restart and goes on with the same tokens (greedy and seeded alike). A request that received
  more than ``reattach_max_tokens`` tokens (or any, with ``reattach=False``) fails with
  ``ClusterUnavailable("the scheduler restarted; ...")`` instead, or, with ``retries=N``, is
  submitted again when it had no output yet. A scheduler silent for ``timeout_s`` (none came
  back) fails the requests as before.

Every way a request can end early on the client side (``abort()``, ``request_timeout_s``, the
cluster going silent, leaving a stream with ``break`` / ``aclose()``, cancelling the task that
waits for it, ``close()``) sends ``Abort`` so the scheduler frees its KV blocks at once.

``Client`` runs an ``AsyncClient`` on a private event loop in one background thread; any
number of user threads may call it at the same time. ``close()`` stops that thread.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import weakref
from typing import Any, Self

import msgspec
import zmq
import zmq.asyncio

from zeroserve.common import messages as P
from zeroserve.common.codec import PROTOCOL_VERSION, ProtocolError, decode, encode
from zeroserve.common.curve import CURVE_CLIENT_ENV, CURVE_KEYS_ENV, curve_client_keys
from zeroserve.common.errors import (
    ClusterUnavailable,
    InvalidRequest,
    RequestTimeout,
    ZeroserveError,
)
from zeroserve.common.embeddings import finish_embedding, request_pooling
from zeroserve.common.outputs import EmbeddingOutput, RequestOutput
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.common.tools import attach_calls, check_tools, constrained_params
from zeroserve.common.failover import Fence, split_addresses
from zeroserve.common.transport import make_socket, tcp_addr
from zeroserve.common.prompts import split_prompt
from zeroserve._request import (
    Conversation,
    StreamDelta,
    _check_params,
    _check_timeout,
    _model_defaults,
    _Req,
    _with_lora,
)
from zeroserve.liveness import LivenessMixin
from zeroserve.streams import AsyncStream

__all__ = ["DEFAULT_ADDRESS", "AsyncClient", "AsyncStream", "StreamDelta"]

log = logging.getLogger("zeroserve.client")

DEFAULT_ADDRESS = "tcp://127.0.0.1:7000"
PING_INTERVAL_S = 1.0  # the scheduler's client_timeout (10 s) counts on this
# tokens a request keeps to re-attach to a restarted scheduler (4 bytes each: 1 MiB a request)
DEFAULT_REATTACH_MAX_TOKENS = 1 << 18


def _swallow(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("send failed: %s", fut.exception())


# ------------------------------------------------------------------------------------------------
# AsyncClient
# ------------------------------------------------------------------------------------------------


class _Checked:
    """A prompt that `stream()` has split and checked already (and its params), for `_submit`."""

    __slots__ = ("split",)

    def __init__(self, split: tuple) -> None:
        self.split = split


def _release(sock: zmq.asyncio.Socket, ctx: zmq.asyncio.Context, linger: int = 0, mon=None) -> None:
    """Close the client's socket (and its monitor) and end its context, never waiting on the event
    loop (it may be closed already) nor on unsent messages beyond `linger` ms."""
    if mon is not None:
        try:
            sock.disable_monitor()
        except Exception:  # noqa: BLE001 - closed already
            pass
        zmq.Socket.close(mon, linger=0)
    try:
        sock.close(linger=linger)
    except Exception:  # noqa: BLE001 (its loop is gone: close the socket underneath it)
        zmq.Socket.close(sock, linger=linger)
    ctx.term()


class AsyncClient(LivenessMixin):
    """asyncio client for a zeroserve cluster; see the module docstring.

    ``address``: the scheduler's client port (``tcp://H:P`` or a port number); with a hot standby
    both schedulers', comma-separated (``"tcp://a:7000,tcp://b:7004"``: zeroserve/liveness.py).
    ``timeout_s``: how long the scheduler may stay silent before calls fail with
    ``ClusterUnavailable``. ``request_timeout_s``: default limit on one request's total time
    (``RequestTimeout``); None = no limit. A client belongs to the event loop it is first used
    on; create one per loop (or use ``Client`` from threads).
    ``curve_keys``: a CURVE key directory (``zeroserve keys DIR``) when the scheduler uses CURVE;
    None = ``$ZEROSERVE_CURVE_KEYS`` if set, ``False`` = plain even then. ``curve_client_name``:
    whose client key to use (``clients/NAME.key_secret``; the scheduler admits only client keys on
    the client port); None = ``$ZEROSERVE_CURVE_CLIENT`` or "client".
    A missing key file raises ``CurveKeyError`` here, naming the file.
    ``retries``: with ``reattach=False``, how many times a request the scheduler lost in a restart
    is submitted again to the new one, as long as none of its output had arrived (0: it fails
    with ClusterUnavailable).
    ``reattach``: re-attach open requests to a restarted scheduler (default); each request keeps
    the token ids it received for that, up to ``reattach_max_tokens`` (past it, 4 bytes a token,
    a restart fails it with ClusterUnavailable). How long a restart may take: ``timeout_s``.
    """

    def __init__(self, address: str | int = DEFAULT_ADDRESS, timeout_s: float = 10.0,
                 request_timeout_s: float | None = None, *, curve_keys: str | os.PathLike | bool | None = None,
                 curve_client_name: str | None = None, retries: int = 0, reattach: bool = True,
                 reattach_max_tokens: int = DEFAULT_REATTACH_MAX_TOKENS) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
            raise InvalidRequest(f"retries must be an integer in [0, 100], got {retries!r}")
        if (isinstance(reattach_max_tokens, bool) or not isinstance(reattach_max_tokens, int)
                or reattach_max_tokens < 0):
            raise InvalidRequest(f"reattach_max_tokens must be an integer >= 0, got {reattach_max_tokens!r}")
        self.retries = retries
        self.reattach = bool(reattach)
        self.reattach_max_tokens = reattach_max_tokens
        try:  # several: a hot standby's (common/failover.py, zeroserve/liveness.py)
            self.addresses = [tcp_addr(a) for a in (split_addresses(address) if isinstance(address, str)
                                                    else [address])]
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        self.address, self._addr_i, self._multi = self.addresses[0], 0, len(self.addresses) > 1
        self._fence = Fence()
        self._seek_since: float | None = None  # looking for the active scheduler since (several addresses)
        self._standby_since: float | None = None
        self._seeker: asyncio.Task | None = None
        self._mon = None
        if curve_keys is None:
            curve_keys = os.environ.get(CURVE_KEYS_ENV) or None
        self.curve = curve_client_keys(curve_keys or None,
                                       curve_client_name or os.environ.get(CURVE_CLIENT_ENV) or None, role="client")
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
                                                        P.ModelsReply: collections.deque(),
                                                        P.MetricsReply: collections.deque(),
                                                        P.LoRAReply: collections.deque()}
        self._nonces = itertools.count(1)
        self._nonce = 0  # the last Ping nonce issued
        self._scheduler_id: str | None = None  # from the last Pong that named one
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
            # several schedulers: a dropped connection moves us to the next at once (_watch)
            self._mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) if self._multi else None
            # a client nobody closed must still release its socket when it is collected or the
            # interpreter exits: pyzmq's Context.__del__ would term() with the socket open and
            # block the process forever (a second asyncio.run in a script or notebook)
            self._finalizer = weakref.finalize(self, _release, sock, ctx, 0, self._mon)
            self._last_rx = loop.time()
            self._live_evt = asyncio.Event()
            self._tasks = [loop.create_task(self._receiver(), name="zeroserve-client-recv"),
                           loop.create_task(self._ticker(), name="zeroserve-client-liveness")]
            if self._multi:  # a dropped connection moves us to the next scheduler at once
                self._tasks.append(loop.create_task(self._watch(), name="zeroserve-client-monitor"))
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
        self._seek_since = None
        tasks = self._tasks + ([self._seeker] if self._seeker is not None else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._finalizer.detach()
        _release(self._sock, self._ctx, 200 if live else 0, self._mon)  # give the Aborts a moment to leave

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _unavailable(self) -> ClusterUnavailable:
        hint = (f"with CURVE: is client key {self.curve.name!r} in the scheduler's allowed/clients/ folder, and "
                f"{self.curve.server_public_key_file.name} the scheduler's key?" if self.curve else
                "if the scheduler uses CURVE, pass curve_keys= (or set ZEROSERVE_CURVE_KEYS)")
        return ClusterUnavailable(f"no answer from the scheduler at {self.address} for {self.timeout_s:g} s; "
                                  f"is `zeroserve up` running? ({hint})")

    # ---------------------------------------------------------------- sending
    def _send(self, msg: Any) -> None:
        """Queue a message without waiting (the loop thread owns the socket)."""
        self._send_frames(encode(msg))

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
                streaming: bool, model_defaults: list[str], pooling: str | None = None) -> _Req:
        msgs = prompt.messages if isinstance(prompt, Conversation) else None
        tools = prompt.tools if isinstance(prompt, Conversation) else None
        if isinstance(prompt, _Checked):  # stream() checked both already
            (text, ids), sp = prompt.split, params
        else:
            text, ids = (None, None) if msgs is not None else split_prompt(prompt)
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
        frames = encode(P.Submit(request_id=request_id, prompt=text, prompt_token_ids=ids, params=sp,
                                 stream=streaming, timeout_s=timeout, messages=msgs, model_defaults=model_defaults,
                                 tools=tools, **({} if pooling is None else {"kind": "embed", "pooling": pooling})))
        r = _Req(request_id, sp, streaming, loop.time(), text, ids, None if streaming else loop.create_future())
        r.nonce0, r.retries = self._nonce, self.retries
        if self.reattach:
            r.keep_left = self.reattach_max_tokens
        else:
            r.kept = None
        if self.retries or self.reattach:
            r.frames = frames
        if timeout is not None:
            r.timer = loop.call_later(timeout, self._on_request_timeout, r, timeout)
        if not self._reqs:
            self._live_evt.set()
        self._reqs[request_id] = r
        self._send_frames(frames)
        if self._scheduler_id is None:  # learn who holds it now, not a ping interval later
            self._send(self._ping())
        return r

    def _end(self, r: _Req, error: BaseException | None = None, *, abort: bool = False,
             local_reason: str | None = None) -> None:
        """The request ends here (finished, failed, aborted): forget it, wake whoever waits."""
        if r.ended:
            return
        r.ended = True
        r.frames = None
        if self._reqs.get(r.wire) is r:
            del self._reqs[r.wire]
        if r.timer is not None:
            r.timer.cancel()
        if abort:
            self._send(P.Abort(request_id=r.wire))
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
                       *, request_timeout_s: float | None = None,
                       model_defaults: bool | list[str] | None = None, lora: str | None = None) -> RequestOutput:
        """Run one request to the end -> RequestOutput (n > 1 completions in index order).

        The model's generation config (``generation_config.json``; ``--generation-config``)
        fills the sampling fields ``params`` leaves unset, as in vLLM: all of them for None,
        those a dict does not name; a SamplingParams runs as given. ``model_defaults`` overrides
        that choice (True, False, or a list of field names). ``lora``: a served LoRA adapter's name
        (sets ``params.lora``; the same as ``model`` = the adapter's name)."""
        params = _with_lora(params, lora)
        defaults = _model_defaults(params, model_defaults)
        r = self._submit(prompt, params, request_id, request_timeout_s, streaming=False, model_defaults=defaults)
        try:
            await r.done
        except asyncio.CancelledError:
            self._cancel_request(r)
            raise
        if r.error is not None:
            raise r.error
        return r.result()

    async def embed(self, prompts: Any, model: str | None = None, *, pooling: str | None = None,
                    normalize: bool = True, dimensions: int | None = None,
                    request_timeout_s: float | None = None) -> list[EmbeddingOutput]:
        """The embedding of each prompt (a text or token ids, or a list of them), computed by the
        cluster as a prefill-only request: the model's final hidden states pooled (``pooling``
        "last" or "mean"; default the model's: the scheduler's --pooling), L2-normalised unless
        ``normalize`` is false, after a truncation to ``dimensions`` when given."""
        pooling = request_pooling(pooling)
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        reqs: list[_Req] = []
        try:
            for p in prompts:
                reqs.append(self._submit(p, {"model": model} if model else None, None, request_timeout_s,
                                         streaming=False, model_defaults=[], pooling=pooling))
            await asyncio.gather(*(r.done for r in reqs))
        except BaseException:  # a bad prompt or a cancellation: none of the batch runs on
            for r in reqs:
                self._cancel_request(r)
            raise
        outs = []
        for r in reqs:
            if r.error is not None:
                raise r.error
            o = r.result()
            if o.embedding is None:
                raise ZeroserveError(f"request {r.rid!r} ended without an embedding ({r.finish[0]})")
            outs.append(EmbeddingOutput(r.rid, o.prompt_token_ids, finish_embedding(o.embedding, dimensions,
                                                                                     normalize).tolist()))
        return outs

    def stream(self, prompt: Any, params: SamplingParams | dict | None = None, request_id: str | None = None,
               *, request_timeout_s: float | None = None,
               model_defaults: bool | list[str] | None = None, lora: str | None = None) -> AsyncStream:
        """An async iterator of StreamDelta; the request is sent on the first ``__anext__``.
        Leaving early (break, ``aclose()``, cancellation) aborts the request. ``params`` and
        ``model_defaults`` and ``lora`` as in ``generate``."""
        if not isinstance(prompt, Conversation):  # fail fast, before anything is iterated
            prompt = _Checked(split_prompt(prompt))
        params = _with_lora(params, lora)
        defaults = _model_defaults(params, model_defaults)
        params = _check_params(params)
        _check_timeout("request_timeout_s", request_timeout_s)
        return AsyncStream(self, prompt, params, request_id, request_timeout_s, defaults)

    async def chat(self, messages: Any, params: SamplingParams | dict | None = None, request_id: str | None = None,
                   *, request_timeout_s: float | None = None, model_defaults: bool | list[str] | None = None,
                   tools: list[dict] | None = None, tool_choice: str | dict | None = None,
                   parallel_tool_calls: bool | None = None, tool_parser: str | None = None,
                   lora: str | None = None) -> RequestOutput:
        """``generate`` for a conversation ([{"role": "user", "content": "..."}, ...]): the cluster
        applies the model's chat template with the generation prompt.

        ``tools`` (OpenAI function definitions) and ``tool_choice`` ("auto", "none", "required",
        {"type": "function", "function": {"name": ...}}) as in OpenAI's API: each completion's
        ``tool_calls`` and ``content`` hold what the model called. "required" and a named
        function are enforced by a grammar; "auto" parses what the model wrote, in ``tool_parser``'s
        format (default: the one the scheduler recognised in the chat template)."""
        spec = check_tools(tools, tool_choice, parallel_tool_calls)
        params = _with_lora(params, lora)
        defaults = _model_defaults(params, model_defaults)  # of the caller's params, before the constraint
        out = await self.generate(Conversation(messages, spec.tools if spec else None), constrained_params(params, spec),
                                  request_id, request_timeout_s=request_timeout_s, model_defaults=defaults)
        if spec is not None:
            if tool_parser is None and spec.choice == "auto":
                model = (params.get("model") if isinstance(params, dict) else getattr(params, "model", None))
                cards = await self.models()
                card = next((m for m in cards if m["id"] == model), cards[0] if cards else {})
                tool_parser = card.get("tool_call_parser") or None
            attach_calls(out.outputs, spec, tool_parser)
        return out

    def stream_chat(self, messages: Any, params: SamplingParams | dict | None = None, request_id: str | None = None,
                    *, request_timeout_s: float | None = None, model_defaults: bool | list[str] | None = None,
                    tools: list[dict] | None = None, tool_choice: str | dict | None = None,
                    parallel_tool_calls: bool | None = None, lora: str | None = None) -> AsyncStream:
        """``stream`` for a conversation. With ``tools``, the template shows them and "required"
        or a named function constrains the output; the deltas are the model's raw text (the
        gateway turns them into OpenAI's streamed tool_calls: common/tool_parsers.py)."""
        spec = check_tools(tools, tool_choice, parallel_tool_calls)
        params = _with_lora(params, lora)
        defaults = _model_defaults(params, model_defaults)
        return self.stream(Conversation(messages, spec.tools if spec else None), constrained_params(params, spec),
                           request_id, request_timeout_s=request_timeout_s, model_defaults=defaults)

    async def abort(self, request_id: str) -> None:
        """Abort a running request of this client: a waiting ``generate`` returns what it has so far,
        a stream ends, with finish_reason "abort" for each unfinished completion."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id must be a non-empty string, got {request_id!r}")
        self._ensure_started()
        r = self._reqs.get(request_id) or next((x for x in self._reqs.values() if x.rid == request_id), None)
        self._send(P.Abort(request_id=r.wire if r is not None else request_id))
        if r is not None:
            self._end(r, local_reason="abort")

    # ---------------------------------------------------------------- control
    async def health(self) -> dict:
        """Ping the scheduler -> {"ok", "scheduler_id", "protocol_version", "latency_ms", "address"}."""
        loop = self._ensure_started()
        nonce = self._next_nonce()
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
        out = {"ok": pong.protocol_version == PROTOCOL_VERSION, "scheduler_id": pong.scheduler_id,
               "protocol_version": pong.protocol_version, "latency_ms": round((loop.time() - t0) * 1000.0, 3),
               "address": self.address}
        if not out["ok"]:
            out["error"] = (f"the scheduler speaks protocol version {pong.protocol_version}, this client "
                            f"{PROTOCOL_VERSION}; install the same zeroserve release on both sides")
        return out

    async def _ask_once(self, msg: Any, reply_type: type) -> Any:
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
        """Every model, with the pool's view, then the LoRA adapters: [{"id", "max_model_len", "groups",
        "tool_call_parser", "state" (available | loading | loaded | unloading | failed), "reason", "pinned",
        "waiting", "parent" (an adapter's base model, None for a model)}, ...]."""
        return [msgspec.structs.asdict(m) for m in (await self._ask(P.ModelsRequest(), P.ModelsReply)).models]

    async def load_model(self, model: str) -> list[dict]:
        """Ask the model pool to load a catalog model (it loads in the background, clearing a
        failed state); returns models() as the scheduler sees them right after."""
        return [msgspec.structs.asdict(m) for m in
                (await self._ask(P.ModelsControl(action="load", model=model), P.ModelsReply)).models]

    async def unload_model(self, model: str) -> list[dict]:
        """Ask the model pool to unload a catalog model (each copy once it has no requests)."""
        return [msgspec.structs.asdict(m) for m in
                (await self._ask(P.ModelsControl(action="unload", model=model), P.ModelsReply)).models]

    async def load_lora_adapter(self, name: str, path: str, model: str | None = None) -> None:
        """Serve the PEFT adapter at `path` (a directory the workers can read) as `name`, for base
        `model` (default: the cluster's first); InvalidRequest names what does not fit."""
        reply = await self._ask(P.LoadLoRA(name=name, path=str(path), model=model), P.LoRAReply)
        if not reply.ok:
            raise InvalidRequest(reply.detail)

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter `name`; InvalidRequest when it is not loaded."""
        reply = await self._ask(P.UnloadLoRA(name=name), P.LoRAReply)
        if not reply.ok:
            raise InvalidRequest(reply.detail)

    async def metrics(self) -> str:
        """The scheduler's Prometheus metrics, in the text exposition format."""
        return (await self._ask(P.MetricsRequest(), P.MetricsReply)).text

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
                msg = decode(frames)
            except ProtocolError as e:
                log.warning("dropped a bad message from the scheduler: %s", e.reason)
                continue
            try:
                t = type(msg)
                if t is P.Outputs:
                    if self._multi and not self._fence.admit(msg.term):  # a deposed scheduler's
                        continue
                    # requests getting their first output go first: their consumers wake first,
                    # ahead of the other streams' deltas of this step (TTFT; a request's own
                    # items keep their order)
                    later = []
                    for item in msg.items:
                        r = reqs.get(item.request_id)
                        if r is None:
                            continue
                        if r.started:
                            later.append((r, item))
                        elif r.feed(item):
                            self._end(r)
                    for r, item in later:
                        if not r.ended and r.feed(item):  # ended in the first pass: dropped, as before
                            self._end(r)
                elif t is P.Pong:
                    self._on_pong(msg)
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
