"""SamplingParams with vLLM's names and semantics, validated at the boundary.

It is a msgspec Struct, so it travels typed inside Submit / NewRequest / DetokRequest (a
MessagePack map of the fields that differ from their defaults) and is validated once, by
msgspec's types on decode plus `validate()` for ranges, wherever it is built or received.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from zeroserve.common.errors import InvalidRequest, ModelLoadError

_GREEDY_EPS = 1e-5
INT32_MAX = 2**31 - 1  # token counts, ids and top_k travel as int32 further down the line
# a constraint's text (schema JSON, regex, grammar, the choices together) is refused above this:
# grammar compilation and its cache grow with it, and a real schema is a few KiB
MAX_CONSTRAINT_BYTES = 256 << 10
MAX_CHOICES = 1024


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """One output constraint, vLLM's `StructuredOutputsParams` (name and shape): exactly one of
    `json` (a JSON Schema, as an object or its JSON text), `regex`, `choice` (one of these
    strings), `grammar` (EBNF / GBNF, as llama.cpp and vLLM take it) or `json_object` (any JSON
    object). Only the form is checked here; whether the schema, regex or grammar compiles is
    checked where the grammar library runs (the scheduler), an InvalidRequest naming the error."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in
                    (None, False))

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"structured_outputs: {msg}")

        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise bad(f"json_object must be true or false, got {self.json_object!r:.100}")
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise bad("give exactly one of json, regex, choice, grammar, json_object"
                      + (f" (got {', '.join(given)})" if given else ""))
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise bad(f"json is not valid JSON text: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise bad(f"json must be a JSON Schema (an object), got {type(schema).__name__}")
            size = len(self.json) if isinstance(self.json, str) else len(json.dumps(schema, default=str))
        elif self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise bad(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings, got {self.choice!r:.200}")
            size = sum(len(c) for c in self.choice)
        elif self.json_object:
            size = 0
        else:
            text = self.regex if self.regex is not None else self.grammar
            if not isinstance(text, str) or not text.strip():
                raise bad(f"{given[0]} must be a non-empty string, got {text!r:.100}")
            size = len(text)
        if size > MAX_CONSTRAINT_BYTES:
            raise bad(f"the {given[0]} constraint is {size} characters; the limit is {MAX_CONSTRAINT_BYTES}")

    def schema_text(self) -> str | None:
        """The JSON schema as JSON text (json only): the grammar cache's key."""
        if self.json is None:
            return None
        return self.json if isinstance(self.json, str) else json.dumps(self.json)  # key order: generation order


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
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
    # the model pool (Ollama's keep_alive): seconds the model stays loaded once idle after this
    # request, for it and later ones that give none (negative: forever); None: the model's own
    keep_alive: float | None = None
    # a LoRA adapter of that model, by name (common/lora.py). Here rather than on Submit: like
    # `model` it says what computes the request, and the params travel with the request wherever
    # it goes (the scheduler's Request, NewRequest, a requeue after failover, the n-way fan-out)
    lora: str | None = None
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (vLLM's name)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):  # keyword arguments, SamplingParams.from_dict
            so = self.structured_outputs
            unknown = sorted(str(k) for k in so if k not in StructuredOutputsParams.__struct_fields__)
            if unknown:
                raise InvalidRequest(f"structured_outputs: unknown field(s) {unknown}; known fields are "
                                     f"{list(StructuredOutputsParams.__struct_fields__)}")
            self.structured_outputs = StructuredOutputsParams(**so)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        """Raise InvalidRequest naming the field and its allowed range (msgspec wraps it on decode)."""

        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"SamplingParams: {msg}")

        def is_int(v: Any, lo: int = 0, hi: int = INT32_MAX) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")

        if not is_int(self.n, 1, 128):
            raise bad(f"n must be an integer in [1, 128], got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            if not is_num(getattr(self, name)):
                raise bad(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not is_int(self.top_k):
            raise bad(f"top_k must be a non-negative integer up to {INT32_MAX} (0 or -1 disables it), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.seed is not None and not is_int(self.seed, 0, 2**63 - 1):
            raise bad(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.stop is not None:
            if (not isinstance(self.stop, list) or len(self.stop) > 64
                    or not all(isinstance(s, str) and 0 < len(s) <= 1024 for s in self.stop)):
                raise bad("stop must be a non-empty string or a list of at most 64 non-empty strings of up to 1024 "
                          f"characters, got {self.stop!r:.200}")
        if self.stop_token_ids is not None:
            if (not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > 1024
                    or not all(is_int(t) for t in self.stop_token_ids)):
                raise bad(f"stop_token_ids must be a list of at most 1024 non-negative token ids up to {INT32_MAX}, "
                          f"got {self.stop_token_ids!r:.200}")
        if self.max_tokens is not None and not is_int(self.max_tokens, 1):
            raise bad(f"max_tokens must be an integer >= 1 and <= {INT32_MAX} (or None), got {self.max_tokens!r}")
        if not is_int(self.min_tokens):
            raise bad(f"min_tokens must be an integer >= 0 and <= {INT32_MAX}, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not is_int(self.logprobs, 0, 20):
            raise bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.model is not None and not (isinstance(self.model, str) and len(self.model) <= 256):
            raise bad(f"model must be a string of at most 256 characters, got {self.model!r:.100}")
        if self.keep_alive is not None and not is_num(self.keep_alive):
            raise bad(f"keep_alive must be a number of seconds (negative: forever), got {self.keep_alive!r:.100}")
        if self.lora is not None and not (isinstance(self.lora, str) and 0 < len(self.lora) <= 256):
            raise bad(f"lora must be an adapter's name (1 to 256 characters), got {self.lora!r:.100}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs must be a StructuredOutputsParams or a dict of its fields, got "
                      f"{type(self.structured_outputs).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """Every field (lists copied), for JSON and for building a modified copy."""
        d = {k: (list(v) if isinstance(v, list) else v) for k, v in msgspec.structs.asdict(self).items()}
        if self.structured_outputs is not None:
            d["structured_outputs"] = msgspec.to_builtins(self.structured_outputs)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> SamplingParams:
        """Build from an untrusted mapping (JSON, keyword arguments); unknown keys are an error."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise InvalidRequest(f"SamplingParams: expected a mapping, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in cls.__struct_fields__)
        if unknown:
            raise InvalidRequest(f"SamplingParams: unknown field(s) {unknown}; known fields are "
                                 f"{sorted(cls.__struct_fields__)}")
        return cls(**d)


# ------------------------------------------------------------------------------------------------
# The model's sampling defaults (generation_config.json), for fields a request leaves unset
# ------------------------------------------------------------------------------------------------

# The fields a model may default, as vLLM takes them from a generation config.
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
_FROM_HF = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# a generation_config.json that spells out transformers' own default says nothing about the
# model (vLLM reads the file's difference from those defaults)
_HF_OWN_DEFAULTS = {"top_k": 50, "temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0}
_FROM_GGUF = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


def check_defaults(out: dict[str, Any], source: str) -> dict[str, Any]:
    """`out` if SamplingParams accepts every value; else ModelLoadError naming `source`, the field
    and the way around it (the scheduler and LLM check when they start; workers never read them)."""
    try:
        SamplingParams(**out, min_tokens=0)
    except (InvalidRequest, TypeError) as e:
        raise ModelLoadError(f"{source}: a sampling default is out of range: {str(e).removeprefix('SamplingParams: ')}"
                             " (serve without the model's defaults: --generation-config none)") from None
    return out


def defaults_from_generation_config(gen: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults a parsed generation_config.json sets (our field names), unchecked."""
    return {ours: gen[hf] for hf, ours in _FROM_HF.items()
            if gen.get(hf) is not None and not (hf in _HF_OWN_DEFAULTS and gen[hf] == _HF_OWN_DEFAULTS[hf])}


def defaults_from_gguf(meta: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults of a GGUF's `general.sampling.*` metadata (llama.cpp's keys), unchecked."""
    return {ours: meta[k] for k, ours in _FROM_GGUF.items() if meta.get(k) is not None}


def with_model_defaults(params: SamplingParams, fields: Any, defaults: dict[str, Any]) -> SamplingParams:
    """`params` with `fields` (those the caller left unset) taken from the model's `defaults`
    where it has them. A new object when anything changes; `params` itself is never modified."""
    pick = {k: defaults[k] for k in fields if k in defaults}
    if not pick:
        return params
    d = params.to_dict()
    d.update(pick)
    if d["max_tokens"] is not None and d["min_tokens"] > d["max_tokens"]:
        d["max_tokens"] = d["min_tokens"]  # the caller's min_tokens outranks a model default
    return SamplingParams(**d)


def with_lora(params: SamplingParams, lora: str | None) -> SamplingParams:
    """`params` for LoRA adapter `lora` (None: the base model): a copy when that changes anything."""
    if params.lora == lora:
        return params
    return SamplingParams(**{**params.to_dict(), "lora": lora})


def unset_fields(params: Any) -> tuple[str, ...]:
    """Which model-defaultable fields a caller's `params` leaves unset: all for None, those a
    dict does not name, none for a SamplingParams (it is used as given, as in vLLM)."""
    if params is None:
        return MODEL_DEFAULT_FIELDS
    if isinstance(params, dict):
        return tuple(k for k in MODEL_DEFAULT_FIELDS if k not in params)
    return ()
