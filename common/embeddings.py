"""Embeddings, shared by the scheduler, the clients and the gateway: which pooling a model uses,
and how a pooled hidden state becomes the vector a caller gets.

A worker returns the pooled final-normed hidden state as computed (fp32, not normalised); the
caller's side normalises it (L2, as OpenAI's embeddings are) after an optional truncation to
`dimensions` (OpenAI's way for Matryoshka-trained models: keep the first k, normalise again).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np

from zeroserve.common.errors import InvalidRequest

POOLINGS = ("last", "mean")


def model_pooling(model_path: str | Path | None, flag: str = "auto") -> str:
    """The pooling of a model's embedding requests: `flag` (--pooling) unless "auto"; else what a
    sentence-transformers export in the model's directory says (1_Pooling/config.json); else
    "last", what decoder-only embedding models (e5-mistral, Qwen3-Embedding, GritLM) pool by."""
    if flag != "auto":
        if flag not in POOLINGS:
            raise InvalidRequest(f"pooling must be auto, last or mean, got {flag!r}")
        return flag
    if model_path is not None:
        cfg = Path(model_path) / "1_Pooling" / "config.json"
        try:
            modes = json.loads(cfg.read_text())
        except (OSError, ValueError):
            modes = {}
        if modes.get("pooling_mode_mean_tokens"):
            return "mean"
    return "last"


def finish_embedding(vec: Any, dimensions: int | None = None, normalize: bool = True) -> np.ndarray:
    """A pooled hidden state as a caller's vector: the first `dimensions` components (all when
    None), L2-normalised unless `normalize` is false."""
    v = np.asarray(vec, np.float32).reshape(-1)
    if dimensions is not None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= v.shape[0]:
            raise InvalidRequest(f"dimensions must be an integer in [1, {v.shape[0]}] (the model's hidden size), "
                                 f"got {dimensions!r:.40}")
        v = v[:dimensions]
    if normalize:
        norm = float(np.linalg.norm(v.astype(np.float64)))
        if norm > 0:
            v = (v / norm).astype(np.float32)
    return v


def base64_vector(v: np.ndarray) -> str:
    """OpenAI's encoding_format base64: the little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii")


def request_pooling(pooling: str | None) -> str:
    """A request's pooling as a Submit carries it: "last" or "mean", or "" for the model's (None
    too); anything else is refused here, before the request is sent."""
    if pooling not in (None, "", *POOLINGS):
        raise InvalidRequest(f"pooling must be last or mean (or unset: the model's), got {pooling!r:.40}")
    return pooling or ""
