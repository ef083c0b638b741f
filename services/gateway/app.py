"""The OpenAI-compatible HTTP gateway: FastAPI routes over one `AsyncClient` to the scheduler.

Every request becomes one cluster request per prompt (``n`` completions each); the chat template
is applied in the scheduler (`AsyncClient.chat`), so HTTP and ZeroMQ clients get the same
prompt. Streams are server-sent events (``data: {...}`` lines, then ``data: [DONE]``); a client
that goes away mid-stream, or before a plain request finished, aborts its cluster requests, so
their KV blocks are freed at once. Errors are OpenAI error objects with the status the SDKs map to
their typed exceptions (400 / 401 / 404 / 413 / 429 / 503 / 504).

The metrics of `/metrics` are the scheduler's (`MetricsRequest`: it sees every request, also those
of ZeroMQ clients), plus a few of this gateway's own.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()

from common.config import GatewayArgs
from common.errors import (
    ClusterUnavailable,
    InvalidRequest,
    Overloaded,
    RequestTimeout,
    ZeroserveError,
)
from common.log import get_logger
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

log = get_logger("gateway")

RETRY_AFTER_S = "1"
MODELS_TTL_S = 5.0


# ================================================================ errors
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code or
                          self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(e: BaseException) -> APIError:
    """A zeroserve error as the HTTP error an OpenAI client expects."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequest):
        return APIError(400, str(e), "BadRequestError", "invalid_request")
    if isinstance(e, Overloaded):
        return APIError(429, str(e), "RateLimitError", "overloaded", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(e, ClusterUnavailable):
        return APIError(503, str(e), "ServiceUnavailableError", "unavailable", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(e, RequestTimeout):
        return APIError(504, str(e), "TimeoutError", "timeout")
    if isinstance(e, ZeroserveError):
        return APIError(500, str(e), "InternalServerError", getattr(e, "code", "internal"))
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "InternalServerError", "internal")


# ================================================================ the ASGI wrapper: auth, body size, counts
class Outer:
    """Pure ASGI (streams pass straight through): the API key on /v1/* and /tokenize,
    /detokenize (401), 413 for a body over `max_body_bytes` (by Content-Length, or counted as it
    arrives), and this gateway's request counters."""

    def __init__(self, app, cfg: GatewayArgs, gw: "Gateway") -> None:
        self.app, self.cfg, self.gw = app, cfg, gw
        self.limit = cfg.max_body_bytes
        self.key = cfg.api_key.encode() if cfg.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        label = path if path in KNOWN_PATHS else "other"
        status = ["500"]

        async def counting_send(msg):
            if msg["type"] == "http.response.start":
                status[0] = str(msg["status"])
            await send(msg)

        headers = dict(scope.get("headers", []))
        try:
            if self.key is not None and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize")):
                scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                    return await APIError(401, "invalid or missing API key: send `Authorization: Bearer KEY`",
                                          "AuthenticationError", "invalid_api_key").response()(
                        scope, receive, counting_send)
            too_big = APIError(413, f"the request body is larger than {self.limit} bytes (--max-body-bytes)",
                               "BadRequestError", "request_too_large")
            length = headers.get(b"content-length", b"")
            if self.limit and length.isdigit() and int(length) > self.limit:
                return await too_big.response()(scope, receive, counting_send)
            seen = 0

            async def counted():
                nonlocal seen
                msg = await receive()
                if msg["type"] == "http.request" and self.limit:
                    seen += len(msg.get("body", b""))
                    if seen > self.limit:
                        raise _TooBig()
                return msg

            self.gw.in_progress.inc()
            try:
                await self.app(scope, counted, counting_send)
            except _TooBig:
                await too_big.response()(scope, receive, counting_send)
            finally:
                self.gw.in_progress.dec()
        finally:
            self.gw.http_requests.labels(label, status[0]).inc()


class _TooBig(Exception):
    pass


# ================================================================ state
class Gateway:
    """What the routes share: the cluster client (made on the server's loop), the served
    models, lazily loaded tokenizers, this gateway's own metrics."""

    def __init__(self, cfg: GatewayArgs, client_factory=None) -> None:
        self.cfg = cfg
        self.client = None
        self._client_factory = client_factory
        self._models: list[dict] = []
        self._models_at = 0.0
        self._tokenizers: dict[str, Any] = {}
        self._tok_dirs: dict[str, str] | None = None
        self._tok_lock = asyncio.Lock()
        self.registry = CollectorRegistry()
        self.http_requests = Counter("zeroserve:gateway_http_requests", "HTTP requests this gateway answered.",
                                     ["endpoint", "status"], registry=self.registry)
        self.in_progress = Gauge("zeroserve:gateway_requests_in_progress", "HTTP requests being served.",
                                 registry=self.registry)
        self.scheduler_up = Gauge("zeroserve:gateway_scheduler_up", "1 if the scheduler answered the last metrics "
                                                                     "request.", registry=self.registry)

    async def start(self) -> None:
        from zeroserve import AsyncClient

        make = self._client_factory or (lambda: AsyncClient(
            self.cfg.scheduler, timeout_s=self.cfg.timeout_s, curve_keys=self.cfg.curve_keys,
            curve_client_name=self.cfg.curve_client))
        self.client = make()
        if self.cfg.models:  # load the tokenizer(s) in the background: the first logprobs request need not wait
            self._warm = asyncio.ensure_future(self._warm_tokenizers())

    async def _warm_tokenizers(self) -> None:
        try:
            for name in await asyncio.to_thread(self._model_dirs):
                await self.tokenizer(name, required=False)
        except Exception as e:  # noqa: BLE001 - loaded (and reported) again on first use
            log.warning("tokenizer warm-up failed", error=str(e))

    async def stop(self) -> None:
        warm = getattr(self, "_warm", None)
        if warm is not None:
            warm.cancel()
        if self.client is not None:
            await self.client.close()

    # ---------------------------------------------------------------- models
    async def models(self, refresh: bool = False) -> list[dict]:
        now = time.monotonic()
        if refresh or not self._models or now - self._models_at > MODELS_TTL_S:
            self._models = await self.client.models()
            self._models_at = now
        return self._models

    async def resolve_model(self, name: str | None) -> str:
        """The served model a request names (None / empty: the first one); 404 if unknown."""
        models = await self.models()
        if not name:
            if not models:
                raise APIError(503, "the cluster serves no model yet", "ServiceUnavailableError", "unavailable",
                               headers={"Retry-After": RETRY_AFTER_S})
            return models[0]["id"]
        if not any(m["id"] == name for m in models):
            models = await self.models(refresh=True)
        if not any(m["id"] == name for m in models):
            raise APIError(404, f"The model `{name}` does not exist. Served models: {[m['id'] for m in models]}",
                           "NotFoundError", "model_not_found", param="model")
        return name

    # ---------------------------------------------------------------- tokenizers
    async def tokenizer(self, model: str, required: bool = True):
        """The tokenizer of `model`, loaded on first use from a --model directory; None (or a
        400 when `required`) if this gateway was given none for it."""
        if model in self._tokenizers:
            return self._tokenizers[model]
        async with self._tok_lock:
            if model in self._tokenizers:
                return self._tokenizers[model]
            tok = None
            if self.cfg.models:
                dirs = await asyncio.to_thread(self._model_dirs)
                d = dirs.get(model) or (self.cfg.models[0] if len(self.cfg.models) == 1 else None)
                if d is not None:
                    from common.tokenizer import load_tokenizer

                    tok = await asyncio.to_thread(load_tokenizer, d)
            if tok is None and required:
                raise APIError(400, f"this gateway has no tokenizer for model {model!r}; start it with --model DIR "
                                    "(the served model's directory or .gguf file)", "BadRequestError",
                               "no_tokenizer")
            if tok is not None:
                self._tokenizers[model] = tok
            return tok

    def _model_dirs(self) -> dict[str, str]:
        if self._tok_dirs is None:
            from common.model_config import ModelConfig

            out = {}
            for d in self.cfg.models:
                try:
                    out[ModelConfig.from_dir(d).name] = d
                except Exception as e:  # noqa: BLE001 - a bad directory: say so, use the others
                    log.warning("cannot read model directory", model=d, error=str(e))
            self._tok_dirs = out
        return self._tok_dirs


# ================================================================ response pieces
def _now() -> int:
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


_json = msgspec.json.Encoder()


def _sse(obj: Any) -> bytes:
    """One server-sent event (msgspec's JSON encoder: 0.65 us vs json.dumps 8.8 us on a chunk)."""
    return b"data: " + _json.encode(obj) + b"\n\n"


async def _until_disconnect(request: Request, coro):
    """Run `coro`; cancel it (the client aborts its cluster requests) if the HTTP client leaves."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left (or we were cancelled): abort its cluster requests
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if not task.done() or task.cancelled():
        return None
    return task.result()


async def _merge(streams: list) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, delta) from several AsyncStreams, as they come; closing the iterator (or
    cancelling the task that drives it) aborts every stream that still runs."""
    if len(streams) == 1:
        try:
            async for d in streams[0]:
                yield 0, d
        finally:
            await streams[0].aclose()
        return
    q: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i, s):
        try:
            async for d in s:
                q.put_nowait((i, d))
            q.put_nowait((i, end))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, d = await q.get()
            if d is end:
                left -= 1
            elif isinstance(d, BaseException):
                raise d
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def _first(stream) -> Any:
    """The first delta of a stream (it sends the request): errors surface before any HTTP
    status is sent, so they become proper error responses."""
    return await stream.__anext__()


# ================================================================ the app
def create_app(cfg: GatewayArgs, client_factory=None) -> FastAPI:
    gw = Gateway(cfg, client_factory)

    @asynccontextmanager
    async def lifespan(app):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(title="zeroserve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(ZeroserveError)
    async def on_zs_error(request: Request, e: ZeroserveError):
        return api_error(e).response()

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, e: RequestValidationError):
        errs = e.errors()
        parts, param = [], None
        for err in errs[:5]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            field = ".".join(loc) or "body"
            param = param or field
            parts.append(f"{field}: {err.get('msg')}")
        return APIError(400, "invalid request: " + "; ".join(parts), "BadRequestError", "invalid_request",
                        param=param).response()

    # ---------------------------------------------------------------- plain endpoints
    @app.get("/health")
    async def health():
        try:
            s = await gw.client.stats()
        except ZeroserveError as e:
            return JSONResponse({"status": "unavailable", "detail": str(e)}, status_code=503)
        ready = sum(1 for g in s.get("groups", []) if g.get("state") == "ready")
        body = {"status": "ok" if ready else "no worker group ready", "groups_ready": ready,
                "detokenizer": bool(s.get("detokenizer", {}).get("connected"))}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics():
        text = ""
        try:
            text = await gw.client.metrics()
            gw.scheduler_up.set(1)
        except ZeroserveError:
            gw.scheduler_up.set(0)
        return PlainTextResponse(text + generate_latest(gw.registry).decode(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models():
        models = await gw.models(refresh=True)
        return {"object": "list", "data": [
            {"id": m["id"], "object": "model", "created": _now(), "owned_by": "zeroserve", "root": m["id"],
             "max_model_len": m.get("max_model_len"), "groups": m.get("groups")} for m in models]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        name = await gw.resolve_model(model_id)
        m = next(m for m in await gw.models() if m["id"] == name)
        return {"id": name, "object": "model", "created": _now(), "owned_by": "zeroserve",
                "max_model_len": m.get("max_model_len")}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        model = await gw.resolve_model(req.model)
        tok = await gw.tokenizer(model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give prompt or messages (one of them)")
        if req.messages is not None:
            from common.chat import chat_prompt

            ids = (await asyncio.to_thread(chat_prompt, tok, [m.plain() for m in req.messages]))[1]
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        mm = next((m for m in await gw.models() if m["id"] == model), {})
        return {"count": len(ids), "max_model_len": mm.get("max_model_len"), "tokens": list(ids)}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        model = await gw.resolve_model(req.model)
        tok = await gw.tokenizer(model)
        return {"prompt": tok.decode(req.tokens)}

    # ---------------------------------------------------------------- completions
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        model = await gw.resolve_model(req.model)
        prompts = req.prompts()
        sp = req.sampling_params()
        sp.model = model
        want_lp = sp.logprobs is not None
        tok = await gw.tokenizer(model, required=False) if (want_lp or req.echo) else None
        lp_tok = None if req.return_tokens_as_token_ids else tok
        if req.echo and tok is None and any(not isinstance(p, str) for p in prompts):
            raise InvalidRequest("echo with token-id prompts needs the gateway's tokenizer (start it with --model)")
        echo_text = [(p if isinstance(p, str) else tok.decode(p)) if req.echo else "" for p in prompts]
        rid, created = _rid("cmpl"), _now()
        timeout = cfg.request_timeout_s
        c = gw.client
        if not req.stream:
            async def run():
                return await asyncio.gather(*(c.generate(p, sp, f"{rid}-{i}", request_timeout_s=timeout)
                                              for i, p in enumerate(prompts)))
            outs = await _until_disconnect(request, run())
            if outs is None:
                return Response(status_code=499)  # nobody is listening any more
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

        streams = [c.stream(p, sp, f"{rid}-{i}", request_timeout_s=timeout) for i, p in enumerate(prompts)]
        firsts = await _prefetch(streams)

        async def events():
            n_prompt, n_out, cached = 0, 0, 0
            offsets: dict[int, int] = {}
            try:
                async for i, d in _chain(firsts, streams):
                    if d.prompt_token_ids is not None:
                        n_prompt += len(d.prompt_token_ids)
                        cached += d.num_cached_tokens
                    n_out += len(d.token_ids)
                    idx = i * sp.n + d.index
                    text = d.text
                    if idx not in offsets:
                        text = echo_text[i] + text
                        offsets[idx] = 0
                    lp = None
                    if want_lp:
                        lp = _completion_logprobs(lp_tok, d.logprobs or [], offsets[idx])
                    offsets[idx] += len(text)
                    if not text and d.finish_reason is None and not d.token_ids:
                        continue
                    ev = {"id": rid, "object": "text_completion", "created": created, "model": model,
                          "choices": [{"index": idx, "text": text, "logprobs": lp,
                                       "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]}
                    if req.continuous_usage:
                        ev["usage"] = _usage(n_prompt, n_out, cached)
                    yield _sse(ev)
                if req.include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": _usage(n_prompt, n_out, cached)})
            except ZeroserveError as e:  # mid-stream: the status is sent already
                yield _sse(api_error(e).body())
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ---------------------------------------------------------------- chat
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        model = await gw.resolve_model(req.model)
        sp = req.sampling_params()
        sp.model = model
        messages = [m.plain() for m in req.messages]
        want_lp = sp.logprobs is not None
        top = sp.logprobs or 0
        tok = await gw.tokenizer(model, required=False) if want_lp and not req.return_tokens_as_token_ids else None
        rid, created = _rid("chatcmpl"), _now()
        timeout = cfg.request_timeout_s
        c = gw.client
        if not req.stream:
            out = await _until_disconnect(request, c.chat(messages, sp, rid, request_timeout_s=timeout))
            if out is None:
                return Response(status_code=499)
            choices = [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                        "logprobs": _chat_logprobs(tok, o.logprobs or [], top) if want_lp else None,
                        "finish_reason": o.finish_reason, "stop_reason": o.stop_reason} for o in out.outputs]
            return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                    "usage": _usage(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs),
                                    out.num_cached_tokens)}

        streams = [c.stream_chat(messages, sp, rid, request_timeout_s=timeout)]
        firsts = await _prefetch(streams)

        def chunk(choices: list[dict], **extra) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": choices, **extra})

        async def events():
            n_prompt, n_out, cached = 0, 0, 0
            try:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(sp.n)])
                async for _, d in _chain(firsts, streams):
                    if d.prompt_token_ids is not None:
                        n_prompt += len(d.prompt_token_ids)
                        cached += d.num_cached_tokens
                    n_out += len(d.token_ids)
                    if not d.text and d.finish_reason is None and not d.token_ids:
                        continue
                    delta = {"content": d.text} if d.text else {}
                    lp = _chat_logprobs(tok, d.logprobs or [], top) if want_lp else None
                    c = {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}
                    if d.finish_reason is not None:
                        c["stop_reason"] = d.stop_reason
                    yield chunk([c], **({"usage": _usage(n_prompt, n_out, cached)} if req.continuous_usage else {}))
                if req.include_usage:
                    yield chunk([], usage=_usage(n_prompt, n_out, cached))
            except ZeroserveError as e:
                yield _sse(api_error(e).body())
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return Outer(app, cfg, gw)


KNOWN_PATHS = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
               "/detokenize"}


async def _prefetch(streams: list) -> list:
    """Start every stream and wait for its first delta; on an error abort them all and raise it."""
    results = await asyncio.gather(*(_first(s) for s in streams), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, StopAsyncIteration)]
    if errors:
        for s in streams:
            await s.aclose()
        raise errors[0]
    return results


async def _chain(firsts: list, streams: list) -> AsyncIterator[tuple[int, Any]]:
    """The prefetched first deltas, then the rest of every stream, merged."""
    for i, d in enumerate(firsts):
        if not isinstance(d, StopAsyncIteration):
            yield i, d
    async for item in _merge(streams):
        yield item
