"""The model catalog: every model a cluster may load on demand, and a bounded per-model cache.

A catalog comes from a models directory (every ``.gguf`` file and every HF directory in it is a
model, named as a model given with ``--model`` is named: ``ModelConfig.name``) and/or a small
TOML file::

    keep_alive = "5m"            # default for every model (Ollama's meaning, below)
    models_dir = "/models"       # optional: scanned as --models-dir is

    [models.chat]                # the key is the name requests use
    path = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    pinned = true                # loaded while a pool member is free, never evicted
    keep_alive = -1
    max_groups = 2               # pool members it may hold at once

The scheduler, the detokenizer and the gateway read it alike, so a name means the same model
everywhere. A model whose config cannot be read is still listed, with the reason: its requests
fail with ``ModelLoadError`` naming it, and nothing else is disturbed.

keep_alive (Ollama's): how long a model stays loaded after its last request; a duration
("30s", "5m", "1h", "1h30m"), a number of seconds, 0 (unload as soon as it is idle) or a
negative value (never unload for idleness).
"""

from __future__ import annotations

import re
import tomllib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from zeroserve.common.errors import InvalidRequest, ModelLoadError
from zeroserve.common.model_config import ModelConfig, resolve_model_path

DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default, five minutes
MAX_CATALOG_TOKENIZERS = 8  # catalog models whose tokenizer a process keeps (scheduler, detokenizer)
FOREVER = float("inf")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(v: Any, where: str = "keep_alive") -> float:
    """Seconds a model stays loaded when idle (FOREVER for a negative value)."""
    if isinstance(v, bool):
        raise InvalidRequest(f"{where}: expected a duration or seconds, got {v!r}")
    if isinstance(v, (int, float)):
        return FOREVER if v < 0 else float(v)
    if isinstance(v, str):
        s = v.strip()
        try:
            return parse_keep_alive(float(s), where)
        except ValueError:
            pass
        neg = s.startswith("-")
        body = s[1:] if neg else s
        parts = _DURATION.findall(body)
        if parts and "".join(n + u for n, u in parts) == body:
            return FOREVER if neg else sum(float(n) * _UNIT_S[u] for n, u in parts)
    raise InvalidRequest(f"{where}: expected a duration like \"30s\", \"5m\", \"1h30m\", seconds, or a negative "
                         f"value for forever; got {v!r}")


@dataclass
class CatalogEntry:
    name: str
    path: str
    pinned: bool = False
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    max_groups: int = 1
    config: Any = None  # its ModelConfig; None when it could not be read
    error: str = ""  # why the config could not be read
    weight_bytes: int = 0  # on disk: what a pool member's --memory-budget must hold, besides its KV cache


WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin")


def weight_bytes_on_disk(path: str | Path) -> int:
    """The bytes of a model's weight files (a .gguf, or an HF folder's safetensors)."""
    kind, p = resolve_model_path(path)
    if kind == "gguf" or p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in Path(p).iterdir() if f.suffix in WEIGHT_SUFFIXES)


def _looks_like_model(p: Path) -> bool:
    if p.name.startswith("."):
        return False
    if p.is_file():
        return p.suffix.lower() == ".gguf"
    return p.is_dir() and ((p / "config.json").is_file() or any(p.glob("*.gguf")))


def _entry(path: Path, name: str | None = None, **opts: Any) -> CatalogEntry:
    try:
        cfg = ModelConfig.from_dir(str(path))
        size = weight_bytes_on_disk(path)
    except (ModelLoadError, OSError, ValueError) as e:
        return CatalogEntry(name or path.stem, str(path), config=None, error=str(e), **opts)
    return CatalogEntry(name or cfg.name, str(path), config=cfg, weight_bytes=size, **opts)


def scan_dir(models_dir: str | Path, keep_alive_s: float = DEFAULT_KEEP_ALIVE_S) -> list[CatalogEntry]:
    d = Path(models_dir)
    if not d.is_dir():
        raise InvalidRequest(f"--models-dir {str(d)!r} is not a directory")
    return [_entry(p, keep_alive_s=keep_alive_s) for p in sorted(d.iterdir()) if _looks_like_model(p)]


_MODEL_KEYS = {"path", "pinned", "keep_alive", "max_groups"}


def read_config(path: str | Path) -> list[CatalogEntry]:
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InvalidRequest(f"--models-config {str(p)!r}: {e}") from None
    unknown = set(raw) - {"keep_alive", "models_dir", "models"}
    if unknown:
        raise InvalidRequest(f"--models-config {str(p)!r}: unknown key(s) {sorted(unknown)}")
    default_ka = parse_keep_alive(raw.get("keep_alive", DEFAULT_KEEP_ALIVE_S), f"{p}: keep_alive")
    out = scan_dir(p.parent / raw["models_dir"], default_ka) if "models_dir" in raw else []
    for name, m in (raw.get("models") or {}).items():
        where = f"{p}: models.{name}"
        if not isinstance(m, dict) or "path" not in m or set(m) - _MODEL_KEYS:
            raise InvalidRequest(f"{where}: give path (and optionally {sorted(_MODEL_KEYS - {'path'})}), got {m!r}")
        mg = m.get("max_groups", 1)
        if not isinstance(mg, int) or isinstance(mg, bool) or mg < 1:
            raise InvalidRequest(f"{where}: max_groups must be a positive integer, got {mg!r}")
        out = [e for e in out if e.name != name]
        out.append(_entry(p.parent / m["path"], name, pinned=bool(m.get("pinned", False)), max_groups=mg,
                          keep_alive_s=parse_keep_alive(m.get("keep_alive", default_ka), f"{where}.keep_alive")))
    return out


def load_catalog(models_dir: str | None, config: str | None,
                 keep_alive_s: float = DEFAULT_KEEP_ALIVE_S) -> dict[str, CatalogEntry]:
    """The catalog by name: the directory's models, then the config file's (which win)."""
    entries = scan_dir(models_dir, keep_alive_s) if models_dir else []
    if config:
        entries += read_config(config)
    return {e.name: e for e in entries}


K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """Per-model objects that are costly to make (tokenizers, grammar compilers), made on first
    use and kept for the `capacity` most recently used models; `keep` names those never dropped
    (the models given with --model). A catalog of hundreds of models costs `capacity` of them."""

    def __init__(self, make: Callable[[K], V], capacity: int = 8, keep: frozenset = frozenset()) -> None:
        self.make, self.capacity, self.keep = make, max(1, capacity), keep
        self.items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V:
        v = self.items.get(key)
        if v is None:
            v = self.items[key] = self.make(key)
        self.items.move_to_end(key)
        over = len(self.items) - self.capacity - len(self.keep)
        for k in [k for k in self.items if k not in self.keep and k != key][:max(0, over)]:
            del self.items[k]
        return v

    def __contains__(self, key: K) -> bool:
        return key in self.items

    def __len__(self) -> int:
        return len(self.items)


__all__ = ["BoundedCache", "CatalogEntry", "DEFAULT_KEEP_ALIVE_S", "FOREVER", "MAX_CATALOG_TOKENIZERS", "load_catalog", "parse_keep_alive",
           "read_config", "scan_dir", "weight_bytes_on_disk"]
