"""Request bodies of the OpenAI-compatible API (OpenAI's and vLLM's field names), as pydantic
models, and their translation into `SamplingParams`. FastAPI validates bodies with them; a
wrong field becomes a 400 whose message names it."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from zeroserve.common.catalog import FOREVER, parse_keep_alive

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.log import LogBudget, get_logger
from zeroserve.common.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams, StructuredOutputsParams
from zeroserve.common.tools import ToolSpec, check_tools

NonNegInt = Annotated[int, Field(ge=0)]
log = get_logger("gateway")
_IGNORED_LOG = LogBudget("request fields ignored")
# unknown fields that would constrain the answer: a 400 rather than a silently free answer
_REFUSED = {"functions": "send tools (OpenAI's successor of functions)",
            "function_call": "send tool_choice (OpenAI's successor of function_call)",
            "logits_processors": "this server runs no custom logits processors"}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced exactly, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object, json_schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"json_object": True}
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidRequest("response_format: type json_schema needs json_schema.schema (a JSON Schema)")
        return {"json": self.json_schema.schema_}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields completions and chat share. Unknown fields are ignored with a logged warning (as
    vLLM does), so SDKs that send newer fields still work."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    keep_alive: str | float | None = None  # the model pool: Ollama's keep_alive ("5m", seconds, -1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N" (vLLM)
    # constrained decoding: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (one of them per request)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's one output constraint, from whichever field gave it."""
        given = {}
        if self.response_format is not None:
            c = self.response_format.constraint()
            if c is not None:
                given["response_format"] = c
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for name in ("json", "regex", "choice", "grammar"):
            v = getattr(self, "guided_" + name)
            if v is not None:
                given["guided_" + name] = {name: v}
        if len(given) > 1:
            raise InvalidRequest(f"give one output constraint, not {' and '.join(given)}")
        if not given:
            return None
        (field, spec), = given.items()
        unknown = sorted(set(spec) - set(StructuredOutputsParams.__struct_fields__))
        if unknown:
            raise InvalidRequest(f"{field}: unknown field(s) {unknown}; known: "
                                 f"{list(StructuredOutputsParams.__struct_fields__)}")
        try:
            return StructuredOutputsParams(**spec)
        except InvalidRequest as e:
            raise InvalidRequest(f"{field}: {str(e).removeprefix('structured_outputs: ')}") from None

    def warn_ignored(self) -> None:
        """Fields this server does not know are accepted and ignored, with a warning (vLLM's rule),
        except those whose loss would change the answer's kind: refused, naming the way."""
        extra = self.model_extra
        for name, use in _REFUSED.items():
            if extra and name in extra:
                raise InvalidRequest(f"{name} is not supported: {use}")
        if extra and _IGNORED_LOG.allow(time.monotonic()):
            log.warning("request fields ignored: this server does not know them", fields=sorted(extra)[:32])

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of is not supported (it must equal n)")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream: true")
        kw: dict[str, Any] = {"n": self.n, "max_tokens": max_tokens, "min_tokens": self.min_tokens,
                              "ignore_eos": self.ignore_eos, "seed": self.seed, "logprobs": logprobs,
                              "include_stop_str_in_output": self.include_stop_str_in_output,
                              "skip_special_tokens": self.skip_special_tokens, "model": self.model or None,
                              "structured_outputs": self.constraint()}
        if self.keep_alive is not None:
            ka = parse_keep_alive(self.keep_alive)
            kw["keep_alive"] = -1.0 if ka == FOREVER else ka
        self.warn_ignored()
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        if self.stop:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        try:
            return SamplingParams(**kw)
        except InvalidRequest as e:  # "SamplingParams: top_p must be ..." -> the field's own name
            raise InvalidRequest(str(e).removeprefix("SamplingParams: ")) from None

    def model_defaults(self) -> list[str]:
        """The sampling fields this body leaves unset: the model's generation config fills them
        (as vLLM's server does), the rest of the unset ones keep SamplingParams' defaults."""
        return [k for k in MODEL_DEFAULT_FIELDS
                if (self._limit_unset() if k == "max_tokens" else getattr(self, k) is None)]

    def _limit_unset(self) -> bool:
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far in every chunk (vLLM's stream_options.continuous_usage_stats, with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("prompt is empty; send some text or token ids")
        if isinstance(p[0], int):  # validated as one member of the union: every item is alike
            return [p]
        return list(p)

    def _limit_unset(self) -> bool:
        return self.max_tokens is None  # as vLLM: a body without one gets OpenAI's 16; null takes the model's

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise InvalidRequest("suffix is not supported by this server")
        if self.echo and self.logprobs is not None:
            raise InvalidRequest("echo together with logprobs is not supported (no prompt logprobs)")
        return self._params(self.max_tokens, self.logprobs)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a "tool" turn: the call it answers

    def plain(self) -> dict[str, Any]:
        c = self.content
        text = "" if c is None else c if isinstance(c, str) else "".join(part.text for part in c)
        d: dict[str, Any] = {"role": self.role, "content": text}
        for k in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: NonNegInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def _limit_unset(self) -> bool:
        return self.max_completion_tokens is None and self.max_tokens is None

    def tool_spec(self) -> ToolSpec | None:
        return check_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def sampling_params(self) -> SamplingParams:
        """Without the tools' constraint: the client adds it (AsyncClient.chat / stream_chat)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(limit, (self.top_logprobs or 0) if self.logprobs else None)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True


class ModelControlRequest(BaseModel):
    """POST /v1/models/load and /v1/models/unload (llama.cpp's router mode and Ollama name it so)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[NonNegInt]


class LoadLoRARequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body): serve the adapter at `lora_path` as `lora_name`."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str
    model: str | None = None  # the base model (default: the cluster's first)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
