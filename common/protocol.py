"""Cluster wire protocol: one declarative schema per message, one encoder, validation on decode.

Wire format
-----------
A message is a multipart ZeroMQ message::

    [type tag][msgpack body][raw buffer 0][raw buffer 1]...

* ``type tag``: ASCII class name (``b"Step"``); see ``MESSAGE_TYPES``.
* ``body``: a msgpack array of the schema's fields in declaration order (exactly that many;
  nested structs are arrays too). Positional, not a map: msgpack maps cost ~10x more to pack
  and unpack than arrays (measured: 256 Outputs decode in ~0.7 ms instead of ~3 ms), field
  names still appear in every error, and layout changes bump ``PROTOCOL_VERSION``.
* Arrays (token ids, block ids, logprobs) are never msgpack lists. The body holds a
  descriptor ``[dtype code, shape, ref]`` where ``dtype code`` is one of ``DTYPE_CODES``
  (int32=1, int64=2, float32=3; always little-endian), ``shape`` a list of 1 or 2 ints, and
  ``ref`` either an int (the index of a raw buffer frame after the body) or a msgpack ``bin``
  holding the raw bytes inline. The encoder inlines arrays up to ``INLINE_ARRAY_MAX_BYTES``
  (16 KiB) and sends bigger ones as separate frames, zero-copy. A one-token delta is not worth
  a ZeroMQ frame of its own (pyzmq copies frames under 64 KiB anyway, and each frame costs a
  few microseconds; a 256-request step went from 258 frames to 2 and got faster end to end).
  The decoder rebuilds numpy arrays with ``np.frombuffer`` (zero-copy, **read-only**: copy
  before mutating) after checking that the dtype is the field's, ``ndim`` is the field's and
  ``prod(shape) * itemsize == len(buffer)``. Every buffer frame must be referenced exactly
  once.
* No pickle, no msgpack ``ext`` types (rejected), strings are UTF-8 (``raw=False``), map keys
  are strings, ``dict`` fields hold JSON-like values only (nil, bool, int, float, str, lists,
  str-keyed maps; depth <= 32), and a message whose frames add up to more than
  ``max_message_size`` (64 MiB by default) is refused before it is unpacked (msgpack's own
  length limits are then bounded by the body size, so no declared length can allocate more).
* Each struct may have a ``_check`` for cross-field invariants (array lengths that must
  agree, counts that must add up, ranks in range); the receiver runs it, the sender does not.

``decode`` raises ``ProtocolError`` (an ``InvalidRequest``, code ``invalid_request``) with a
readable reason on *any* problem and never anything else. ``encode`` raises ``ProtocolError``
for a value it cannot put on the wire. Numpy scalars are accepted wherever Python numbers are.

Message catalogue (``PROTOCOL_VERSION = 1``)
--------------------------------------------
Arrays are written ``i32[n]`` (int32, 1-D) / ``f32[n, k]`` (float32, 2-D).

Client (DEALER) <-> scheduler (ROUTER)
    Submit(request_id: str, prompt: str|None, prompt_token_ids: i32[n]|None, params: dict,
           stream: bool, timeout_s: float|None)           client -> scheduler
        ``params`` (here, in NewRequest and DetokRequest) is ``encode_params(sp)``: the
        SamplingParams fields that differ from their defaults (a full ``to_dict()`` is valid
        too); read it with ``decode_params``. At least one of prompt / prompt_token_ids.
    Abort(request_id: str)                                client -> scheduler
    Ping(nonce: int) -> Pong(nonce: int, protocol_version: int, scheduler_id: str)
    StatsRequest() -> StatsReply(stats: dict)
    ModelsRequest() -> ModelsReply(models: list[dict])
    Output(request_id: str, index: int, token_ids: i32[n] (delta), text: str (delta),
           logprobs: f32[n, 1+k]|None, logprob_token_ids: i32[n, 1+k]|None, ranks: i32[n]|None,
           finish_reason: str|None, stop_reason: str|int|None,
           prompt_token_ids: i32[p]|None (first chunk only), num_cached_tokens: int)
        logprob column 0 is the sampled token, columns 1.. the top-k; ``ranks`` is the sampled
        token's rank. ``index`` is the completion index (n > 1).
    Outputs(items: list[Output])                          scheduler -> client, one per step
    Error(request_id: str|None, code: str, message: str)  any direction; ``code`` is a
        ``common.errors`` code (invalid_request, overloaded, timeout, unavailable, internal...)

Worker / detokenizer (DEALER) <-> scheduler (ROUTER); scheduler PUB -> worker SUB (topic = group)
    Hello(role: "worker"|"detokenizer", protocol_version: int, worker_id: str, group: str,
          tp_rank: int, tp_size: int, model: str, device: str, host: str, pid: int,
          num_kv_blocks: int, block_size: int, max_model_len: int, memory: dict)
        -> Welcome(accepted: bool, reason: str, group: str, step_addr: str,
                   dist_init_addr: str|None, scheduler_id: str, protocol_version: int)
        ``step_addr`` is the scheduler's step PUB address the shard subscribes to.
        The version is checked by the scheduler with ``check_version`` (so it can answer with
        a reason); a detokenizer sends tp_rank=0, tp_size=1 and zeros for the KV fields.
    Heartbeat(worker_id: str, stats: dict)                worker -> scheduler
    Probe(probe_id: str)                                  scheduler PUB, group topic
    ProbeAck(worker_id: str, probe_id: str)               worker -> scheduler (its SUB got it)
    Step(seq: int, group: str, new_reqs: list[NewRequest], cached_reqs: CachedRequests,
         finished_req_ids: list[str])                     scheduler PUB, group topic
      NewRequest(req_id: str, token_ids: i32[n], num_prompt_tokens: int, params: dict,
                 seed: int, block_ids: i32[b], num_computed_tokens: int,
                 num_scheduled_tokens: int)
      CachedRequests(req_ids: list[str], num_computed_tokens: i32[r],
                     num_scheduled_tokens: i32[r], new_block_ids_flat: i32[sum(counts)],
                     new_block_counts: i32[r], resync_tokens: dict[str, i32[m]])
        request i's new blocks are ``new_block_ids_flat[off_i : off_i + new_block_counts[i]]``
        (``new_block_ids()`` splits them); ``resync_tokens[req_id]`` are tokens the worker
        lacks (appended to its copy before computing).
    StepResult(seq: int, worker_id: str, req_ids: list[str], sampled_token_ids: i32[r],
               logprob_token_ids: i32[r, 1+k]|None, logprobs: f32[r, 1+k]|None,
               ranks: i32[r]|None, step_time_s: float)  shard 0 -> scheduler (-1 = no sample)
    WorkerError(worker_id: str, seq: int|None, message: str)   worker -> scheduler
    Drain(worker_id: str)        worker -> scheduler: "stop giving my group new requests"
    Goodbye(worker_id: str, reason: str)                  worker -> scheduler, leaving now
    Shutdown(reason: str)                                 scheduler PUB: stop and exit

Detokenizer (DEALER) <-> scheduler (ROUTER); one message each way per step
    DetokNew(items: list[DetokRequest])                   scheduler -> detokenizer
      DetokRequest(req_id: str, prompt_token_ids: i32[p], params: dict,
                   output_token_ids: i32[o], text_offset: int)
        ``req_id`` names one sequence (the scheduler gives each of n > 1 completions its own).
        A fresh request has empty output_token_ids and text_offset 0; after a detokenizer
        restart the scheduler replays live requests with the tokens generated so far and the
        number of characters already sent, so streams continue without loss or repeats.
    DetokTokens(seq: int, req_ids: list[str], counts: i32[r], token_ids: i32[sum(counts)],
                finish_reasons: list[str|None])           scheduler -> detokenizer
        Request i's new tokens are ``token_ids[off_i : off_i + counts[i]]``; a finish reason
        means "flush, answer, then drop the state".
    DetokOutputs(seq: int, req_ids: list[str], text_deltas: list[str],
                 stop_strs: list[str|None])               detokenizer -> scheduler
        ``stop_strs[i]`` is the stop string that ended request i (text already truncated).
    DetokFree(req_ids: list[str])                         scheduler -> detokenizer (aborted)

Events: Event(kind: str, ts: float, data: dict)           scheduler PUB (status CLI, monitors)

PUB/SUB frames are ``[topic][type][body][buffers...]`` (``encode_pub``/``decode_pub``). SUB
filtering is by prefix, so ``group_topic(name)`` ends the topic with a NUL byte: group "g1"
does not receive "g10"'s steps.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

import msgpack
import numpy as np

from common.errors import InvalidRequest

PROTOCOL_VERSION = 1
MAX_MESSAGE_SIZE = 64 * 1024 * 1024  # bytes, all frames together
INLINE_ARRAY_MAX_BYTES = 16 * 1024  # arrays up to this size travel inside the body (msgpack bin)
_MAX_JSON_DEPTH = 32

__all__ = [
    "DTYPE_CODES",
    "F32",
    "F32_2D",
    "I32",
    "I32_2D",
    "I64",
    "INLINE_ARRAY_MAX_BYTES",
    "MAX_MESSAGE_SIZE",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "Abort",
    "Array",
    "CachedRequests",
    "DetokFree",
    "DetokNew",
    "DetokOutputs",
    "DetokRequest",
    "DetokTokens",
    "Drain",
    "Error",
    "Event",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "ModelsReply",
    "ModelsRequest",
    "NewRequest",
    "Output",
    "Outputs",
    "Ping",
    "Pong",
    "Probe",
    "ProbeAck",
    "ProtocolError",
    "Shutdown",
    "StatsReply",
    "StatsRequest",
    "Step",
    "StepResult",
    "Submit",
    "Welcome",
    "WorkerError",
    "check_version",
    "decode",
    "decode_params",
    "decode_pub",
    "empty_i32",
    "encode",
    "encode_params",
    "encode_pub",
    "group_topic",
    "messages_equal",
]


class ProtocolError(InvalidRequest):
    """A message could not be encoded or decoded; ``reason`` says why.

    ``identity`` is set by the transport to the ROUTER identity (or SUB topic) of the peer
    that sent the bad message, so a service can answer it with an ``Error``.
    """

    code = "invalid_request"

    def __init__(self, reason: str, identity: bytes | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.identity = identity


# --------------------------------------------------------------------------------------------
# Arrays
# --------------------------------------------------------------------------------------------

DTYPE_CODES: dict[int, np.dtype] = {1: np.dtype("<i4"), 2: np.dtype("<i8"), 3: np.dtype("<f4")}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}


@dataclass(frozen=True)
class Array:
    """Schema marker: a numpy array field of one dtype and 1 or 2 dimensions."""

    dtype: Any
    ndim: int = 1

    def __post_init__(self) -> None:
        dt = np.dtype(self.dtype).newbyteorder("<")
        if dt not in _CODE_OF:
            raise TypeError(f"Array dtype must be one of {sorted(str(d) for d in _CODE_OF)}, got {dt}")
        if self.ndim not in (1, 2):
            raise TypeError("Array ndim must be 1 or 2")
        object.__setattr__(self, "dtype", dt)


I32 = Annotated[np.ndarray, Array(np.int32)]
I64 = Annotated[np.ndarray, Array(np.int64)]
F32 = Annotated[np.ndarray, Array(np.float32)]
I32_2D = Annotated[np.ndarray, Array(np.int32, ndim=2)]
F32_2D = Annotated[np.ndarray, Array(np.float32, ndim=2)]


def empty_i32() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


# --------------------------------------------------------------------------------------------
# Schema compilation. Every field type becomes a _Codec: an encoder (None: the value goes to
# msgpack as it is), a decoder that validates (raising _Bad) and converts, and for plain
# scalars an inline test. Each struct then gets a generated encoder (a tuple of its fields)
# and decoder (inline scalar tests, calls for the rest): the happy path runs no generic loop.
# --------------------------------------------------------------------------------------------


class _Bad(Exception):
    """Internal: a value does not fit its schema; containers add their path on the way up."""

    def __init__(self, msg: str) -> None:
        self.msg = msg
        self.path: list[str] = []


def _tn(v: Any) -> str:
    if v is None:
        return "nil"
    t = type(v)
    return {str: "str", int: "int", float: "float", bool: "bool", bytes: "bytes", list: "list", dict: "map"}.get(
        t, t.__name__
    )


class _DecodeCtx:
    __slots__ = ("bufs", "used")

    def __init__(self, bufs: list) -> None:
        self.bufs = bufs
        self.used = [False] * len(bufs)

    def take(self, i: Any) -> memoryview:
        if type(i) is not int or not 0 <= i < len(self.bufs):
            raise _Bad(f"array refers to buffer {i!r}, but the message has {len(self.bufs)} buffer frame(s)"[:200])
        if self.used[i]:
            raise _Bad(f"buffer frame {i} is referenced twice")
        self.used[i] = True
        return self.bufs[i]


@dataclass(slots=True)
class _Codec:
    enc: Any  # None or fn(value, bufs) -> msgpack-able
    dec: Any  # fn(value, ctx) -> value; raises _Bad
    fast: str | None = None  # inline test "value is fine as it is", with {x} for the value
    desc: str = ""
    ok_types: tuple = ()  # exact types that are fine as they are (plain scalars only)


_SCALAR_NAMES = {str: "str", int: "int", float: "float", bool: "bool", bytes: "bytes"}


def _scalar(pytype: type) -> _Codec:
    name = _SCALAR_NAMES[pytype]
    if pytype is float:

        def dec(v: Any, ctx: Any) -> Any:
            t = type(v)
            if t is float:
                return v
            if t is int:
                return float(v)
            raise _Bad(f"expected float, got {_tn(v)}")

    else:

        def dec(v: Any, ctx: Any) -> Any:
            if type(v) is pytype:
                return v
            raise _Bad(f"expected {name}, got {_tn(v)}")

    return _Codec(None, dec, f"type({{x}}) is {name}", name, () if pytype is float else (pytype,))


def _union(pytypes: list[type]) -> _Codec:
    """A union of plain scalar types (``str | int``)."""
    allowed = tuple(pytypes)
    desc = " or ".join(_SCALAR_NAMES[t] for t in pytypes)

    def dec(v: Any, ctx: Any) -> Any:
        if type(v) in allowed:
            return v
        if float in allowed and type(v) is int:
            return float(v)
        raise _Bad(f"expected {desc}, got {_tn(v)}")

    fast = " or ".join(f"type({{x}}) is {_SCALAR_NAMES[t]}" for t in pytypes)
    return _Codec(None, dec, fast, desc, () if float in allowed else allowed)


def _literal(values: tuple) -> _Codec:
    allowed = frozenset(values)

    def dec(v: Any, ctx: Any) -> Any:
        if type(v) is str and v in allowed:
            return v
        raise _Bad(f"expected one of {sorted(allowed)}, got {v!r}"[:200])

    return _Codec(None, dec, None, f"one of {sorted(allowed)}")


def _optional(inner: _Codec) -> _Codec:
    ienc, idec = inner.enc, inner.dec

    if inner.fast is not None:  # plain scalars: say that nil was fine too

        def dec(v: Any, ctx: Any) -> Any:
            if v is None:
                return None
            try:
                return idec(v, ctx)
            except _Bad:
                raise _Bad(f"expected {inner.desc} or nil, got {_tn(v)}") from None

    else:

        def dec(v: Any, ctx: Any) -> Any:
            if v is None:
                return None
            return idec(v, ctx)

    enc = None
    if ienc is not None:

        def enc(v: Any, bufs: list) -> Any:
            return None if v is None else ienc(v, bufs)

    fast = f"{{x}} is None or {inner.fast}" if inner.fast else None
    ok = inner.ok_types + (type(None),) if inner.ok_types else ()
    return _Codec(enc, dec, fast, f"{inner.desc} or nil", ok)


def _json_check(v: Any, depth: int) -> None:
    """JSON-like: nil, bool, int, float, str, lists and str-keyed maps of them, bounded depth."""
    t = type(v)
    if t is dict:
        if depth >= _MAX_JSON_DEPTH:
            raise _Bad(f"nested deeper than {_MAX_JSON_DEPTH} levels")
        for k, x in v.items():
            if type(k) is not str:
                raise _Bad(f"map key must be str, got {_tn(k)}")
            tx = type(x)
            if tx is str or tx is int or tx is float or tx is bool or x is None:
                continue
            try:
                _json_check(x, depth + 1)
            except _Bad as e:
                e.path.append(f"[{k!r}]")
                raise
    elif t is list:
        if depth >= _MAX_JSON_DEPTH:
            raise _Bad(f"nested deeper than {_MAX_JSON_DEPTH} levels")
        for i, x in enumerate(v):
            tx = type(x)
            if tx is str or tx is int or tx is float or tx is bool or x is None:
                continue
            try:
                _json_check(x, depth + 1)
            except _Bad as e:
                e.path.append(f"[{i}]")
                raise
    elif not (t is str or t is int or t is float or t is bool or v is None):
        raise _Bad(f"expected a JSON-like value (nil, bool, int, float, str, list, map), got {_tn(v)}")


def _json_any() -> _Codec:
    def dec(v: Any, ctx: Any) -> Any:
        _json_check(v, 0)
        return v

    return _Codec(None, dec, None, "JSON-like value")


def _json_dict() -> _Codec:
    def dec(v: Any, ctx: Any) -> Any:
        if type(v) is not dict:
            raise _Bad(f"expected map, got {_tn(v)}")
        _json_check(v, 0)
        return v

    return _Codec(None, dec, None, "map")


def _list(inner: _Codec) -> _Codec:
    ienc, idec = inner.enc, inner.dec
    if inner.ok_types:
        # plain scalars: a type test per element, the list itself is kept
        ok = inner.ok_types

        def dec(v: Any, ctx: Any) -> Any:
            if type(v) is not list:
                raise _Bad(f"expected list, got {_tn(v)}")
            for i, x in enumerate(v):
                if type(x) not in ok:
                    raise _Bad(f"[{i}]: expected {inner.desc}, got {_tn(x)}")
            return v

    else:

        def dec(v: Any, ctx: Any) -> Any:
            if type(v) is not list:
                raise _Bad(f"expected list, got {_tn(v)}")
            out = []
            append = out.append
            i = 0
            try:
                for i, x in enumerate(v):
                    append(idec(x, ctx))
            except _Bad as e:
                e.path.append(f"[{i}]")
                raise
            return out

    enc = None
    if ienc is not None:

        def enc(v: Any, bufs: list) -> Any:
            return [ienc(x, bufs) for x in v]

    return _Codec(enc, dec, None, f"list of {inner.desc}")


def _dict_of(inner: _Codec) -> _Codec:
    ienc, idec = inner.enc, inner.dec

    def dec(v: Any, ctx: Any) -> Any:
        if type(v) is not dict:
            raise _Bad(f"expected map, got {_tn(v)}")
        out = {}
        for k, x in v.items():
            if type(k) is not str:
                raise _Bad(f"map key must be str, got {_tn(k)}")
            try:
                out[k] = idec(x, ctx)
            except _Bad as e:
                e.path.append(f"[{k!r}]")
                raise
        return out

    enc = None
    if ienc is not None:

        def enc(v: Any, bufs: list) -> Any:
            return {k: ienc(x, bufs) for k, x in v.items()}

    return _Codec(enc, dec, None, f"map of {inner.desc}")


def _array(spec: Array) -> _Codec:
    dt = spec.dtype
    code = _CODE_OF[dt]
    itemsize = dt.itemsize
    ndim = spec.ndim
    want = f"{dt.name} array with {ndim} dimension{'s' if ndim > 1 else ''}"
    ndarray = np.ndarray
    frombuffer = np.frombuffer

    def enc(v: Any, bufs: list) -> Any:
        if type(v) is ndarray and (v.dtype is dt or v.dtype == dt):
            a = v
        else:
            try:
                a = np.asarray(v, dtype=dt)
            except (TypeError, ValueError, OverflowError) as e:
                raise ProtocolError(f"cannot encode {type(v).__name__} as {want}: {e}") from None
        if a.ndim != ndim:
            raise ProtocolError(f"expected {want}, got shape {a.shape}")
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        if a.nbytes <= INLINE_ARRAY_MAX_BYTES:
            return (code, a.shape, a.tobytes())
        bufs.append(a.data.cast("B"))
        return (code, a.shape, len(bufs) - 1)

    def dec(v: Any, ctx: _DecodeCtx) -> Any:
        # fast path: a well-formed inline 1-D array (the usual case); anything else is checked
        # step by step below
        if ndim == 1 and type(v) is list and len(v) == 3:
            c, shape, ref = v
            if type(c) is int and c == code and type(shape) is list and len(shape) == 1 and type(ref) is bytes:
                n = shape[0]
                if type(n) is int and n >= 0 and n * itemsize == len(ref):
                    return frombuffer(ref, dt)
        if type(v) is not list or len(v) != 3:
            raise _Bad(f"expected an array descriptor [dtype code, shape, buffer] for a {want}, got {_tn(v)}")
        c, shape, ref = v
        if type(c) is not int or c != code:
            got = DTYPE_CODES[c].name if type(c) is int and c in DTYPE_CODES else f"unknown dtype code {c!r}"[:60]
            raise _Bad(f"expected {want}, got {got}")
        if type(shape) is not list or len(shape) != ndim:
            raise _Bad(f"expected {want}, got shape {shape!r}"[:200])
        n = 1
        for d in shape:
            if type(d) is not int or d < 0:
                raise _Bad(f"bad array shape {shape!r}"[:200])
            n *= d
        if type(ref) is bytes:
            buf = ref
        elif type(ref) is int:
            buf = ctx.take(ref)
        else:
            raise _Bad(f"array buffer must be a frame index or bin, got {_tn(ref)}")
        if n * itemsize != len(buf):
            raise _Bad(f"shape {shape} of {dt.name} needs {n * itemsize} bytes, the buffer has {len(buf)}"[:200])
        a = frombuffer(buf, dt)
        return a if ndim == 1 else a.reshape(shape)

    return _Codec(enc, dec, None, want)


_STRUCTS: dict[type, _StructSpec] = {}


class _StructSpec:
    """A struct's generated codec: the body is a msgpack array of its fields, in order."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        hints = typing.get_type_hints(cls, include_extras=True)
        self.names = [f.name for f in dataclasses.fields(cls)]
        self.codecs = [_compile(hints[n], f"{cls.__name__}.{n}") for n in self.names]
        self.encode, self.decode = self._generate()
        self.codec = _Codec(self.encode, self.decode, None, cls.__name__)

    def _generate(self) -> tuple[Any, Any]:
        cls, names, codecs = self.cls, self.names, self.codecs
        n = len(names)
        ns: dict[str, Any] = {"_Bad": _Bad, "_new": object.__new__, "C": cls, "_tn": _tn}

        # encoder: a tuple of field values (msgpack packs it as an array)
        items = []
        for k, (name, c) in enumerate(zip(names, codecs)):
            if c.enc is None:
                items.append(f"m.{name}")
            else:
                ns[f"E{k}"] = c.enc
                items.append(f"E{k}(m.{name}, bufs)")
        tup = "(" + ", ".join(items) + ("," if n == 1 else "") + ")"
        src = ["def encode(m, bufs):", f"    return {tup}"]

        # decoder
        def fix(k: int, x: Any, ctx: Any) -> Any:  # slow path of a scalar: convert or explain
            try:
                return codecs[k].dec(x, ctx)
            except _Bad as e:
                e.path.append(f".{names[k]}")
                raise

        def shape_error(v: Any) -> _Bad:
            got = f"a list of {len(v)}" if type(v) is list else _tn(v)
            return _Bad(f"expected a list of {n} {cls.__name__} fields {names}, got {got}")

        ns["_fix"] = fix
        ns["_shape"] = shape_error
        ns["check"] = getattr(cls, "_check", None)
        var = [f"f{k}" for k in range(n)]
        src += ["def decode(v, ctx):", f"    if type(v) is not list or len(v) != {n}:", "        raise _shape(v)"]
        if n:
            src.append(f"    {', '.join(var)}, = v")
        for k, c in enumerate(codecs):
            if c.fast is not None:
                src.append(f"    if not ({c.fast.format(x=var[k])}):")
                src.append(f"        {var[k]} = _fix({k}, {var[k]}, ctx)")
        for k, (name, c) in enumerate(zip(names, codecs)):
            if c.fast is None:
                ns[f"D{k}"] = c.dec
                src += [
                    "    try:",
                    f"        {var[k]} = D{k}({var[k]}, ctx)",
                    "    except _Bad as e:",
                    f"        e.path.append('.{name}')",
                    "        raise",
                ]
        src.append("    o = _new(C)")
        for k, name in enumerate(names):
            src.append(f"    o.{name} = {var[k]}")
        if ns["check"] is not None:
            src += ["    p = check(o)", "    if p:", "        raise _Bad(p)"]
        src.append("    return o")
        exec(compile("\n".join(src), f"<protocol {cls.__name__}>", "exec"), ns)  # noqa: S102 (our own schema)
        return ns["encode"], ns["decode"]


def _compile(tp: Any, where: str) -> _Codec:
    if tp in _SCALAR_NAMES:
        return _scalar(tp)
    if tp is Any:
        return _json_any()
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:
        marks = [a for a in args[1:] if isinstance(a, Array)]
        if not marks:
            raise TypeError(f"{where}: Annotated field without an Array marker")
        return _array(marks[0])
    if origin is Literal:
        if not all(isinstance(a, str) for a in args):
            raise TypeError(f"{where}: only string literals are supported")
        return _literal(args)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            inner = _compile(rest[0], where)
        elif all(a in _SCALAR_NAMES for a in rest):
            inner = _union(rest)
        else:
            raise TypeError(f"{where}: unions are supported only of plain scalars ({tp})")
        return _optional(inner) if len(rest) < len(args) else inner
    if origin is list:
        return _list(_compile(args[0], where + "[]"))
    if origin is dict:
        key, val = args
        if key is not str:
            raise TypeError(f"{where}: map keys must be str")
        if val is Any:
            return _json_dict()
        return _dict_of(_compile(val, where + "{}"))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return (_STRUCTS.get(tp) or _register_struct(tp)).codec
    raise TypeError(f"{where}: unsupported field type {tp!r}")


def _register_struct(cls: type) -> _StructSpec:
    spec = _StructSpec(cls)
    _STRUCTS[cls] = spec
    return spec


MESSAGE_TYPES: dict[bytes, type] = {}
_TAG_OF: dict[type, bytes] = {}


def _message(cls: type) -> type:
    """Register a top-level message type; its tag is its class name."""
    tag = cls.__name__.encode("ascii")
    assert tag not in MESSAGE_TYPES, tag
    _STRUCTS.get(cls) or _register_struct(cls)
    MESSAGE_TYPES[tag] = cls
    _TAG_OF[cls] = tag
    return cls


_msg = dataclass(slots=True, kw_only=True, eq=False)


def _len(a: np.ndarray) -> int:
    return a.shape[0]


def _finite(x: float) -> bool:
    return math.isfinite(x)


# --------------------------------------------------------------------------------------------
# Client <-> scheduler
# --------------------------------------------------------------------------------------------


@_message
@_msg
class Submit:
    request_id: str
    prompt: str | None = None
    prompt_token_ids: I32 | None = None
    params: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    timeout_s: float | None = None

    def _check(self) -> str | None:
        if not self.request_id:
            return "request_id must not be empty"
        if self.prompt is None and self.prompt_token_ids is None:
            return "give a prompt or prompt_token_ids"
        if self.timeout_s is not None and not (_finite(self.timeout_s) and self.timeout_s > 0):
            return f"timeout_s must be a positive number of seconds, got {self.timeout_s}"
        return None


@_message
@_msg
class Abort:
    request_id: str


@_message
@_msg
class Ping:
    nonce: int = 0


@_message
@_msg
class Pong:
    nonce: int
    protocol_version: int = PROTOCOL_VERSION
    scheduler_id: str = ""


@_message
@_msg
class StatsRequest:
    pass


@_message
@_msg
class StatsReply:
    stats: dict[str, Any] = field(default_factory=dict)


@_message
@_msg
class ModelsRequest:
    pass


@_message
@_msg
class ModelsReply:
    models: list[dict[str, Any]] = field(default_factory=list)


@_message
@_msg
class Output:
    request_id: str
    index: int = 0
    token_ids: I32 = field(default_factory=empty_i32)
    text: str = ""
    logprobs: F32_2D | None = None
    logprob_token_ids: I32_2D | None = None
    ranks: I32 | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_token_ids: I32 | None = None
    num_cached_tokens: int = 0

    def _check(self) -> str | None:
        if self.index < 0:
            return f"index must be >= 0, got {self.index}"
        n = _len(self.token_ids)
        if (self.logprobs is None) != (self.logprob_token_ids is None):
            return "logprobs and logprob_token_ids come together"
        if self.logprobs is not None:
            if self.logprobs.shape != self.logprob_token_ids.shape:
                return f"logprobs shape {self.logprobs.shape} != logprob_token_ids shape {self.logprob_token_ids.shape}"
            if self.logprobs.shape[0] != n or self.logprobs.shape[1] < 1:
                return f"logprobs shape {self.logprobs.shape} does not fit {n} tokens (n_tokens, 1+k)"
        if self.ranks is not None and _len(self.ranks) != n:
            return f"ranks has {_len(self.ranks)} entries for {n} tokens"
        return None


@_message
@_msg
class Outputs:
    items: list[Output] = field(default_factory=list)


@_message
@_msg
class Error:
    request_id: str | None = None
    code: str = "internal"
    message: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException, request_id: str | None = None) -> Error:
        return cls(request_id=request_id, code=getattr(exc, "code", "internal"), message=str(exc))

    def to_exception(self) -> Exception:
        from common.errors import error_from_code

        return error_from_code(self.code, self.message)


# --------------------------------------------------------------------------------------------
# Worker <-> scheduler
# --------------------------------------------------------------------------------------------


@_message
@_msg
class Hello:
    role: Literal["worker", "detokenizer"]
    protocol_version: int = PROTOCOL_VERSION
    worker_id: str
    group: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    model: str = ""
    device: str = ""
    host: str = ""
    pid: int = 0
    num_kv_blocks: int = 0
    block_size: int = 0
    max_model_len: int = 0
    memory: dict[str, Any] = field(default_factory=dict)

    def _check(self) -> str | None:
        if not self.worker_id:
            return "worker_id must not be empty"
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            return f"tp_rank {self.tp_rank} / tp_size {self.tp_size}: need 0 <= tp_rank < tp_size"
        if self.num_kv_blocks < 0 or self.block_size < 0 or self.max_model_len < 0:
            return "num_kv_blocks, block_size and max_model_len must be >= 0"
        return None


@_message
@_msg
class Welcome:
    accepted: bool
    reason: str = ""
    group: str = ""
    step_addr: str = ""
    dist_init_addr: str | None = None
    scheduler_id: str = ""
    protocol_version: int = PROTOCOL_VERSION


@_message
@_msg
class Heartbeat:
    worker_id: str
    stats: dict[str, Any] = field(default_factory=dict)


@_message
@_msg
class Probe:
    probe_id: str


@_message
@_msg
class ProbeAck:
    worker_id: str
    probe_id: str


@_msg
class NewRequest:
    req_id: str
    token_ids: I32
    num_prompt_tokens: int
    params: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    block_ids: I32 = field(default_factory=empty_i32)
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0

    def _check(self) -> str | None:
        n = _len(self.token_ids)
        if not 0 <= self.num_prompt_tokens <= n:
            return f"num_prompt_tokens {self.num_prompt_tokens} not in [0, {n}]"
        if self.num_computed_tokens < 0 or self.num_scheduled_tokens < 0:
            return "num_computed_tokens and num_scheduled_tokens must be >= 0"
        if self.num_computed_tokens + self.num_scheduled_tokens > n:
            return (
                f"num_computed_tokens {self.num_computed_tokens} + num_scheduled_tokens "
                f"{self.num_scheduled_tokens} > {n} tokens"
            )
        return None


@_msg
class CachedRequests:
    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: I32 = field(default_factory=empty_i32)
    num_scheduled_tokens: I32 = field(default_factory=empty_i32)
    new_block_ids_flat: I32 = field(default_factory=empty_i32)
    new_block_counts: I32 = field(default_factory=empty_i32)
    resync_tokens: dict[str, I32] = field(default_factory=dict)

    def _check(self) -> str | None:
        r = len(self.req_ids)
        for name in ("num_computed_tokens", "num_scheduled_tokens", "new_block_counts"):
            if _len(getattr(self, name)) != r:
                return f"{name} has {_len(getattr(self, name))} entries for {r} req_ids"
        if r:
            if int(self.new_block_counts.min()) < 0:
                return "new_block_counts must be >= 0"
            total = int(self.new_block_counts.sum(dtype=np.int64))
        else:
            total = 0
        if total != _len(self.new_block_ids_flat):
            return f"new_block_counts add up to {total}, new_block_ids_flat has {_len(self.new_block_ids_flat)}"
        if self.resync_tokens:
            unknown = set(self.resync_tokens).difference(self.req_ids)
            if unknown:
                return f"resync_tokens for requests not in req_ids: {sorted(unknown)[:5]}"
        return None

    @classmethod
    def build(
        cls,
        req_ids: list[str],
        num_computed_tokens: Any,
        num_scheduled_tokens: Any,
        new_block_ids: list[Any],
        resync_tokens: dict[str, Any] | None = None,
    ) -> CachedRequests:
        """From per-request lists (new_block_ids: one list/array per request)."""
        counts = np.fromiter((len(b) for b in new_block_ids), dtype=np.int32, count=len(new_block_ids))
        flat = (
            np.concatenate([np.asarray(b, dtype=np.int32) for b in new_block_ids]).astype(np.int32, copy=False)
            if len(new_block_ids)
            else empty_i32()
        )
        return cls(
            req_ids=list(req_ids),
            num_computed_tokens=np.asarray(num_computed_tokens, dtype=np.int32).reshape(-1),
            num_scheduled_tokens=np.asarray(num_scheduled_tokens, dtype=np.int32).reshape(-1),
            new_block_ids_flat=flat,
            new_block_counts=counts,
            resync_tokens={k: np.asarray(v, dtype=np.int32).reshape(-1) for k, v in (resync_tokens or {}).items()},
        )

    def new_block_ids(self) -> list[np.ndarray]:
        """Request i's new block ids, as views into new_block_ids_flat."""
        if not self.req_ids:
            return []
        return np.split(self.new_block_ids_flat, np.cumsum(self.new_block_counts[:-1]))


@_message
@_msg
class Step:
    seq: int
    group: str
    new_reqs: list[NewRequest] = field(default_factory=list)
    cached_reqs: CachedRequests = field(default_factory=CachedRequests)
    finished_req_ids: list[str] = field(default_factory=list)

    def _check(self) -> str | None:
        if self.seq < 0:
            return f"seq must be >= 0, got {self.seq}"
        return None


@_message
@_msg
class StepResult:
    seq: int
    worker_id: str
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: I32 = field(default_factory=empty_i32)
    logprob_token_ids: I32_2D | None = None
    logprobs: F32_2D | None = None
    ranks: I32 | None = None
    step_time_s: float = 0.0

    def _check(self) -> str | None:
        r = len(self.req_ids)
        if _len(self.sampled_token_ids) != r:
            return f"sampled_token_ids has {_len(self.sampled_token_ids)} entries for {r} req_ids"
        if (self.logprobs is None) != (self.logprob_token_ids is None):
            return "logprobs and logprob_token_ids come together"
        if self.logprobs is not None and (
            self.logprobs.shape != self.logprob_token_ids.shape or self.logprobs.shape[0] != r
        ):
            return (
                f"logprobs {self.logprobs.shape} / logprob_token_ids {self.logprob_token_ids.shape} "
                f"must both be ({r}, 1+k)"
            )
        if self.ranks is not None and _len(self.ranks) != r:
            return f"ranks has {_len(self.ranks)} entries for {r} req_ids"
        return None


@_message
@_msg
class WorkerError:
    worker_id: str
    seq: int | None = None
    message: str = ""


@_message
@_msg
class Drain:
    worker_id: str


@_message
@_msg
class Goodbye:
    worker_id: str
    reason: str = ""


@_message
@_msg
class Shutdown:
    reason: str = ""


# --------------------------------------------------------------------------------------------
# Detokenizer <-> scheduler
# --------------------------------------------------------------------------------------------


@_msg
class DetokRequest:
    req_id: str
    prompt_token_ids: I32 = field(default_factory=empty_i32)
    params: dict[str, Any] = field(default_factory=dict)
    output_token_ids: I32 = field(default_factory=empty_i32)
    text_offset: int = 0

    def _check(self) -> str | None:
        if self.text_offset < 0:
            return f"text_offset must be >= 0, got {self.text_offset}"
        return None


@_message
@_msg
class DetokNew:
    items: list[DetokRequest] = field(default_factory=list)


@_message
@_msg
class DetokTokens:
    seq: int = 0
    req_ids: list[str] = field(default_factory=list)
    counts: I32 = field(default_factory=empty_i32)
    token_ids: I32 = field(default_factory=empty_i32)
    finish_reasons: list[str | None] = field(default_factory=list)

    def _check(self) -> str | None:
        r = len(self.req_ids)
        if _len(self.counts) != r or len(self.finish_reasons) != r:
            return f"counts ({_len(self.counts)}) and finish_reasons ({len(self.finish_reasons)}) need {r} entries"
        if r:
            if int(self.counts.min()) < 0:
                return "counts must be >= 0"
            total = int(self.counts.sum(dtype=np.int64))
        else:
            total = 0
        if total != _len(self.token_ids):
            return f"counts add up to {total}, token_ids has {_len(self.token_ids)}"
        return None

    @classmethod
    def build(
        cls, seq: int, req_ids: list[str], token_ids: list[Any], finish_reasons: list[str | None] | None = None
    ) -> DetokTokens:
        """From per-request token lists."""
        counts = np.fromiter((len(t) for t in token_ids), dtype=np.int32, count=len(token_ids))
        flat = (
            np.concatenate([np.asarray(t, dtype=np.int32).reshape(-1) for t in token_ids]).astype(np.int32, copy=False)
            if len(token_ids)
            else empty_i32()
        )
        return cls(
            seq=seq,
            req_ids=list(req_ids),
            counts=counts,
            token_ids=flat,
            finish_reasons=list(finish_reasons) if finish_reasons is not None else [None] * len(req_ids),
        )

    def per_request(self) -> list[np.ndarray]:
        """Request i's new tokens, as views into token_ids."""
        if not self.req_ids:
            return []
        return np.split(self.token_ids, np.cumsum(self.counts[:-1]))


@_message
@_msg
class DetokOutputs:
    seq: int = 0
    req_ids: list[str] = field(default_factory=list)
    text_deltas: list[str] = field(default_factory=list)
    stop_strs: list[str | None] = field(default_factory=list)

    def _check(self) -> str | None:
        r = len(self.req_ids)
        if len(self.text_deltas) != r or len(self.stop_strs) != r:
            return f"text_deltas ({len(self.text_deltas)}) and stop_strs ({len(self.stop_strs)}) need {r} entries"
        return None


@_message
@_msg
class DetokFree:
    req_ids: list[str] = field(default_factory=list)


@_message
@_msg
class Event:
    kind: str
    ts: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Encode / decode
# --------------------------------------------------------------------------------------------


def _default(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):  # inside a JSON-like field (stats); arrays proper use Array
        return v.tolist()
    if isinstance(v, (tuple, set, frozenset)):
        return list(v)
    raise TypeError(f"cannot put a {type(v).__name__} on the wire")


def encode(msg: Any, *, max_message_size: int = MAX_MESSAGE_SIZE) -> list[bytes | memoryview]:
    """Message -> frames ``[type][body][buffers...]``; buffers reference the arrays' memory
    (do not modify an array until the frames are sent)."""
    cls = type(msg)
    tag = _TAG_OF.get(cls)
    if tag is None:
        raise ProtocolError(f"{cls.__name__} is not a registered message type")
    bufs: list = []
    try:
        body = msgpack.packb(_STRUCTS[cls].encode(msg, bufs), default=_default, use_bin_type=True)
    except ProtocolError as e:
        raise ProtocolError(f"{cls.__name__}: {e.reason}") from None
    except Exception as e:  # noqa: BLE001 (wrong value types, lists too long, ...)
        raise ProtocolError(f"cannot encode {cls.__name__}: {type(e).__name__}: {e}") from None
    size = len(body)
    for b in bufs:
        size += b.nbytes
    if size > max_message_size:
        raise ProtocolError(f"{cls.__name__} is {size} bytes, over the {max_message_size}-byte message limit")
    return [tag, body, *bufs]


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed")


def _as_buffer(f: Any) -> memoryview:
    mv = memoryview(f)  # bytes, bytearray, memoryview, zmq.Frame
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def decode(frames: typing.Sequence[Any], *, max_message_size: int = MAX_MESSAGE_SIZE) -> Any:
    """Frames ``[type][body][buffers...]`` -> a validated message; ProtocolError on any problem."""
    try:
        return _decode(frames, max_message_size)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 (a last line: decode never raises anything but ProtocolError)
        raise ProtocolError(f"malformed message ({type(e).__name__}: {e})"[:300]) from None


def _decode(frames: typing.Sequence[Any], max_message_size: int) -> Any:
    try:
        n = len(frames)
    except TypeError:
        raise ProtocolError(f"expected a list of frames, got {type(frames).__name__}") from None
    if n < 2:
        raise ProtocolError(f"expected at least 2 frames [type][body], got {n}")
    try:
        views = [_as_buffer(f) for f in frames]
    except (TypeError, ValueError):
        raise ProtocolError("frames must be bytes-like") from None
    total = 0
    for v in views:
        total += v.nbytes
    if total > max_message_size:
        raise ProtocolError(f"message of {total} bytes is over the {max_message_size}-byte limit")
    tag = views[0].tobytes()
    cls = MESSAGE_TYPES.get(tag)
    if cls is None:
        raise ProtocolError(f"unknown message type {tag[:40]!r}")
    body = views[1]
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_ext_len=0,
            max_str_len=len(body),
            max_bin_len=len(body),
            max_array_len=len(body),
            max_map_len=len(body),
        )
    except Exception as e:  # noqa: BLE001 (msgpack raises several types)
        raise ProtocolError(f"{cls.__name__}: body is not valid msgpack ({type(e).__name__}: {e})"[:300]) from None
    ctx = _DecodeCtx(views[2:])
    try:
        msg = _STRUCTS[cls].decode(obj, ctx)
    except _Bad as e:
        path = "".join(reversed(e.path))
        reason = f"{cls.__name__}{path}: {e.msg}"
        if cls is Hello and type(obj) is list and len(obj) > 1 and obj[1] != PROTOCOL_VERSION:
            reason += f" (peer speaks protocol version {obj[1]!r}"[:80] + f", this side {PROTOCOL_VERSION})"
        raise ProtocolError(reason) from None
    if not all(ctx.used):
        unused = [i for i, u in enumerate(ctx.used) if not u]
        raise ProtocolError(f"{cls.__name__}: {len(unused)} buffer frame(s) not referenced by any field {unused[:10]}")
    return msg


def group_topic(group: str) -> bytes:
    """The PUB/SUB topic of a worker group; NUL-terminated so one group is not a prefix of another."""
    return group.encode("utf-8") + b"\x00"


def encode_pub(topic: bytes, msg: Any, *, max_message_size: int = MAX_MESSAGE_SIZE) -> list[bytes | memoryview]:
    """Frames for a PUB socket: ``[topic][type][body][buffers...]``."""
    if not isinstance(topic, bytes):
        raise ProtocolError(f"topic must be bytes, got {type(topic).__name__}")
    return [topic, *encode(msg, max_message_size=max_message_size)]


def decode_pub(frames: typing.Sequence[Any], *, max_message_size: int = MAX_MESSAGE_SIZE) -> tuple[bytes, Any]:
    """``[topic][type][body][buffers...]`` -> (topic, message)."""
    try:
        if len(frames) < 3:
            raise ProtocolError(f"expected at least 3 frames [topic][type][body], got {len(frames)}")
        topic = _as_buffer(frames[0]).tobytes()
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ProtocolError(f"malformed PUB message ({type(e).__name__})") from None
    return topic, decode(frames[1:], max_message_size=max_message_size)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


_PARAM_DEFAULTS: dict[str, Any] | None = None


def encode_params(params: Any, *, compact: bool = True) -> dict[str, Any]:
    """SamplingParams -> the ``params`` dict carried by Submit / NewRequest / DetokRequest.

    ``compact`` (the default) leaves out fields at their default value: a typical request
    sends 2-4 keys instead of 19, which makes a 256-request step several times cheaper to
    encode and decode. ``decode_params`` fills the defaults back in, so read params with it
    (or ``d.get(name, default)``), not ``d[name]``.
    """
    global _PARAM_DEFAULTS
    d = params.to_dict()
    if not compact:
        return d
    if _PARAM_DEFAULTS is None:
        from common.sampling_params import SamplingParams

        _PARAM_DEFAULTS = SamplingParams().to_dict()
    defaults = _PARAM_DEFAULTS
    missing = object()
    return {k: v for k, v in d.items() if defaults.get(k, missing) != v or type(defaults.get(k)) is not type(v)}


def decode_params(d: dict[str, Any] | None) -> Any:
    """``params`` dict -> validated SamplingParams (raises InvalidRequest)."""
    from common.sampling_params import SamplingParams

    return SamplingParams.from_dict(d)


def check_version(hello: Hello) -> str | None:
    """None when the peer speaks our protocol version, else the reason to refuse it."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return (
            f"protocol version mismatch: {hello.role} {hello.worker_id!r} speaks version "
            f"{hello.protocol_version}, this scheduler speaks {PROTOCOL_VERSION}; run the same zeroserve release everywhere"
        )
    return None


def messages_equal(a: Any, b: Any) -> bool:
    """Deep equality of messages / values; arrays compare by dtype, shape and content."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
        )
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(messages_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(messages_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(messages_equal(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b
