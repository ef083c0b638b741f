"""Typed errors that reach users; each message says what to change."""

from __future__ import annotations


class ZeroserveError(Exception):
    """Base of every error zeroserve raises on purpose."""

    code = "internal"


class InvalidRequest(ZeroserveError, ValueError):
    """The request or one of its parameters is wrong; fix it and send again."""

    code = "invalid_request"


class Overloaded(ZeroserveError):
    """The cluster's queue is full; retry later or add workers."""

    code = "overloaded"


class RequestTimeout(ZeroserveError, TimeoutError):
    """The request did not finish within its timeout."""

    code = "timeout"


class ClusterUnavailable(ZeroserveError, ConnectionError):
    """The scheduler did not answer within the client's timeout."""

    code = "unavailable"


class ModelLoadError(ZeroserveError, ValueError):
    """A model directory is missing something or holds what we cannot run."""

    code = "model_load"


class CurveKeyError(ZeroserveError, ValueError):
    """A CURVE key file or folder is missing or unreadable; the message names it and the
    `zeroserve keys` command that creates it."""

    code = "curve_keys"


ERRORS_BY_CODE = {
    cls.code: cls
    for cls in (ZeroserveError, InvalidRequest, Overloaded, RequestTimeout, ClusterUnavailable, ModelLoadError,
                CurveKeyError)
}


def error_from_code(code: str, message: str) -> ZeroserveError:
    """Rebuild a typed error received over the wire."""
    return ERRORS_BY_CODE.get(code, ZeroserveError)(message)
