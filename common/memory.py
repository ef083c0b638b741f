"""The heap of a long-lived service: freed memory back to the OS, start-up objects frozen.

libzmq frees a departed peer's state (its subscription trie, queued frames) but glibc keeps the
pages in its arenas: a SUB peer that flooded 10,000 long topics and left kept the scheduler's
RSS 130-160 MB up for good. ``malloc_trim(0)`` returns them (measured: +160 MB -> +4 MB). The
long-lived services call ``Trimmer.maybe`` from their loops; without glibc it does nothing.

CPython's cyclic collector walks every tracked object of the generation it collects. A service
that has loaded a tokenizer, FastAPI and pydantic holds ~330k of them, nearly all alive for the
whole process; each collection of the oldest generation walked them all, 90-260 ms in the
gateway (gc.callbacks), its event loop and every stream on it stalled meanwhile. Such a
collection comes whenever the survivors grew by a quarter, so a long-running server kept
paying it. ``freeze_startup_heap`` moves them into the permanent generation that no collection
walks; objects made later are collected as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

__all__ = ["Trimmer", "freeze_startup_heap", "trim"]


def freeze_startup_heap() -> None:
    """Collect what loading left behind, then freeze the rest (gc.freeze). Call once a service
    has loaded what it keeps (model, tokenizers, schemas), and again after a later such load."""
    gc.collect()
    gc.freeze()


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


_TRIM = _malloc_trim()


def trim() -> bool:
    """Return free heap pages to the OS now; False where the C library cannot."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class Trimmer:
    """``trim()`` at most every ``every_s`` seconds (it walks the free lists: ~ms on a 300 MB heap)."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self.next_at = 0.0

    def maybe(self, now: float) -> None:
        if now >= self.next_at:
            self.next_at = now + self.every_s
            trim()
