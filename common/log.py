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


class LogBudget:
    """At most ``per_window`` lines of one kind per ``window_s``; the rest are counted and the
    count is logged when the next window opens (a flood of bad frames must not cost a log line,
    and its disk space, each)."""

    def __init__(self, what: str, per_window: int = 20, window_s: float = 10.0) -> None:
        self.what, self.per_window, self.window_s = what, per_window, window_s
        self.window_start, self.used, self.dropped = float("-inf"), 0, 0

    def allow(self, now: float) -> bool:
        if now - self.window_start >= self.window_s:
            if self.dropped:
                get_logger().warning(f"{self.dropped} more '{self.what}' lines left out",
                                     window_s=self.window_s)
            self.window_start, self.used, self.dropped = now, 0, 0
        if self.used < self.per_window:
            self.used += 1
            return True
        self.dropped += 1
        return False
