"""SamplingParams with vLLM's names and semantics, validated at the boundary."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from common.errors import InvalidRequest

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per token, plus the chosen token
    skip_special_tokens: bool = True
    model: str | None = None  # which served model; None = the only/default one
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"SamplingParams: {msg}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")

        if not is_int(self.n) or self.n < 1 or self.n > 128:
            raise bad(f"n must be an integer in [1, 128], got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            if not is_num(getattr(self, name)):
                raise bad(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad(f"top_k must be a non-negative integer (0 or -1 disables it), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
                raise bad(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
                raise bad(f"stop_token_ids must be a list of non-negative token ids, got {self.stop_token_ids!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise bad(f"model must be a string, got {self.model!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "SamplingParams":
        """Build from an untrusted mapping (wire, JSON); unknown keys are an error."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise InvalidRequest(f"SamplingParams: expected a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise InvalidRequest(f"SamplingParams: unknown field(s) {unknown}; known fields are {sorted(known)}")
        try:
            return cls(**d)
        except TypeError as e:  # wrong types that slip past __init__
            raise InvalidRequest(f"SamplingParams: {e}") from None
