"""structlog setup: readable on a terminal, JSON lines when asked (ZEROSERVE_LOG_JSON=1)."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def setup_logging(level: str | None = None, json: bool | None = None, service: str | None = None) -> None:
    global _configured
    level_name = (level or os.environ.get("ZEROSERVE_LOG_LEVEL", "info")).upper()
    if json is None:
        json = os.environ.get("ZEROSERVE_LOG_JSON", "0") not in ("0", "", "false")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    if service:
        structlog.contextvars.bind_contextvars(service=service, pid=os.getpid())
    _configured = True


def get_logger(name: str | None = None):
    if not _configured:
        setup_logging()
    return structlog.get_logger(name)
