"""``Client``: the blocking client, an ``AsyncClient`` on a private loop in one background thread."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any, Self

import zmq

from zeroserve.common.errors import ZeroserveError
from zeroserve.common.outputs import EmbeddingOutput, RequestOutput
from zeroserve.common.sampling_params import SamplingParams
from zeroserve._request import StreamDelta
from zeroserve.client import DEFAULT_ADDRESS, AsyncClient
from zeroserve.streams import AsyncStream

log = logging.getLogger("zeroserve.client")

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
    ``curve_keys`` / ``curve_client_name``: CURVE, ``retries``: re-submission after a scheduler
    restart, as in ``AsyncClient``.
    """

    def __init__(self, address: str | int = DEFAULT_ADDRESS, timeout_s: float = 10.0,
                 request_timeout_s: float | None = None, *, curve_keys: str | os.PathLike | bool | None = None,
                 curve_client_name: str | None = None, retries: int = 0) -> None:
        self._ac = AsyncClient(address, timeout_s, request_timeout_s, curve_keys=curve_keys,
                               curve_client_name=curve_client_name, retries=retries)
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
                 *, request_timeout_s: float | None = None,
                 model_defaults: bool | list[str] | None = None) -> RequestOutput:
        """Run one request to the end; ``params`` and ``model_defaults`` as in ``AsyncClient.generate``."""
        return self._call(self._ac.generate(prompt, params, request_id, request_timeout_s=request_timeout_s,
                                            model_defaults=model_defaults))

    def embed(self, prompts: Any, model: str | None = None, *, pooling: str | None = None, normalize: bool = True,
              dimensions: int | None = None, request_timeout_s: float | None = None) -> list[EmbeddingOutput]:
        """The embedding of each prompt; as ``AsyncClient.embed``."""
        return self._call(self._ac.embed(prompts, model, pooling=pooling, normalize=normalize, dimensions=dimensions,
                                         request_timeout_s=request_timeout_s))

    def stream(self, prompt: Any, params: SamplingParams | dict | None = None, request_id: str | None = None,
               *, request_timeout_s: float | None = None,
               model_defaults: bool | list[str] | None = None) -> SyncStream:
        return SyncStream(self, self._ac.stream(prompt, params, request_id, request_timeout_s=request_timeout_s,
                                                model_defaults=model_defaults))

    def chat(self, messages: Any, params: SamplingParams | dict | None = None, request_id: str | None = None,
             *, request_timeout_s: float | None = None, model_defaults: bool | list[str] | None = None,
             tools: list[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool | None = None, tool_parser: str | None = None) -> RequestOutput:
        """Run a conversation through the model's chat template -> RequestOutput; ``tools`` and
        ``tool_choice`` as in AsyncClient.chat (the parsed calls in each completion's ``tool_calls``)."""
        return self._call(self._ac.chat(messages, params, request_id, request_timeout_s=request_timeout_s,
                                        model_defaults=model_defaults, tools=tools, tool_choice=tool_choice,
                                        parallel_tool_calls=parallel_tool_calls, tool_parser=tool_parser))

    def stream_chat(self, messages: Any, params: SamplingParams | dict | None = None, request_id: str | None = None,
                    *, request_timeout_s: float | None = None,
                    model_defaults: bool | list[str] | None = None) -> SyncStream:
        return SyncStream(self, self._ac.stream_chat(messages, params, request_id,
                                                     request_timeout_s=request_timeout_s,
                                                     model_defaults=model_defaults))

    def abort(self, request_id: str) -> None:
        self._call(self._ac.abort(request_id))

    def health(self) -> dict:
        return self._call(self._ac.health())

    def stats(self) -> dict:
        return self._call(self._ac.stats())

    def models(self) -> list[dict]:
        return self._call(self._ac.models())

    def metrics(self) -> str:
        """The scheduler's Prometheus metrics (text exposition format)."""
        return self._call(self._ac.metrics())

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

