"""The OpenAI-compatible HTTP gateway over one `AsyncClient` to the scheduler.

`/v1/completions`, `/v1/chat/completions`, `/v1/responses` (responses.py), `/v1/messages`
(anthropic.py) and `/v1/embeddings` (embeddings.py) are plain ASGI handlers (completions.py: the
streaming hot path skips FastAPI and Starlette's StreamingResponse); the other endpoints are
FastAPI routes. The chat template is applied in the scheduler (`AsyncClient.chat`), so HTTP
and ZeroMQ clients get the same prompt. Errors are OpenAI error objects with the status the
SDKs map to their typed exceptions (400 / 401 / 404 / 413 / 429 / 503 / 504).

The metrics of `/metrics` are the scheduler's (`MetricsRequest`: it sees every request, also those
of ZeroMQ clients), plus a few of this gateway's own.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()

from zeroserve.common.config import GatewayArgs
from zeroserve.common.errors import InvalidRequest, ZeroserveError
from zeroserve.common.log import get_logger
from zeroserve.common.memory import freeze_startup_heap
from zeroserve.services.gateway import anthropic, completions, embeddings, responses
from zeroserve.services.gateway.completions import now as _now
from zeroserve.services.gateway.errors import (
    RETRY_AFTER_S,
    APIError,
    BodyTooLarge,
    api_error,
    validation_error,
)
from zeroserve.services.gateway.protocol import DetokenizeRequest, TokenizeRequest

log = get_logger("gateway")

MODELS_TTL_S = 5.0


# ================================================================ the ASGI wrapper: auth, body size, counts
class Outer:
    """Pure ASGI: the API key on /v1/*, /api/* and /tokenize, /detokenize (401), 413 for a body over
    `max_body_bytes` (by Content-Length, or counted as it arrives), this gateway's request
    counters; then the completion endpoints' own handler, or FastAPI for the rest."""

    def __init__(self, app, cfg: GatewayArgs, gw: Gateway) -> None:
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
        route = ROUTES.get(path)
        shape = route.error if route is not None else api_error  # Anthropic's paths answer its error shape
        try:
            if self.key is not None and (path.startswith(("/v1/", "/api/")) or path in ("/tokenize", "/detokenize")):
                if not self._authorized(headers):
                    return await shape(APIError(401, "invalid or missing API key: send `Authorization: Bearer KEY` "
                                                     "or `x-api-key: KEY`", "AuthenticationError",
                                                "invalid_api_key")).send(counting_send)
            too_big = shape(APIError(413, f"the request body is larger than {self.limit} bytes (--max-body-bytes)",
                                     "BadRequestError", "request_too_large"))
            length = headers.get(b"content-length", b"")
            if self.limit and length.isdigit() and int(length) > self.limit:
                return await too_big.send(counting_send)
            seen = 0

            async def counted():
                nonlocal seen
                msg = await receive()
                if msg["type"] == "http.request" and self.limit:
                    seen += len(msg.get("body", b""))
                    if seen > self.limit:
                        raise BodyTooLarge()
                return msg

            self.gw.in_progress.inc()
            try:
                if route is not None:
                    await completions.handle(self.gw, scope, counted, counting_send, send, route)
                else:
                    await self.app(scope, counted, counting_send)
            except BodyTooLarge:
                await too_big.send(counting_send)
            finally:
                self.gw.in_progress.dec()
        finally:
            self.gw.http_requests.labels(label, status[0]).inc()

    def _authorized(self, headers: dict) -> bool:
        """The key as a bearer token (OpenAI's SDKs) or as `x-api-key` (Anthropic's)."""
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key):
            return True
        return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.key)


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
        self._models_fut: asyncio.Future | None = None
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
        freeze_startup_heap()
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
        """The served models. A list older than MODELS_TTL_S is still answered while one
        refresh runs behind it: requests never wait on the scheduler for it."""
        if refresh or not self._models:
            return await asyncio.shield(self._fetch_models())
        if time.monotonic() - self._models_at > MODELS_TTL_S:
            self._fetch_models()
        return self._models

    def _fetch_models(self) -> asyncio.Future:
        """One ModelsRequest at a time, shared by everyone who asks meanwhile."""
        if self._models_fut is None:
            async def fetch() -> list[dict]:
                try:
                    self._models = await self.client.models()
                    self._models_at = time.monotonic()
                    return self._models
                finally:
                    self._models_fut = None

            self._models_fut = asyncio.ensure_future(fetch())
            self._models_fut.add_done_callback(_retrieved)
        return self._models_fut

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
                    from zeroserve.common.tokenizer import load_tokenizer

                    tok = await asyncio.to_thread(load_tokenizer, d)
            if tok is None and required:
                raise APIError(400, f"this gateway has no tokenizer for model {model!r}; start it with --model DIR "
                                    "(the served model's directory or .gguf file)", "BadRequestError",
                               "no_tokenizer")
            if tok is not None:
                self._tokenizers[model] = tok
                freeze_startup_heap()  # a tokenizer is ~10^5 objects that live as long as we do
            return tok

    def _model_dirs(self) -> dict[str, str]:
        if self._tok_dirs is None:
            from zeroserve.common.model_config import ModelConfig

            out = {}
            for d in self.cfg.models:
                try:
                    out[ModelConfig.from_dir(d).name] = d
                except Exception as e:  # noqa: BLE001 - a bad directory: say so, use the others
                    log.warning("cannot read model directory", model=d, error=str(e))
            self._tok_dirs = out
        return self._tok_dirs


def _retrieved(fut: asyncio.Future) -> None:
    """A background refresh's error is not lost (nor logged as never retrieved): the next
    request that needs the list asks again and gets it."""
    if not fut.cancelled():
        fut.exception()


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
        return validation_error(e.errors()).response()

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

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return await responses.get_response(gw, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return await responses.delete_response(gw, response_id)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        model = await gw.resolve_model(req.model)
        tok = await gw.tokenizer(model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give prompt or messages (one of them)")
        if req.messages is not None:
            from zeroserve.common.chat import chat_prompt

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

    if cfg.ui:
        from zeroserve.services.gateway.console import add_console

        add_console(app, gw)
    return Outer(app, cfg, gw)


# the POST endpoints served by completions.handle (streamed or whole), each with its error shape
ROUTES = {**completions.ROUTES, **responses.ROUTES, **anthropic.ROUTES, **embeddings.ROUTES}
KNOWN_PATHS = {"/health", "/metrics", "/v1/models", "/tokenize", "/detokenize", "/", "/cluster", "/api/cluster",
               *ROUTES}
