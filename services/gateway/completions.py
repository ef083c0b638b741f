"""`POST /v1/completions` and `POST /v1/chat/completions` as plain ASGI handlers.

They bypass FastAPI's routing and Starlette's StreamingResponse: those layers cost ~60 us per
streamed chunk plus an anyio task group per request, which on a CPU box comes out of the
worker's share (benchmarks/serve.py). The `Outer` wrapper in app.py still does the API key,
the body limit and the counters for them.

Every request becomes one cluster request per prompt (``n`` completions each). Streams are
server-sent events (``data: {...}``, then ``data: [DONE]``); deltas that are already waiting
when the gateway gets to write go out in one socket write, each its own event. A client that
goes away (while its request waits for the first token, streams, or runs to completion) aborts
its cluster requests, so their KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import ValidationError

from zeroserve.common.errors import InvalidRequest, ZeroserveError
from zeroserve.common.log import get_logger
from zeroserve.services.gateway.errors import (
    APIError,
    BodyTooLarge,
    api_error,
    send_json,
    validation_error,
)
from zeroserve.common.tools import ToolStream
from zeroserve.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from zeroserve.services.gateway.tools import assistant_message, tool_parser

log = get_logger("gateway")

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_DONE = b"data: [DONE]\n\n"


# ================================================================ response pieces
def now() -> int:
    return int(time.time())


def _rid(prefix: str) -> str:
    return f"{prefix}-{os.urandom(12).hex()}"


def _token_str(tok, token_id: int) -> str:
    if tok is None:
        return f"token_id:{token_id}"
    return tok.decode([token_id])


def _sampled(tok, entries: list[dict]):
    """(sampled token's string, its Logprob, every (id, Logprob) of the entry) per non-empty
    entry; an entry's first item is the sampled token (common/outputs.py)."""
    for entry in entries:
        if entry:
            items = list(entry.items())
            tid, lp = items[0]
            yield _token_str(tok, tid), lp, items


def _completion_logprobs(tok, entries: list[dict], offset: int) -> dict:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for s, lp, items in _sampled(tok, entries):
        out["tokens"].append(s)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({_token_str(tok, t): x.logprob for t, x in items})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def _chat_logprobs(tok, entries: list[dict], top: int) -> dict:
    content = []
    for s, lp, items in _sampled(tok, entries):
        tops = [{"token": _token_str(tok, t), "logprob": x.logprob, "bytes": list(_token_str(tok, t).encode())}
                for t, x in sorted((kv for kv in items if kv[1].rank is not None and kv[1].rank <= top),
                                   key=lambda kv: kv[1].rank)]
        content.append({"token": s, "logprob": lp.logprob, "bytes": list(s.encode()), "top_logprobs": tops})
    return {"content": content}


def _usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


class _Tally:
    """A stream's token counts as its deltas pass, and how many of its choices still run."""

    def __init__(self, choices: int) -> None:
        self.prompt, self.out, self.cached, self.running = 0, 0, 0, choices

    def add(self, d) -> None:
        self.running -= d.finish_reason is not None
        if d.prompt_token_ids is not None:
            self.prompt += len(d.prompt_token_ids)
            self.cached += d.num_cached_tokens
        self.out += len(d.token_ids)

    def usage(self) -> dict:
        return _usage(self.prompt, self.out, self.cached)


_json = msgspec.json.Encoder()


def _sse(obj: Any) -> bytes:
    """One server-sent event (msgspec's JSON encoder: 0.65 us vs json.dumps 8.8 us on a chunk)."""
    return b"data: " + _json.encode(obj) + b"\n\n"


# ================================================================ the ASGI handler
@dataclass(frozen=True)
class Route:
    """One streamed-or-whole POST endpoint served by `handle`: `run(gw, body)` answers a dict (a
    whole JSON response) or (the SSE chunks, the cluster streams, their first deltas); `error`
    shapes an error as the endpoint's API expects (OpenAI's error object by default)."""

    run: Callable[[Any, bytes], Awaitable[Any]]
    error: Callable[[BaseException], APIError] = api_error


def parse_body(model, body: bytes):
    """The body as the pydantic `model`, or a 400 naming the wrong fields."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


async def handle(gw, scope, receive, send, chunk_send=None, route: Route | None = None) -> None:
    """One request to a Route (Outer routes them here; None: this module's own by path).
    `chunk_send`, if given, takes the streamed chunks after the response start went through
    `send` (Outer's counting wrapper only needs to see the status)."""
    started = time.perf_counter()
    route = route or ROUTES[scope["path"]]
    if scope["method"] != "POST":
        return await route.error(APIError(405, f"{scope['method']} is not allowed on {scope['path']}; use POST",
                                          "BadRequestError", "method_not_allowed")).send(send)
    body = await _read_body(receive)
    if body is None:
        return  # the client left before its body arrived
    await _until_disconnect(receive, _respond(gw, route, body, send, chunk_send or send, started))


async def _read_body(receive) -> bytes | None:
    parts = []
    while True:
        msg = await receive()  # Outer's counting receive raises BodyTooLarge over the limit
        if msg["type"] == "http.disconnect":
            return None
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(parts)


async def _respond(gw, route: Route, body: bytes, send, chunk_send, started: float) -> None:
    try:
        result = await route.run(gw, body)
    except (APIError, ZeroserveError) as e:
        return await route.error(e).send(send)
    except (asyncio.CancelledError, BodyTooLarge):
        raise
    except Exception as e:
        log.exception("request failed")
        return await route.error(e).send(send)
    if isinstance(result, dict):
        return await send_json(send, result)
    chunks, streams, firsts = result
    try:
        await send({"type": "http.response.start", "status": 200,
                    "headers": _SSE_HEADERS + _latency_headers(firsts, started)})
        async for chunk in chunks:
            last = chunk.endswith(_DONE)  # the end of the response rides on the last write
            await chunk_send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if last:
                return
        await chunk_send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:  # cancelled between chunks (or before the first): abort the streams now, not at GC
        await chunks.aclose()
        for st in streams:
            await st.aclose()


async def _until_disconnect(receive, coro):
    """Run `coro` in this task (a task of its own would start one loop turn later, behind every
    stream's writes of that turn: measured ~10 ms of TTFT at 64 streams); a watcher cancels it
    (the client aborts its cluster requests) if the HTTP client leaves meanwhile."""
    me = asyncio.current_task()
    running, left = True, False

    async def watch():
        nonlocal left
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                if running:  # only while `coro` waits: never cancel what runs after it
                    left = True
                    me.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await coro
    except asyncio.CancelledError:
        # ours (the client left) is taken back; one from the caller too (uvicorn shutting down)
        # still propagates
        if not left:
            raise
        left = False
        if me.uncancel() > 0:
            raise
        return None
    finally:
        running = False
        watcher.cancel()
        if left:  # `coro` swallowed our cancellation: take it back all the same
            me.uncancel()


# ================================================================ completions
async def _completions(gw, body: bytes):
    """A whole response (dict) or, for stream: true, (the SSE chunks, the cluster streams, their
    first deltas) once the first deltas came."""
    req = parse_body(CompletionRequest, body)
    model = await gw.resolve_model(req.model)
    prompts = req.prompts()
    sp, unset = req.sampling_params(), req.model_defaults()
    sp.model = model
    want_lp = sp.logprobs is not None
    tok = await gw.tokenizer(model, required=False) if (want_lp or req.echo) else None
    lp_tok = None if req.return_tokens_as_token_ids else tok
    if req.echo and tok is None and any(not isinstance(p, str) for p in prompts):
        raise InvalidRequest("echo with token-id prompts needs the gateway's tokenizer (start it with --model)")
    echo_text = [(p if isinstance(p, str) else tok.decode(p)) if req.echo else "" for p in prompts]
    rid, created = _rid("cmpl"), now()
    timeout = gw.cfg.request_timeout_s
    c = gw.client
    if not req.stream:
        runs = [asyncio.ensure_future(c.generate(p, sp, f"{rid}-{i}", request_timeout_s=timeout,
                                                 model_defaults=unset)) for i, p in enumerate(prompts)]
        try:
            outs = await asyncio.gather(*runs)
        finally:
            for t in runs:  # one failed (or the client left): abort the others too
                t.cancel()
        choices, n_prompt, n_out, cached = [], 0, 0, 0
        for i, out in enumerate(outs):
            n_prompt += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            for o in out.outputs:
                n_out += len(o.token_ids)
                lp = _completion_logprobs(lp_tok, o.logprobs or [], len(echo_text[i])) if want_lp else None
                choices.append({"index": i * sp.n + o.index, "text": echo_text[i] + o.text, "logprobs": lp,
                                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": _usage(n_prompt, n_out, cached)}

    streams = [c.stream(p, sp, f"{rid}-{i}", request_timeout_s=timeout, model_defaults=unset)
               for i, p in enumerate(prompts)]
    firsts = await _prefetch(streams)

    continuous = req.continuous_usage

    async def events():
        offsets: dict[int, int] = {}
        out: list[bytes] = []
        tally = _Tally(len(prompts) * sp.n)  # once every choice finished, the tail joins the last write
        try:
            async for i, d, more in _chain(firsts, streams):
                tally.add(d)
                idx = i * sp.n + d.index
                text = d.text
                if idx not in offsets:
                    text = echo_text[i] + text
                    offsets[idx] = 0
                lp = None
                if want_lp:
                    lp = _completion_logprobs(lp_tok, d.logprobs or [], offsets[idx])
                offsets[idx] += len(text)
                if text or d.finish_reason is not None or d.token_ids:
                    ev = {"id": rid, "object": "text_completion", "created": created, "model": model,
                          "choices": [{"index": idx, "text": text, "logprobs": lp,
                                       "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]}
                    if continuous:
                        ev["usage"] = tally.usage()
                    out.append(_sse(ev))
                if out and not more and tally.running:  # nothing else waiting: write what we have
                    yield b"".join(out)
                    out.clear()
            if req.include_usage:
                out.append(_sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": [], "usage": tally.usage()}))
        except ZeroserveError as e:  # mid-stream: the status is sent already
            out.append(_sse(api_error(e).body()))
        out.append(_DONE)
        yield b"".join(out)

    return events(), streams, firsts


# ================================================================ chat
async def _chat(gw, body: bytes):
    req = parse_body(ChatCompletionRequest, body)
    model = await gw.resolve_model(req.model)
    sp, unset = req.sampling_params(), req.model_defaults()
    sp.model = model
    spec = req.tool_spec()
    parser = await tool_parser(gw, model) if spec is not None and spec.choice == "auto" else None
    tools = {"tools": req.tools, "tool_choice": req.tool_choice, "parallel_tool_calls": req.parallel_tool_calls}
    messages = [m.plain() for m in req.messages]
    want_lp = sp.logprobs is not None
    top = sp.logprobs or 0
    tok = await gw.tokenizer(model, required=False) if want_lp and not req.return_tokens_as_token_ids else None
    rid, created = _rid("chatcmpl"), now()
    timeout = gw.cfg.request_timeout_s
    c = gw.client
    if not req.stream:
        out = await c.chat(messages, sp, rid, request_timeout_s=timeout, model_defaults=unset, tool_parser=parser,
                           **tools)
        choices = [{"index": o.index, "message": assistant_message(o),
                    "logprobs": _chat_logprobs(tok, o.logprobs or [], top) if want_lp else None,
                    "finish_reason": "tool_calls" if o.tool_calls else o.finish_reason,
                    "stop_reason": o.stop_reason} for o in out.outputs]
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": _usage(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs),
                                out.num_cached_tokens)}

    streams = [c.stream_chat(messages, sp, rid, request_timeout_s=timeout, model_defaults=unset, **tools)]
    firsts = await _prefetch(streams)
    shapers = [ToolStream(spec, parser) for _ in range(sp.n)]  # text -> content / tool_calls deltas

    def chunk(choices: list[dict], **extra) -> bytes:
        return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": choices, **extra})

    continuous = req.continuous_usage

    async def events():
        out = [chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None} for i in range(sp.n)])]
        tally = _Tally(sp.n)
        try:
            async for _, d, more in _chain(firsts, streams):
                tally.add(d)
                if d.text or d.finish_reason is not None or d.token_ids:
                    shaper = shapers[d.index]
                    deltas = shaper.feed(d.text) + (shaper.finish() if d.finish_reason is not None else [])
                    lp = _chat_logprobs(tok, d.logprobs or [], top) if want_lp else None
                    for delta in deltas[:-1]:  # all but the last piece: no logprobs, no finish
                        out.append(chunk([{"index": d.index, "delta": delta, "logprobs": None,
                                           "finish_reason": None}]))
                    ch = {"index": d.index, "delta": deltas[-1] if deltas else {}, "logprobs": lp,
                          "finish_reason": d.finish_reason}
                    if d.finish_reason is not None:
                        ch["stop_reason"] = d.stop_reason
                        if shaper.calls:
                            ch["finish_reason"] = "tool_calls"
                    out.append(chunk([ch], **({"usage": tally.usage()} if continuous else {})))
                if out and not more and tally.running:
                    yield b"".join(out)
                    out.clear()
            if req.include_usage:
                out.append(chunk([], usage=tally.usage()))
        except ZeroserveError as e:
            out.append(_sse(api_error(e).body()))
        out.append(_DONE)
        yield b"".join(out)

    return events(), streams, firsts


ROUTES = {"/v1/completions": Route(_completions), "/v1/chat/completions": Route(_chat)}


# ================================================================ streams
def _waiting(stream) -> bool:
    """Whether the stream's next delta is queued already (its __anext__ will not wait); a
    stream without `ready()` (a test double) never merges writes."""
    ready = getattr(stream, "ready", None)
    return bool(ready()) if ready is not None else False


async def _prefetch(streams: list) -> list:
    """Start every stream and wait for its first delta (it sends the request): errors surface
    before any HTTP status is sent, so they become proper error responses. On an error abort
    them all and raise it."""
    if len(streams) == 1:  # the common case: no task per stream
        try:
            return [await streams[0].__anext__()]
        except StopAsyncIteration as e:
            return [e]
        except BaseException:
            await streams[0].aclose()
            raise
    results = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, StopAsyncIteration)]
    if errors:
        for s in streams:
            await s.aclose()
        raise errors[0]
    return results


def _latency_headers(firsts: list, started: float) -> list[tuple[bytes, bytes]]:
    """Two timings of the first token, as response headers (seconds): the cluster's own (the
    scheduler's receipt to its first token, the slowest prompt's) and this gateway's (its handler
    starting on the request to these headers, which the first token follows at once). A client
    subtracts them from the TTFT it saw: TTFT minus the gateway's is the time before the handler
    ran (its own HTTP write, the kernel, this process's event loop busy with other requests);
    the gateway's minus the cluster's is the handler's own share and its ZeroMQ hops."""
    out = [(b"zeroserve-gateway-first-token-latency", f"{time.perf_counter() - started:.6f}".encode())]
    lat = [d.first_token_latency for d in firsts if getattr(d, "first_token_latency", None) is not None]
    if lat:
        out.append((b"zeroserve-first-token-latency", f"{max(lat):.6f}".encode()))
    return out


async def _chain(firsts: list, streams: list) -> AsyncIterator[tuple[int, Any, bool]]:
    """(stream index, delta, whether another delta is waiting already): the prefetched first
    deltas, then the rest of every stream as they come. Closing the iterator (or cancelling
    the task that drives it) aborts every stream that still runs."""
    if len(streams) == 1:
        s = streams[0]
        try:
            if not isinstance(firsts[0], StopAsyncIteration):
                yield 0, firsts[0], _waiting(s)
            async for d in s:
                yield 0, d, _waiting(s)
        finally:
            await s.aclose()
        return
    # a deque, not an asyncio.Queue: the consumer must see whether a delta (not just an end
    # marker) is waiting, or it would hold back a write while the next wait blocks
    items: collections.deque = collections.deque()
    end = object()
    loop = asyncio.get_running_loop()
    wake: list[asyncio.Future | None] = [None]

    def put(item) -> None:
        items.append(item)
        w = wake[0]
        if w is not None and not w.done():
            w.set_result(None)

    async def pump(i, s):
        try:
            async for d in s:
                put((i, d))
            put((i, end))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put((i, e))

    for i, d in enumerate(firsts):
        if not isinstance(d, StopAsyncIteration):
            items.append((i, d))
    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            while not items:
                wake[0] = loop.create_future()
                try:
                    await wake[0]
                finally:
                    wake[0] = None
            i, d = items.popleft()
            if d is end:
                left -= 1
                continue
            if isinstance(d, BaseException):
                raise d
            while items and items[0][1] is end:
                items.popleft()
                left -= 1
            yield i, d, bool(items)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()
