"""The building blocks of the message schemas in `common/messages.py`: array field types,
bounded scalar types, the JSON-like check for free-form fields, and the `Message` base that
coerces arrays and runs each schema's `check()` (on construction and on decode alike)."""

from __future__ import annotations

import typing
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np

# --------------------------------------------------------------------------------------------
# Field types
# --------------------------------------------------------------------------------------------


class _Array(np.ndarray):
    """Schema marker for a numpy array field: subclasses fix the dtype and number of dimensions.
    Decoded arrays are read-only views of the received frames (copy before mutating)."""

    dtype_: ClassVar[np.dtype]
    ndim_: ClassVar[int]


class I32(_Array):
    dtype_, ndim_ = np.dtype("<i4"), 1


class I64(_Array):
    dtype_, ndim_ = np.dtype("<i8"), 1


class F32(_Array):
    dtype_, ndim_ = np.dtype("<f4"), 1


class I32_2D(_Array):  # noqa: N801 - reads like the others
    dtype_, ndim_ = np.dtype("<i4"), 2


class F32_2D(_Array):  # noqa: N801
    dtype_, ndim_ = np.dtype("<f4"), 2


ARRAY_TYPES: tuple[type[_Array], ...] = (I32, I64, F32, I32_2D, F32_2D)

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]  # ids, names, topics
Text = Annotated[str, msgspec.Meta(max_length=1 << 16)]  # reasons, details, addresses
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # tokens, blocks, indexes
Seq = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # step sequence numbers, seeds
Role = Literal["worker", "detokenizer"]
FinishReason = Literal["stop", "length", "abort"]
ErrorCode = Annotated[str, msgspec.Meta(max_length=64)]  # a zeroserve.common.errors code
Stats = dict[Annotated[str, msgspec.Meta(max_length=256)], int | float]  # flat figures
MAX_JSON_DEPTH = 32


def empty_i32() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


def json_like(v: Any, depth: int = 0) -> Any:
    """A free-form field's value as plain JSON-like data (nil, bool, int, float, str, lists and
    str-keyed maps, at most MAX_JSON_DEPTH levels): numpy values and tuples become lists and
    numbers, anything else is refused (ValueError), on the sender and on the receiver alike."""
    t = type(v)
    if v is None or t is str or t is int or t is float or t is bool:
        return v
    if depth >= MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    if t is dict:
        for k in v:
            if type(k) is not str:
                raise ValueError(f"map key must be str, got {type(k).__name__}")
        return {k: json_like(x, depth + 1) for k, x in v.items()}
    if t is list or t is tuple:
        return [json_like(x, depth + 1) for x in v]
    if isinstance(v, (np.ndarray, np.generic)):
        return json_like(v.tolist(), depth)
    raise ValueError(f"expected a JSON-like value (nil, bool, int, float, str, list, map), got {t.__name__}")


_ARRAY_FIELDS: dict[type, tuple[tuple[str, type[_Array]], ...]] = {}


def _array_fields(cls: type) -> tuple[tuple[str, type[_Array]], ...]:
    """(name, array type) of each array field of a schema, found once per class."""

    hints = typing.get_type_hints(cls)
    out = []
    for name in cls.__struct_fields__:
        for a in typing.get_args(hints[name]) or (hints[name],):
            if isinstance(a, type) and issubclass(a, _Array):
                out.append((name, a))
    return tuple(out)


class Message(msgspec.Struct, array_like=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every schema: array coercion plus the cross-field `check()`."""

    def __post_init__(self) -> None:
        arrays = _ARRAY_FIELDS.get(type(self))
        if arrays is None:
            arrays = _ARRAY_FIELDS[type(self)] = _array_fields(type(self))
        for name, kind in arrays:
            v = getattr(self, name)
            if v is None or (type(v) is kind):
                continue
            if isinstance(v, np.ndarray) and v.dtype == kind.dtype_ and v.ndim == kind.ndim_:
                continue
            try:
                a = np.asarray(v, dtype=kind.dtype_)
            except (TypeError, ValueError, OverflowError) as e:
                raise ValueError(f"{name}: cannot make a {kind.dtype_.name} array of {type(v).__name__}: {e}") from None
            if a.ndim != kind.ndim_:
                raise ValueError(f"{name}: expected a {kind.ndim_}-D {kind.dtype_.name} array, got shape {a.shape}")
            setattr(self, name, a)
        problem = self.check()
        if problem:
            raise ValueError(problem)

    def check(self) -> str | None:
        return None
