"""Every message of the cluster protocol, one declarative msgspec schema each.

The wire layout, the codec and the rules every decoder enforces are in `common/codec.py`;
the message flow between processes is in docs/architecture.md. Schemas are positional
(`array_like`: a MessagePack array of the fields in declaration order; trailing fields at
their defaults may be left out) because arrays pack and unpack several times faster than
maps. Field types carry their ranges (`Meta`), so msgspec checks them in C on decode;
`check()` holds what one field alone cannot say (lengths that must agree, counts that add
up). Array fields hold numpy arrays of one dtype (`I32`, `F32`, `I32_2D`, `F32_2D`) that
travel as raw little-endian bytes, never as MessagePack lists.

Constructing a message coerces its arrays to the declared dtype and runs `check()`, so a
sender finds its own mistakes where it makes them; decoding runs the same code on what
arrived.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from zeroserve.common.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams
from zeroserve.common.schema import (  # noqa: F401 - the field types are part of the message catalogue
    ARRAY_TYPES,
    F32,
    F32_2D,
    I32,
    I32_2D,
    I64,
    Count,
    ErrorCode,
    FinishReason,
    Message,
    Name,
    Role,
    Seq,
    Stats,
    Text,
    empty_i32,
    json_like,
)

PROTOCOL_VERSION = 2
# an embedding request's pooling of the final-normed hidden states over its prompt: the last
# token's, or the mean of every position's ("" in a Submit: the model's, common/embeddings.py)
Pooling = Literal["last", "mean"]


# ==================================================================== Client <-> scheduler


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """One turn of a conversation, as OpenAI's chat API has it (a map on the wire)."""

    role: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    content: str = ""
    name: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    # tool turns: an assistant message's calls (OpenAI's shape; arguments as JSON text or an
    # object) and a "tool" message's answer to one of them
    tool_calls: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=128)] | None = None
    tool_call_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None

    def __post_init__(self) -> None:
        if self.tool_calls is not None:
            self.tool_calls = json_like(self.tool_calls)


MAX_PING_IDS = 256


ModelDefaultField = Literal[MODEL_DEFAULT_FIELDS]  # the sampling fields a model's generation config may set


class Submit(Message):
    """A request: a text prompt or prompt token ids (the ids win when both are given), or chat
    ``messages`` (the scheduler applies the model's chat template, with the generation prompt)."""

    request_id: Name
    prompt: str | None = None
    prompt_token_ids: I32 | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=1e9)] | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=4096)] | None = None
    # the sampling fields the caller left unset: the model's generation config fills them where
    # it sets them (a client fills this from what its caller gave; empty: params as they are)
    model_defaults: Annotated[list[ModelDefaultField], msgspec.Meta(max_length=16)] = []
    # chat only: OpenAI function definitions the chat template shows the model
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=128)] | None = None
    # "embed": a prefill-only request whose answer is the pooled hidden state of its prompt (one
    # Output with `embedding`, no tokens); its blocks are freed once the prefill has run
    kind: Literal["generate", "embed"] = "generate"
    pooling: Literal["", "last", "mean"] = ""  # embed: "" = the model's pooling

    def check(self) -> str | None:
        if self.kind == "embed" and (self.messages is not None or self.params.n != 1
                                     or self.params.structured_outputs is not None):
            return "an embedding request takes a prompt (text or token ids), n = 1 and no constraint"
        if self.kind != "embed" and self.pooling:
            return "pooling goes with kind embed"
        if self.messages is not None:
            if self.prompt is not None or self.prompt_token_ids is not None:
                return "give chat messages or a prompt, not both"
            if not self.messages:
                return "messages is empty; send at least one chat message"
        elif self.prompt is None and self.prompt_token_ids is None:
            return "give a prompt or prompt_token_ids (or chat messages)"
        if self.tools is not None:
            if self.messages is None:
                return "tools go with chat messages"
            self.tools = json_like(self.tools)
        return None


class Abort(Message):
    request_id: Name


class Ping(Message):
    nonce: int = 0
    # the client's requests no Pong has confirmed yet: the Pong says which of them it does not
    # hold (a scheduler that died between a Submit and its Pong, and came back, lost them)
    request_ids: Annotated[list[Name], msgspec.Meta(max_length=MAX_PING_IDS)] = msgspec.field(default_factory=list)
    term: Seq = 0  # the highest scheduler term this peer has seen (common/failover.py)


class Pong(Message):
    nonce: int
    protocol_version: int = PROTOCOL_VERSION
    scheduler_id: str = ""
    unknown: list[Name] = msgspec.field(default_factory=list)  # of Ping.request_ids
    term: Seq = 0  # the sending scheduler's term: a peer that knows a higher one drops it (common/failover.py)
    standby: bool = False  # a standby answered: it serves nothing while its active lives (go to the next address)


class StatsRequest(Message):
    pass


class StatsReply(Message):
    stats: dict[str, Any] = msgspec.field(default_factory=dict)

    def check(self) -> str | None:
        self.stats = json_like(self.stats)
        return None


class ModelsRequest(Message):
    pass


class MetricsRequest(Message):
    """Ask for the scheduler's Prometheus metrics (the text its --metrics-port serves)."""


class MetricsReply(Message):
    text: str = ""  # Prometheus text exposition format


ModelState = Literal["available", "loading", "loaded", "unloading", "failed"]


class ModelCard(Message):
    id: Name
    max_model_len: Count = 0
    groups: Count = 0  # worker groups ready to serve it
    # the format its tool calls are parsed in (tool_choice auto), from --tool-call-parser or its
    # chat template; "" while its tokenizer loads, or when nothing is recognised
    tool_call_parser: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # the model pool (services/scheduler/pool.py): a model started with --model is "loaded"
    # while a group serves it; a catalog model goes available -> loading -> loaded -> unloading
    state: ModelState = "loaded"
    reason: Text = ""  # failed: why its load failed
    pinned: bool = False
    waiting: Count = 0  # requests queued for a group of it
    parent: Name | None = None  # a LoRA adapter's card: its base model (vLLM's /v1/models field)


class ModelsControl(Message):
    """A client (the gateway's POST /v1/models/load and /unload) asks the pool to load or unload
    a catalog model; answered with a ModelsReply (or an Error naming what is wrong)."""

    action: Literal["load", "unload"]
    model: Name


class ModelsReply(Message):
    models: list[ModelCard] = msgspec.field(default_factory=list)


class LoadLoRA(Message):
    """Serve the PEFT adapter at `path` (as the workers see it) as `name`, for base `model`
    (None: the scheduler's default model). Answered with a LoRAReply."""

    name: Name
    path: Text
    model: Name | None = None


class UnloadLoRA(Message):
    """Stop serving adapter `name` (workers drop it from their slots once no request holds it)."""

    name: Name


class LoRAReply(Message):
    """The answer to LoadLoRA / UnloadLoRA: ok, or `detail` saying what does not fit."""

    name: Name
    ok: bool = True
    detail: Text = ""


class Output(Message):
    """What one completion (``index``) of a request got in one step: deltas only."""

    request_id: Name
    index: Count = 0
    # a plain list: a step's delta is a token or a few, which msgpack packs in a byte each and
    # decodes in C (measured 3x cheaper than an array descriptor per item: benchmarks/codec.py)
    token_ids: list[Count] = msgspec.field(default_factory=list)
    text: str = ""
    logprobs: F32_2D | None = None  # [n, 1+k]: column 0 the sampled token, then the top-k
    logprob_token_ids: I32_2D | None = None
    ranks: I32 | None = None  # the sampled token's rank
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    prompt_token_ids: I32 | None = None  # first chunk of a request only
    num_cached_tokens: Count = 0
    # first chunk only: seconds from the scheduler's receipt of the request to this chunk leaving
    # it (queueing, prefill and the first token inside the cluster; what a client sees on top
    # of it is transport: benchmarks/serve.py tells the gateway's share apart with it)
    first_token_latency: float | None = None
    embedding: F32 | None = None  # an embedding request's answer: the pooled hidden state (not normalised)
    # first chunk only: the request's seed (the caller's, or the one the scheduler drew), so a
    # client re-attaching after a scheduler restart gets the same samples (services/scheduler/adoption.py)
    seed: Seq | None = None

    def check(self) -> str | None:
        if type(self.token_ids) is not list:  # an array or tuple from the sender
            self.token_ids = np.asarray(self.token_ids, np.int64).reshape(-1).tolist()
        n = len(self.token_ids)
        if (self.logprobs is None) != (self.logprob_token_ids is None):
            return "logprobs and logprob_token_ids come together"
        if self.logprobs is not None:
            if self.logprobs.shape != self.logprob_token_ids.shape:
                return f"logprobs shape {self.logprobs.shape} != logprob_token_ids shape {self.logprob_token_ids.shape}"
            if self.logprobs.shape[0] != n or self.logprobs.shape[1] < 1:
                return f"logprobs shape {self.logprobs.shape} does not fit {n} tokens (n_tokens, 1+k)"
        if self.ranks is not None and self.ranks.shape[0] != n:
            return f"ranks has {self.ranks.shape[0]} entries for {n} tokens"
        if self.first_token_latency is not None and not 0.0 <= self.first_token_latency < 1e9:
            return f"first_token_latency {self.first_token_latency} is not a duration in seconds"
        return None


class Outputs(Message):
    items: list[Output] = msgspec.field(default_factory=list)
    term: Seq = 0  # the sending scheduler's term: a peer that knows a higher one drops it (common/failover.py)


MAX_REATTACH_SEQS = 1024  # completions of one re-attached request (SamplingParams caps n lower)


class ResumeSeq(Message):
    """What a client received of one completion before its scheduler died."""

    index: Count = 0
    token_ids: I32 = msgspec.field(default_factory=empty_i32)
    chars: Count = 0  # text characters received (str length)
    finish_reason: FinishReason | None = None  # it had ended


class Reattach(Message):
    """A client's open request, sent again to a scheduler that restarted (or took over): the
    original Submit (under a fresh request id) and what the client received so far. The
    scheduler recomputes the prompt plus those tokens and streams from there: nothing lost or
    repeated. Without ``prompt_token_ids`` (no output had arrived) it is a plain Submit."""

    submit: Submit
    prompt_token_ids: I32 | None = None  # as the first Output reported them
    seed: Seq | None = None  # as the first Output reported it
    seqs: Annotated[list[ResumeSeq], msgspec.Meta(max_length=MAX_REATTACH_SEQS)] = msgspec.field(
        default_factory=list)

    def check(self) -> str | None:
        if self.seqs and self.prompt_token_ids is None:
            return "resumed completions need the prompt_token_ids they continue"
        if len({s.index for s in self.seqs}) != len(self.seqs):
            return "a completion index appears twice"
        return None


class Error(Message):
    request_id: str | None = None
    code: ErrorCode = "internal"
    message: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException, request_id: str | None = None) -> Error:
        return cls(request_id=request_id, code=getattr(exc, "code", "internal"), message=str(exc))

    def to_exception(self) -> Exception:
        from zeroserve.common.errors import error_from_code

        return error_from_code(self.code, self.message)


# ==================================================================== Worker / detokenizer <-> scheduler


class ShardMemory(Message):
    rss_bytes: int = 0
    param_bytes: int = 0
    kv_bytes: int = 0


MAX_KEPT_SEQS = 4096  # sequences a worker reports in one HELLO (services/worker/kept.py)


class KeptSeq(Message):
    """A sequence whose KV a worker still holds after its scheduler went away: the tokens whose
    KV is in the cache (in order) and the blocks holding them. A restarted scheduler puts the
    full blocks in its prefix cache, so a re-attached request continues without recomputing them."""

    token_ids: I32 = msgspec.field(default_factory=empty_i32)
    block_ids: I32 = msgspec.field(default_factory=empty_i32)
    # the LoRA adapter the KV was computed under (NewRequest.lora_path; None: the base model): the
    # blocks join that adapter's prefix chain, never the base model's
    lora_path: Text | None = None


def group_rank(tp_rank: int, tp_size: int, pp_rank: int) -> int:
    """A shard's rank in its group (and the group's torch.distributed world): stage-major, so the
    tensor-parallel shards of one pipeline stage are neighbours and rank 0 is stage 0's tp rank 0."""
    return pp_rank * tp_size + tp_rank


def answering_rank(tp_size: int, pp_size: int) -> int:
    """The group rank that answers steps: tp rank 0 of the last stage (where the sampler runs)."""
    return group_rank(0, tp_size, pp_size - 1)


class Hello(Message, kw_only=True):
    role: Role
    protocol_version: int = PROTOCOL_VERSION  # position 1 in every version: a mismatch is named
    worker_id: Name
    group: str = ""
    tp_rank: Count = 0
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    model: str = ""
    device: str = ""
    host: str = ""
    pid: int = 0
    num_kv_blocks: Count = 0
    block_size: Count = 0
    max_model_len: Count = 0
    dist_init_addr: Text | None = None  # rank 0 of a TP group proposes the torch.distributed address
    # speculative decoding: draft tokens this shard verifies per request per step (0 = off); the
    # policy reserves KV slots for that many lookahead tokens of each decoding request
    num_lookahead_tokens: Annotated[int, msgspec.Meta(ge=0, le=16)] = 0
    memory: ShardMemory = msgspec.field(default_factory=ShardMemory)
    # a pool member (worker --pool): model "" while it holds none; it loads and unloads the
    # catalog models the scheduler asks for within this many bytes (weights + KV)
    pool: bool = False
    memory_budget_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**62)] = 0
    # what the shard computes (services/worker/numerics.py: matmul dtype / kernel build / KV dtype
    # / weight format): groups of one model must compute alike for failover to stay exact
    numeric_mode: Annotated[str, msgspec.Meta(max_length=200)] = ""
    # after a scheduler restart: what this shard's KV cache still holds (services/worker/kept.py)
    kept: Annotated[list[KeptSeq], msgspec.Meta(max_length=MAX_KEPT_SEQS)] = msgspec.field(default_factory=list)
    # LoRA adapter slots (--max-loras; 0 = serves no adapters): the scheduler routes adapter
    # requests only to groups that have some, and runs at most this many adapters at once there
    max_loras: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0
    # pipeline parallelism: the group is pp_size stages of tp_size shards; its rank 0 (stage 0,
    # tp rank 0) proposes dist_init_addr, the last stage's tp rank 0 answers steps. Trailing: a
    # HELLO without them (an older worker) reads as pp=1
    pp_rank: Count = 0
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    term: Seq = 0  # the highest scheduler term this peer has seen (common/failover.py)

    def check(self) -> str | None:
        if self.pool and self.tp_size != 1:
            return "a pool member is one shard (tp_size 1)"
        if not self.tp_rank < self.tp_size:
            return f"tp_rank {self.tp_rank} / tp_size {self.tp_size}: need 0 <= tp_rank < tp_size"
        if not self.pp_rank < self.pp_size:
            return f"pp_rank {self.pp_rank} / pp_size {self.pp_size}: need 0 <= pp_rank < pp_size"
        return None

    @property
    def group_rank(self) -> int:
        return group_rank(self.tp_rank, self.tp_size, self.pp_rank)

    @property
    def group_size(self) -> int:
        return self.tp_size * self.pp_size


WelcomeStatus = Literal["accepted", "refused", "rejoin", "drained"]


class Welcome(Message):
    """accepted: serve (group, step_addr); refused: exit with `detail`; rejoin: the scheduler
    does not know this peer (it restarted: another scheduler_id; or it gave the peer's group
    up: `detail` says why), say HELLO again; drained: leave, work is done."""

    status: WelcomeStatus
    detail: Text = ""
    group: str = ""
    step_addr: Text = ""
    dist_init_addr: Text | None = None
    scheduler_id: str = ""
    protocol_version: int = PROTOCOL_VERSION
    term: Seq = 0  # the sending scheduler's term: a peer that knows a higher one drops it (common/failover.py)
    standby: bool = False  # with status rejoin: a standby answered; say HELLO to the active scheduler

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"


class Heartbeat(Message):
    worker_id: Name
    stats: Stats = msgspec.field(default_factory=dict)
    term: Seq = 0  # the highest scheduler term this peer has seen (common/failover.py)


class Probe(Message):
    probe_id: Name


class ProbeAck(Message):
    worker_id: Name
    probe_id: Name


class NewRequest(Message):
    """A request the worker has not seen: everything it needs to compute and sample it."""

    req_id: Name
    token_ids: I32  # prompt + tokens generated before (after a preemption or failover)
    num_prompt_tokens: Count
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    seed: Seq = 0
    block_ids: I32 = msgspec.field(default_factory=empty_i32)
    num_computed_tokens: Count = 0
    num_scheduled_tokens: Count = 0
    # the LoRA adapter `params.lora` names: its directory, as the scheduler's registry has it
    # (--lora-modules, /v1/load_lora_adapter); the worker loads it into a slot on first use
    lora_path: Text | None = None
    # an embedding request: once its prompt is computed the worker returns this pooling of the
    # final hidden states (StepResult.embeddings) instead of sampling a token
    pooling: Pooling | None = None
    # the first this many tokens' K/V are in the cache already (a prefix-cache hit of every full
    # block): tokens below it that the step computes (the last one, for its logits) write no K/V,
    # so a block other requests share is never written to
    num_cached_kv_tokens: Count = 0

    def check(self) -> str | None:
        if (self.lora_path is None) != (self.params.lora is None):
            return "lora_path comes with params.lora (and only with it)"
        n = self.token_ids.shape[0]
        if self.num_cached_kv_tokens > n:
            return f"num_cached_kv_tokens {self.num_cached_kv_tokens} exceeds the request's {n} tokens"
        if self.num_prompt_tokens > n:
            return f"num_prompt_tokens {self.num_prompt_tokens} not in [0, {n}]"
        if self.num_computed_tokens + self.num_scheduled_tokens > n:
            return (f"num_computed_tokens {self.num_computed_tokens} + num_scheduled_tokens "
                    f"{self.num_scheduled_tokens} > {n} tokens")
        return None


class CachedRequests(Message):
    """Requests the worker holds, columnar: request i's new blocks are
    ``new_block_ids[off_i : off_i + new_block_counts[i]]``."""

    req_ids: list[Name] = msgspec.field(default_factory=list)
    num_computed_tokens: I32 = msgspec.field(default_factory=empty_i32)
    num_scheduled_tokens: I32 = msgspec.field(default_factory=empty_i32)
    new_block_ids: I32 = msgspec.field(default_factory=empty_i32)
    new_block_counts: I32 = msgspec.field(default_factory=empty_i32)

    def check(self) -> str | None:
        r = len(self.req_ids)
        for name in ("num_computed_tokens", "num_scheduled_tokens", "new_block_counts"):
            if getattr(self, name).shape[0] != r:
                return f"{name} has {getattr(self, name).shape[0]} entries for {r} req_ids"
        if r:
            if int(self.new_block_counts.min()) < 0 or int(self.num_scheduled_tokens.min()) < 0 \
                    or int(self.num_computed_tokens.min()) < 0:
                return "new_block_counts, num_scheduled_tokens and num_computed_tokens must be >= 0"
        total = int(self.new_block_counts.sum(dtype=np.int64)) if r else 0
        if total != self.new_block_ids.shape[0]:
            return f"new_block_counts add up to {total}, new_block_ids has {self.new_block_ids.shape[0]}"
        return None

    @classmethod
    def build(cls, req_ids: list[str], num_computed_tokens: Any, num_scheduled_tokens: Any,
              new_block_ids: list[Any]) -> CachedRequests:
        """From per-request values (new_block_ids: one list of ids per request)."""
        counts = np.fromiter((len(b) for b in new_block_ids), np.int32, len(new_block_ids))
        flat = np.fromiter((b for blocks in new_block_ids for b in blocks), np.int32, int(counts.sum()))
        return cls(req_ids=list(req_ids), num_computed_tokens=np.asarray(num_computed_tokens, np.int32),
                   num_scheduled_tokens=np.asarray(num_scheduled_tokens, np.int32), new_block_ids=flat,
                   new_block_counts=counts)

    def blocks_per_request(self) -> list[np.ndarray]:
        """Request i's new block ids, as views into new_block_ids."""
        if not self.req_ids:
            return []
        return np.split(self.new_block_ids, np.cumsum(self.new_block_counts[:-1]))


class Step(Message):
    """One scheduling step of a worker group: built by the policy, run by every shard."""

    seq: Seq
    group: str = ""
    new_reqs: list[NewRequest] = msgspec.field(default_factory=list)
    cached: CachedRequests = msgspec.field(default_factory=CachedRequests)
    finished_req_ids: list[Name] = msgspec.field(default_factory=list)  # the worker drops their state
    # structured outputs: the next-token bitmask of each constrained request that samples in this
    # step (row i for bitmask_req_ids[i]; bit t of word t // 32 set = token t allowed)
    bitmask_req_ids: list[Name] = msgspec.field(default_factory=list)
    token_bitmask: I32_2D | None = None
    # speculative decoding: per cached request (aligned with cached.req_ids), how many draft
    # tokens past its scheduled ones have KV slots reserved (the most it may propose); None = 0
    num_lookahead_tokens: I32 | None = None
    term: Seq = 0  # the sending scheduler's term: a peer that knows a higher one drops it (common/failover.py)

    def check(self) -> str | None:
        rows = 0 if self.token_bitmask is None else self.token_bitmask.shape[0]
        if rows != len(self.bitmask_req_ids):
            return f"token_bitmask has {rows} rows for {len(self.bitmask_req_ids)} bitmask_req_ids"
        la = self.num_lookahead_tokens
        if la is not None:
            if la.shape[0] != len(self.cached.req_ids):
                return f"num_lookahead_tokens has {la.shape[0]} entries for {len(self.cached.req_ids)} cached requests"
            if la.size and (int(la.min()) < 0 or int(la.max()) > 16):
                return "num_lookahead_tokens must be in [0, 16]"
        return None

    def lookahead(self) -> dict[str, int]:
        """req_id -> reserved lookahead tokens (only the requests that have some)."""
        la = self.num_lookahead_tokens
        if la is None:
            return {}
        return {r: n for r, n in zip(self.cached.req_ids, la.tolist()) if n > 0}

    def req_ids(self) -> list[str]:
        """The order of requests in the flat batch (and in the StepResult): cached, then new."""
        return self.cached.req_ids + [n.req_id for n in self.new_reqs]

    def num_scheduled(self) -> dict[str, int]:
        """req_id -> tokens computed this step, in batch order."""
        d = dict(zip(self.cached.req_ids, self.cached.num_scheduled_tokens.tolist()))
        d.update((n.req_id, n.num_scheduled_tokens) for n in self.new_reqs)
        return d

    @property
    def total_tokens(self) -> int:
        return int(self.cached.num_scheduled_tokens.sum()) + sum(n.num_scheduled_tokens for n in self.new_reqs)

    @property
    def empty(self) -> bool:
        return not self.new_reqs and not self.cached.req_ids


class StepResult(Message):
    """Shard 0's answer to a step: one entry per request of the step (-1 = no sample)."""

    seq: Seq
    worker_id: str = ""
    req_ids: list[Name] = msgspec.field(default_factory=list)
    sampled_token_ids: I32 = msgspec.field(default_factory=empty_i32)
    logprob_token_ids: I32_2D | None = None
    logprobs: F32_2D | None = None
    ranks: I32 | None = None
    num_tokens: Count = 0  # tokens computed
    step_time_s: float = 0.0
    # speculative decoding: request i's new tokens are sampled_token_ids[i] and then
    # spec_token_ids[off_i : off_i + num_spec_tokens[i]] (its accepted drafts are all but the
    # last of them, so their KV is computed); num_draft_tokens[i] = tokens it proposed
    spec_token_ids: I32 | None = None
    num_spec_tokens: I32 | None = None
    num_draft_tokens: I32 | None = None
    # embedding requests whose prompt this step completed, and their pooled hidden states (fp32)
    embed_req_ids: list[Name] = msgspec.field(default_factory=list)
    embeddings: F32_2D | None = None

    def check(self) -> str | None:
        r = len(self.req_ids)
        n_emb = 0 if self.embeddings is None else self.embeddings.shape[0]
        if n_emb != len(self.embed_req_ids):
            return f"embeddings has {n_emb} rows for {len(self.embed_req_ids)} embed_req_ids"
        if self.sampled_token_ids.shape[0] != r:
            return f"sampled_token_ids has {self.sampled_token_ids.shape[0]} entries for {r} req_ids"
        spec = (self.spec_token_ids, self.num_spec_tokens, self.num_draft_tokens)
        if any(x is not None for x in spec):
            if any(x is None for x in spec):
                return "spec_token_ids, num_spec_tokens and num_draft_tokens come together"
            if self.num_spec_tokens.shape[0] != r or self.num_draft_tokens.shape[0] != r:
                return f"num_spec_tokens / num_draft_tokens must have {r} entries"
            if r and (int(self.num_spec_tokens.min()) < 0 or int(self.num_draft_tokens.min()) < 0):
                return "num_spec_tokens / num_draft_tokens must be >= 0"
            if (self.num_spec_tokens > self.num_draft_tokens).any():
                return "a request accepted more draft tokens than it proposed"
            if int(self.num_spec_tokens.sum()) != self.spec_token_ids.shape[0]:
                return f"spec_token_ids has {self.spec_token_ids.shape[0]} entries; num_spec_tokens sums to " \
                       f"{int(self.num_spec_tokens.sum())}"
        if (self.logprobs is None) != (self.logprob_token_ids is None):
            return "logprobs and logprob_token_ids come together"
        if self.logprobs is not None and (
                self.logprobs.shape != self.logprob_token_ids.shape or self.logprobs.shape[0] != r):
            return (f"logprobs {self.logprobs.shape} / logprob_token_ids {self.logprob_token_ids.shape} "
                    f"must both be ({r}, 1+k)")
        if self.ranks is not None and self.ranks.shape[0] != r:
            return f"ranks has {self.ranks.shape[0]} entries for {r} req_ids"
        return None


class WorkerError(Message):
    worker_id: Name
    seq: Seq | None = None
    message: str = ""


class Drain(Message):
    worker_id: Name


class Goodbye(Message):
    worker_id: Name
    reason: Text = ""


class Shutdown(Message):
    reason: Text = ""


# a Shutdown whose reason starts with this ended a pool member's model (Unload says so too, on the
# member's own socket; whichever arrives first frees the model), not the worker
UNLOAD_SHUTDOWN = "unload"


class Load(Message):
    """Scheduler -> pool member: free what you hold, then load `model` from `path` (the catalog's
    path, as this worker sees it). Answered with LoadStatus messages, then a HELLO for it."""

    load_id: Name
    model: Name
    path: Text


class Unload(Message):
    """Scheduler -> pool member: free the model (weights and KV), answer LoadStatus "unloaded",
    then say HELLO as an empty member."""

    load_id: Name
    reason: Text = ""


LoadPhase = Literal["loading", "loaded", "failed", "unloaded"]


class LoadStatus(Message):
    """Pool member -> scheduler: a load's (or unload's) progress; `error` says why one failed."""

    worker_id: Name
    load_id: Name
    phase: LoadPhase
    model: str = ""
    error: Text = ""
    elapsed_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e7)] = 0.0
    memory: ShardMemory = msgspec.field(default_factory=ShardMemory)  # after the load or unload

    def check(self) -> str | None:
        if self.phase == "failed" and not self.error:
            return "a failed load says why (error)"
        return None


# ==================================================================== Detokenizer <-> scheduler


class DetokRequest(Message):
    """One sequence to detokenize. After a detokenizer restart the scheduler replays live ones
    with the tokens generated so far and the characters the client already has."""

    req_id: Name
    prompt_token_ids: I32 = msgspec.field(default_factory=empty_i32)
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    output_token_ids: I32 = msgspec.field(default_factory=empty_i32)
    text_offset: Count = 0


class DetokNew(Message):
    items: list[DetokRequest] = msgspec.field(default_factory=list)
    term: Seq = 0  # the sending scheduler's term: a peer that knows a higher one drops it (common/failover.py)


class DetokTokens(Message):
    """New tokens of several sequences, flat: request i's are ``token_ids[off_i : off_i + counts[i]]``;
    a finish reason means "flush, answer, then drop the state"."""

    seq: Seq = 0
    req_ids: list[Name] = msgspec.field(default_factory=list)
    counts: I32 = msgspec.field(default_factory=empty_i32)
    token_ids: I32 = msgspec.field(default_factory=empty_i32)
    finish_reasons: list[FinishReason | None] = msgspec.field(default_factory=list)
    term: Seq = 0  # the sending scheduler's term: a peer that knows a higher one drops it (common/failover.py)

    def check(self) -> str | None:
        r = len(self.req_ids)
        if self.counts.shape[0] != r or len(self.finish_reasons) != r:
            return f"counts ({self.counts.shape[0]}) and finish_reasons ({len(self.finish_reasons)}) need {r} entries"
        if r and int(self.counts.min()) < 0:
            return "counts must be >= 0"
        total = int(self.counts.sum(dtype=np.int64)) if r else 0
        if total != self.token_ids.shape[0]:
            return f"counts add up to {total}, token_ids has {self.token_ids.shape[0]}"
        return None

    @classmethod
    def build(cls, seq: int, req_ids: list[str], token_ids: list[Any],
              finish_reasons: list[str | None] | None = None) -> DetokTokens:
        """From per-request token lists."""
        counts = np.fromiter(map(len, token_ids), np.int32, len(token_ids))
        # one pass over the ids (a step brings each request one or a few): an array per request
        # and a concatenate cost ~3 us a request
        flat = np.fromiter(itertools.chain.from_iterable(token_ids), np.int32, int(counts.sum(dtype=np.int64)))
        return cls(seq=seq, req_ids=list(req_ids), counts=counts, token_ids=flat,
                   finish_reasons=list(finish_reasons) if finish_reasons is not None else [None] * len(req_ids))

    def per_request(self) -> list[np.ndarray]:
        """Request i's new tokens, as views into token_ids."""
        if not self.req_ids:
            return []
        return np.split(self.token_ids, np.cumsum(self.counts[:-1]))


class DetokOutputs(Message):
    """Text deltas for a DetokTokens batch; ``stop_strs[i]`` is the stop string that ended
    request i (its text already truncated) and ``stop_tokens[i]`` how many of request i's ids in
    the batch its output keeps: those up to and including the one that completed the stop
    string (-1 without a stop; an empty list keeps every id)."""

    seq: Seq = 0
    req_ids: list[Name] = msgspec.field(default_factory=list)
    text_deltas: list[str] = msgspec.field(default_factory=list)
    stop_strs: list[str | None] = msgspec.field(default_factory=list)
    stop_tokens: list[Annotated[int, msgspec.Meta(ge=-1)]] = msgspec.field(default_factory=list)

    def check(self) -> str | None:
        r = len(self.req_ids)
        if len(self.text_deltas) != r or len(self.stop_strs) != r:
            return f"text_deltas ({len(self.text_deltas)}) and stop_strs ({len(self.stop_strs)}) need {r} entries"
        if self.stop_tokens and len(self.stop_tokens) != r:
            return f"stop_tokens ({len(self.stop_tokens)}) needs {r} entries"
        return None


class DetokFree(Message):
    req_ids: list[Name] = msgspec.field(default_factory=list)


class Event(Message):
    """Published on the events socket (topic = kind) for monitors and `zeroserve status`."""

    kind: Name
    ts: float = 0.0
    data: dict[str, Any] = msgspec.field(default_factory=dict)

    def check(self) -> str | None:
        self.data = json_like(self.data)
        return None


# every top-level message, by its tag on the wire (the class name); nested-only structs are not
MESSAGE_TYPES: dict[bytes, type[Message]] = {
    cls.__name__.encode(): cls
    for cls in (Submit, Abort, Ping, Pong, StatsRequest, StatsReply, ModelsRequest, ModelsReply, MetricsRequest,
                MetricsReply, LoadLoRA, UnloadLoRA, LoRAReply, Output, Outputs, Reattach,
                Error, Hello, Welcome, Heartbeat, Probe, ProbeAck, Step, StepResult, WorkerError, Drain, Goodbye,
                Shutdown, Load, Unload, LoadStatus, ModelsControl, DetokNew, DetokTokens, DetokOutputs, DetokFree, Event)
}
NESTED_TYPES = (ChatMessage, ModelCard, ResumeSeq, KeptSeq, ShardMemory, NewRequest, CachedRequests, DetokRequest, SamplingParams)
