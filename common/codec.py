"""The cluster's one codec: messages (`common/messages.py`) to ZeroMQ frames and back.

Wire format
-----------
A message is a multipart ZeroMQ message ``[type tag][body][raw buffer 0][raw buffer 1]...``:

* ``type tag``: the ASCII class name (``b"Step"``), one of ``MESSAGE_TYPES``.
* ``body``: MessagePack (msgspec's codec, readable by any msgpack library): an array of the
  schema's fields in declaration order; nested structs are arrays too, except
  ``SamplingParams``, a map of the fields that differ from their defaults.
* Array fields are never MessagePack lists: the body holds ``[dtype code, shape, ref]`` with
  ``dtype code`` from ``DTYPE_CODES`` (int32=1, int64=2, float32=3; little-endian), ``shape`` a
  list of 1 or 2 ints, and ``ref`` either a ``bin`` holding the bytes inline (arrays up to
  ``INLINE_ARRAY_MAX_BYTES``) or the index of a raw buffer frame after the body (bigger
  arrays, sent zero-copy). Every buffer frame is referenced exactly once.
* PUB/SUB frames put the topic first: ``[topic][type][body][buffers...]``; ``group_topic``
  ends a group's topic with NUL so "g1" is no prefix of "g10".

Decoding refuses, with a ``ProtocolError`` (an ``InvalidRequest``) whose reason names the
field in words (``Step.new_reqs[0].token_ids: ...``): unknown tags, frames over
``max_message_size`` in total (before anything is unpacked), bodies that are not MessagePack,
ext types, wrong types or ranges, broken invariants (each schema's ``check()``), array
descriptors that do not fit their bytes or field, unreferenced buffer frames and nesting too
deep for the decoder. It never raises anything else. No pickle anywhere.
"""

from __future__ import annotations

import re
import threading
import typing
from typing import Any

import msgspec
import numpy as np

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message
from zeroserve.common.schema import ARRAY_TYPES

MAX_MESSAGE_SIZE = 64 * 1024 * 1024  # bytes, all frames together
INLINE_ARRAY_MAX_BYTES = 16 * 1024  # bigger arrays travel as frames of their own
DTYPE_CODES: dict[int, np.dtype] = {1: np.dtype("<i4"), 2: np.dtype("<i8"), 3: np.dtype("<f4")}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}
_TAG_OF = {cls: tag for tag, cls in MESSAGE_TYPES.items()}


class ProtocolError(InvalidRequest):
    """A message could not be encoded or decoded; ``reason`` says why. ``identity`` is the peer
    (ROUTER identity or SUB topic) it came from, so a service can answer it; ``peer_version`` is
    set when a HELLO came from a peer speaking another protocol version."""

    code = "invalid_request"

    def __init__(self, reason: str, identity: bytes | None = None, peer_version: Any = None,
                 request_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.identity = identity
        self.peer_version = peer_version
        self.request_id = request_id  # of a Submit that did not validate, so its sender can match the error


# --------------------------------------------------------------------------------------------
# Arrays: an enc_hook / dec_hook pair; the raw buffer frames of the message being coded live in
# a thread-local (msgspec's hooks take no context argument)
# --------------------------------------------------------------------------------------------

_tls = threading.local()


def _enc_hook(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        code = _CODE_OF.get(v.dtype)
        if code is None:
            raise TypeError(f"cannot put a {v.dtype} array on the wire (int32, int64 or float32)")
        if not v.flags.c_contiguous:
            v = np.ascontiguousarray(v)
        if v.nbytes <= INLINE_ARRAY_MAX_BYTES:
            return (code, v.shape, v.tobytes())
        bufs = _tls.bufs
        bufs.append(v.data.cast("B"))
        return (code, v.shape, len(bufs) - 1)
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"cannot put a {type(v).__name__} on the wire")


def _want(kind: type) -> str:
    return f"{kind.dtype_.name} array with {kind.ndim_} dimension{'s' if kind.ndim_ > 1 else ''}"


# per array type: (code, dtype, ndim, itemsize), looked up once per array on the hot path
_ARRAY_INFO = {k: (_CODE_OF[k.dtype_], k.dtype_, k.ndim_, k.dtype_.itemsize) for k in ARRAY_TYPES}
_MAX_DIM = 1 << 31


def _dec_hook(kind: type, v: Any) -> Any:
    info = _ARRAY_INFO.get(kind)
    if info is None:
        raise TypeError(f"unsupported field type {kind!r}")
    want_code, dtype, ndim, itemsize = info
    if type(v) is not list or len(v) != 3:
        raise TypeError(f"expected an array descriptor [dtype code, shape, buffer] for a {_want(kind)}")
    code, shape, ref = v
    if code is not want_code or type(code) is not int:
        got = DTYPE_CODES[code].name if type(code) is int and code in DTYPE_CODES else f"unknown dtype code {code!r:.40}"
        raise TypeError(f"expected {_want(kind)}, got {got}")
    if type(shape) is not list or len(shape) != ndim:
        raise TypeError(f"expected {_want(kind)}, got shape {shape!r:.100}")
    n = 1
    for d in shape:
        if type(d) is not int or not 0 <= d < _MAX_DIM:
            raise TypeError(f"bad array shape {shape!r:.100}")
        n *= d
    if type(ref) is bytes:
        buf = ref
    elif type(ref) is int:
        bufs, used = _tls.bufs, _tls.used
        if not 0 <= ref < len(bufs):
            raise TypeError(f"array refers to buffer {ref}, but the message has {len(bufs)} buffer frame(s)")
        if used[ref]:
            raise TypeError(f"buffer frame {ref} is referenced twice")
        used[ref] = True
        buf = bufs[ref]
    else:
        raise TypeError(f"array buffer must be a frame index or bin, got {type(ref).__name__}")
    if n * itemsize != len(buf):
        raise TypeError(f"shape {shape} of {dtype.name} needs {n * itemsize} bytes, the buffer has {len(buf)}")
    a = np.frombuffer(buf, dtype)
    if a.flags.writeable:  # a view of a received frame (bytes already are read-only): copy before mutating
        a.flags.writeable = False
    return (a if ndim == 1 else a.reshape(shape)).view(kind)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoders = {cls: msgspec.msgpack.Decoder(cls, dec_hook=_dec_hook) for cls in MESSAGE_TYPES.values()}


def encode(msg: Message, *, max_message_size: int = MAX_MESSAGE_SIZE) -> list[bytes | memoryview]:
    """Message -> frames ``[type][body][buffers...]``. Buffers reference the arrays' memory: do
    not modify an array until its frames are sent."""
    tag = _TAG_OF.get(type(msg))
    if tag is None:
        raise ProtocolError(f"{type(msg).__name__} is not a registered message type")
    _tls.bufs = bufs = []
    try:
        body = _encoder.encode(msg)
    except Exception as e:  # noqa: BLE001 - wrong value types, ints too big for msgpack, ...
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {type(e).__name__}: {e}") from None
    finally:
        _tls.bufs = None
    size = len(body) + sum(b.nbytes for b in bufs)
    if size > max_message_size:
        raise ProtocolError(f"{type(msg).__name__} is {size} bytes, over the {max_message_size}-byte message limit")
    return [tag, body, *bufs]


def _buffer(f: Any) -> memoryview:
    mv = memoryview(f)  # bytes, bytearray, memoryview, zmq.Frame
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def decode(frames: typing.Sequence[Any], *, max_message_size: int = MAX_MESSAGE_SIZE) -> Message:
    """Frames ``[type][body][buffers...]`` -> a validated message; ProtocolError on any problem."""
    try:
        n = len(frames)
    except TypeError:
        raise ProtocolError(f"expected a list of frames, got {type(frames).__name__}") from None
    if n < 2:
        raise ProtocolError(f"expected at least 2 frames [type][body], got {n}")
    try:
        views = [_buffer(f) for f in frames]
    except (TypeError, ValueError):
        raise ProtocolError("frames must be bytes-like") from None
    total = sum(v.nbytes for v in views)
    if total > max_message_size:
        raise ProtocolError(f"message of {total} bytes is over the {max_message_size}-byte limit")
    cls = MESSAGE_TYPES.get(views[0].tobytes())
    if cls is None:
        raise ProtocolError(f"unknown message type {views[0].tobytes()[:40]!r}")
    _tls.bufs, _tls.used = views[2:], [False] * (n - 2)
    try:
        msg = _decoders[cls].decode(views[1])
        used = _tls.used
    except msgspec.ValidationError as e:
        raise _validation_error(cls, str(e), views[1]) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"{cls.__name__}: body is not valid msgpack ({e})"[:300]) from None
    except RecursionError:
        raise ProtocolError(f"{cls.__name__}: nested too deeply to decode") from None
    except Exception as e:  # noqa: BLE001 - a last line: decode raises nothing but ProtocolError
        raise ProtocolError(f"{cls.__name__}: malformed message ({type(e).__name__}: {e})"[:300]) from None
    finally:
        _tls.bufs = _tls.used = None
    if not all(used):
        unused = [i for i, u in enumerate(used) if not u]
        raise ProtocolError(f"{cls.__name__}: {len(unused)} buffer frame(s) not referenced by any field {unused[:10]}")
    return msg


def group_topic(group: str) -> bytes:
    """The PUB/SUB topic of a worker group; NUL-terminated so one group is not a prefix of another."""
    return group.encode("utf-8") + b"\x00"


def encode_pub(topic: bytes, msg: Message, *, max_message_size: int = MAX_MESSAGE_SIZE) -> list[bytes | memoryview]:
    """Frames for a PUB socket: ``[topic][type][body][buffers...]``."""
    if not isinstance(topic, bytes):
        raise ProtocolError(f"topic must be bytes, got {type(topic).__name__}")
    return [topic, *encode(msg, max_message_size=max_message_size)]


def decode_pub(frames: typing.Sequence[Any], *, max_message_size: int = MAX_MESSAGE_SIZE) -> tuple[bytes, Message]:
    """``[topic][type][body][buffers...]`` -> (topic, message)."""
    try:
        if len(frames) < 3:
            raise ProtocolError(f"expected at least 3 frames [topic][type][body], got {len(frames)}")
        topic = _buffer(frames[0]).tobytes()
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ProtocolError(f"malformed PUB message ({type(e).__name__})") from None
    return topic, decode(frames[1:], max_message_size=max_message_size)


def check_version(hello: Any) -> str | None:
    """None when the peer speaks our protocol version, else the reason to refuse it."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return (f"protocol version mismatch: {hello.role} {hello.worker_id!r} speaks version "
                f"{hello.protocol_version}, this scheduler speaks {PROTOCOL_VERSION}; run the same zeroserve "
                "release everywhere")
    return None


def v1_refusal(reason: str) -> list[bytes]:
    """A WELCOME refusal in protocol v1's layout ([accepted, reason, ...]): a v1 peer can read it
    and exits printing the reason, instead of retrying a HELLO it cannot get answered."""
    return [b"Welcome", msgspec.msgpack.encode([False, reason, "", "", None, "", PROTOCOL_VERSION])]


# --------------------------------------------------------------------------------------------
# Readable errors: msgspec says "Expected `int`, got `str` - at `$[2][0].seed`"; we say
# "Step.new_reqs[0].seed: expected int, got str", walking the schema along the path.
# --------------------------------------------------------------------------------------------

_PATH_TOKEN = re.compile(r"\[(\d+|\.\.\.)\]|\.(\w+)")
# msgspec's type words -> the ones a MessagePack user knows
_TYPE_WORDS = {"object": "map", "array": "list", "null": "nil", "None": "nil"}


def _readable_type(t: str) -> str:
    return " or ".join(_TYPE_WORDS.get(x, x) for x in t.split(" | "))


def _validation_error(cls: type, text: str, body: memoryview) -> ProtocolError:
    msg, _, where = text.partition(" - at `")
    where = where.rstrip("`")
    key = where.startswith("key` in `")
    if key:
        where = where[len("key` in `"):]
    path = _field_path(cls, where[1:]) if where.startswith("$") else ""
    msg = re.sub(r"`([^`]*)`", lambda m: _readable_type(m.group(1)), msg)
    msg = msg.replace("Object contains unknown field", "unknown field")
    if msg.startswith("Invalid enum value"):
        msg = f"expected one of {_literal_values(cls, where[1:])}, got {msg[len('Invalid enum value '):]}"
    msg = (msg[0].lower() + msg[1:]) if msg[:8] == "Expected" else msg
    reason = f"{cls.__name__}{path}: {'map key: ' if key else ''}{msg}"
    version = request_id = None
    try:  # best effort: the fields that say who to answer and how
        first = msgspec.msgpack.decode(body)
    except Exception:  # noqa: BLE001
        first = None
    if type(first) is list and first:
        if cls.__name__ == "Submit" and type(first[0]) is str and 0 < len(first[0]) <= 256:
            request_id = first[0]
        if cls.__name__ == "Hello" and len(first) > 1 and type(first[1]) is int and first[1] != PROTOCOL_VERSION:
            version = first[1]
            reason += f" (peer speaks protocol version {version}, this side {PROTOCOL_VERSION})"
    return ProtocolError(reason[:1000], peer_version=version, request_id=request_id)


def _literal_values(cls: type, path: str) -> list:
    info = _unwrap(_field_path(cls, path, want_info=True))
    return sorted(getattr(info, "values", ()))


def _field_path(cls: type, path: str, want_info: bool = False) -> Any:
    """`[2][0].seed` on Step -> `.new_reqs[0].seed` (or the type info found there)."""
    out, info = [], msgspec.inspect.type_info(cls)
    for index, name in _PATH_TOKEN.findall(path):
        info = _unwrap(info)
        if isinstance(info, msgspec.inspect.StructType):
            if name:
                out.append("." + name)
                info = next((f.type for f in info.fields if f.encode_name == name), None)
            else:
                i = int(index)
                if i < len(info.fields):
                    out.append("." + info.fields[i].name)
                    info = info.fields[i].type
                else:
                    out.append(f"[{i}]")
                    info = None
        else:
            out.append(f"[{index}]" if index else f".{name}")
            if isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.TupleType)):
                info = getattr(info, "item_type", None)
            elif isinstance(info, msgspec.inspect.DictType):
                info = info.value_type
            else:
                info = None
    return info if want_info else "".join(out)


def _unwrap(info: Any) -> Any:
    if isinstance(info, msgspec.inspect.UnionType):
        rest = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        return rest[0] if len(rest) == 1 else info
    return info


__all__ = ["DTYPE_CODES", "INLINE_ARRAY_MAX_BYTES", "MAX_MESSAGE_SIZE", "ProtocolError", "check_version",
           "decode", "decode_pub", "encode", "encode_pub", "group_topic", "v1_refusal"]
