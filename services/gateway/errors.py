"""OpenAI error objects: the HTTP status, type and code an OpenAI SDK maps to its typed exceptions."""

from __future__ import annotations

import msgspec

from zeroserve.common.errors import (
    ClusterUnavailable,
    InvalidRequest,
    Overloaded,
    RequestTimeout,
    ZeroserveError,
)

RETRY_AFTER_S = "1"

_json = msgspec.json.Encoder()


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code or
                          self.status}}

    def response(self):
        from fastapi.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    async def send(self, send) -> None:
        """Send this error as a whole response on a raw ASGI `send`."""
        await send_json(send, self.body(), self.status, self.headers)


async def send_json(send, obj, status: int = 200, headers: dict[str, str] | None = None) -> None:
    body = _json.encode(obj)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


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


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's (or FastAPI's) validation errors as one 400 naming the fields."""
    parts, param = [], None
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc) or "body"
        param = param or field
        parts.append(f"{field}: {err.get('msg')}")
    return APIError(400, "invalid request: " + "; ".join(parts), "BadRequestError", "invalid_request", param=param)


class BodyTooLarge(Exception):
    """Raised by the gateway's counting `receive` once a body passes --max-body-bytes."""
