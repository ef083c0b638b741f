"""``AsyncStream``: the async iterator ``AsyncClient.stream`` returns (one request's deltas)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol, Self

from zeroserve.common.sampling_params import SamplingParams
from zeroserve._request import StreamDelta, _Req


class _Owner(Protocol):
    """What a stream needs of the AsyncClient that made it (client.py imports this module, so
    this one names the client's side by its shape, not by an import)."""

    _loop: asyncio.AbstractEventLoop

    def _submit(self, prompt: Any, params: Any, request_id: str | None, request_timeout_s: float | None,
                streaming: bool, model_defaults: list[str]) -> _Req: ...

    def _cancel_request(self, r: _Req) -> None: ...


class AsyncStream:
    """Async iterator of StreamDelta for one request (from ``AsyncClient.stream``).

    Also an async context manager; ``aclose()`` (or leaving the ``async with``, or dropping the
    iterator after ``break``) aborts the request if it is still running."""

    def __init__(self, client: _Owner, prompt: Any, params: SamplingParams, request_id: str | None,
                 request_timeout_s: float | None, model_defaults: list[str]) -> None:
        self._client = client
        self._args: tuple | None = (prompt, params, request_id, request_timeout_s, model_defaults)
        self._req: _Req | None = None
        self._closed = False

    @property
    def request_id(self) -> str | None:
        """The request id (known once the request was sent, i.e. after the first ``__anext__``)."""
        return self._req.rid if self._req is not None else (self._args[2] if self._args else None)

    def ready(self) -> bool:
        """Whether a delta has arrived that ``__anext__`` would return without waiting (a writer
        can batch what is already there, e.g. the gateway's one write for several SSE events)."""
        return self._req is not None and bool(self._req.queue)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self._closed:
            raise StopAsyncIteration
        r = self._req
        if r is None:
            prompt, params, rid, timeout, defaults = self._args
            self._args = None
            try:
                r = self._req = self._client._submit(prompt, params, rid, timeout, streaming=True,
                                                     model_defaults=defaults)
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


