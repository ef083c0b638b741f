"""Protocol v2 (zeroserve.common.messages + zeroserve.common.codec): round trips of every message, the wire layout
as a plain msgpack reader sees it, validation of hostile input, v1 peers, a seeded fuzz."""

from __future__ import annotations

import datetime
import importlib.util
import math
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest

from zeroserve.common import codec as C
from zeroserve.common import messages as M
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.sampling_params import SamplingParams

I32 = np.int32
F32 = np.float32
ROOT = Path(__file__).resolve().parents[1]


def arr(values, dtype=I32):
    return np.asarray(values, dtype=dtype)


def logprob_block(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        -rng.random((n, 1 + k), dtype=np.float32),
        rng.integers(0, 32000, size=(n, 1 + k), dtype=np.int32),
    )


PARAMS = SamplingParams(temperature=0.0, max_tokens=32, stop=["\n\n"], logprobs=2, seed=7)


def sample_messages() -> dict[type, list]:
    """At least one instance of every registered message type (and every nested struct)."""
    lp, lp_ids = logprob_block(3, 2)
    output = M.Output(
        request_id="r1",
        index=1,
        token_ids=arr([5, 6, 7]),
        text="héllo ✓",
        logprobs=lp,
        logprob_token_ids=lp_ids,
        ranks=arr([1, 3, 1]),
        finish_reason="stop",
        stop_reason="\n\n",
        prompt_token_ids=arr([1, 2, 3, 4]),
        num_cached_tokens=16,
    )
    plain_output = M.Output(request_id="r2", token_ids=arr([9]), text="x", stop_reason=2)
    step = M.Step(
        seq=42,
        group="g0",
        new_reqs=[
            M.NewRequest(
                req_id="a",
                token_ids=arr(range(40)),
                num_prompt_tokens=40,
                params=PARAMS,
                seed=123456789012,
                block_ids=arr([3, 4, 5]),
                num_computed_tokens=16,
                num_scheduled_tokens=24,
            ),
            M.NewRequest(req_id="b", token_ids=arr([1]), num_prompt_tokens=1, num_scheduled_tokens=1),
        ],
        cached=M.CachedRequests.build(["c", "d", "e"], [10, 20, 30], [1, 1, 1], [[7], [], [8, 9]]),
        finished_req_ids=["z", "y"],
    )
    slp, slp_ids = logprob_block(2, 3, seed=1)
    return {
        M.Submit: [
            M.Submit(request_id="q", prompt="Hello", params=PARAMS, stream=True, timeout_s=2.5),
            M.Submit(request_id="q2", prompt_token_ids=arr([1, 2, 3]), model_defaults=["temperature", "max_tokens"]),
            M.Submit(request_id="q3", messages=[M.ChatMessage(role="system", content="Be brief."),
                                                M.ChatMessage(role="user", content="Hi ✓", name="ann")]),
        ],
        M.Abort: [M.Abort(request_id="q")],
        M.Ping: [M.Ping(nonce=2**40), M.Ping()],
        M.Pong: [M.Pong(nonce=-5, scheduler_id="sched-1")],
        M.StatsRequest: [M.StatsRequest()],
        M.StatsReply: [M.StatsReply(stats={"running": 3, "groups": {"g0": {"kv_free": 0.5}}, "ids": [1, "a", None, True]})],
        M.ModelsRequest: [M.ModelsRequest()],
        M.ModelsReply: [M.ModelsReply(models=[M.ModelCard(id="tiny", max_model_len=256, groups=2), M.ModelCard(id="b"),
                                              M.ModelCard(id="c", state="failed", reason="bad file", waiting=3)]),
                        M.ModelsReply(),
                        M.ModelsReply(models=[M.ModelCard(id="tiny"), M.ModelCard(id="sql-lora", parent="tiny")])],
        M.LoadLoRA: [M.LoadLoRA(name="sql-lora", path="/adapters/sql"), M.LoadLoRA(name="x", path="/a", model="tiny")],
        M.UnloadLoRA: [M.UnloadLoRA(name="sql-lora")],
        M.LoRAReply: [M.LoRAReply(name="sql-lora"), M.LoRAReply(name="x", ok=False, detail="rank 64 is above 16")],
        M.MetricsRequest: [M.MetricsRequest()],
        M.MetricsReply: [M.MetricsReply(text='# TYPE zeroserve:num_requests_running gauge\nzeroserve:num_requests_running{model_name="tiny"} 2.0\n'),
                         M.MetricsReply()],
        M.Output: [output, plain_output],
        M.Outputs: [M.Outputs(items=[output, plain_output]), M.Outputs()],
        M.Reattach: [
            M.Reattach(submit=M.Submit(request_id="q~1", prompt="Hello", params=PARAMS, stream=True),
                       prompt_token_ids=arr([1, 2, 3]), seed=2**62,
                       seqs=[M.ResumeSeq(index=0, token_ids=arr([4, 5]), chars=7),
                             M.ResumeSeq(index=1, token_ids=arr([6]), chars=2, finish_reason="length")]),
            M.Reattach(submit=M.Submit(request_id="q~2", prompt_token_ids=arr([1]))),
        ],
        M.Error: [M.Error(request_id=None, code="overloaded", message="queue full"), M.Error(request_id="q")],
        M.Hello: [
            M.Hello(
                role="worker",
                worker_id="w0",
                group="g0",
                tp_rank=1,
                tp_size=2,
                model="tiny",
                device="cuda:1",
                host="node-a",
                pid=1234,
                num_kv_blocks=4096,
                block_size=16,
                max_model_len=8192,
                dist_init_addr="tcp://10.0.0.1:29500",
                memory=M.ShardMemory(rss_bytes=3 << 30, param_bytes=1 << 30, kv_bytes=60 << 30),
                kept=[M.KeptSeq(token_ids=arr(range(40)), block_ids=arr([7, 3, 9]))],
            ),
            M.Hello(role="detokenizer", worker_id="detok-1"),
            M.Hello(role="worker", worker_id="p0", pool=True, memory_budget_bytes=2 << 30),
            M.Hello(role="worker", worker_id="w-lora", max_loras=8),
        ],
        M.Welcome: [
            M.Welcome(
                status="accepted",
                group="g0",
                step_addr="tcp://127.0.0.1:5557",
                dist_init_addr="tcp://127.0.0.1:29500",
                scheduler_id="s",
            ),
            M.Welcome(status="refused", detail="model mismatch"),
            M.Welcome(status="rejoin"),
            M.Welcome(status="drained"),
        ],
        M.Heartbeat: [M.Heartbeat(worker_id="w0", stats={"steps": 10, "busy": 0.25})],
        M.Probe: [M.Probe(probe_id="p-1")],
        M.ProbeAck: [M.ProbeAck(worker_id="w0", probe_id="p-1")],
        M.Step: [step, M.Step(seq=0, group="g1"),
                 M.Step(seq=1, new_reqs=[M.NewRequest(req_id="l", token_ids=arr([1]), num_prompt_tokens=1,
                                                      params=SamplingParams(lora="sql"), lora_path="/adapters/sql")])],
        M.StepResult: [
            M.StepResult(
                seq=42,
                worker_id="w0",
                req_ids=["a", "c"],
                sampled_token_ids=arr([17, -1]),
                logprob_token_ids=slp_ids,
                logprobs=slp,
                ranks=arr([1, 2]),
                num_tokens=25,
                step_time_s=0.0125,
            ),
            M.StepResult(seq=1, worker_id="w0"),
        ],
        M.WorkerError: [M.WorkerError(worker_id="w0", seq=3, message="CUDA OOM"), M.WorkerError(worker_id="w0")],
        M.Drain: [M.Drain(worker_id="w0")],
        M.Goodbye: [M.Goodbye(worker_id="w0", reason="SIGTERM")],
        M.Shutdown: [M.Shutdown(reason="zeroserve down")],
        M.Load: [M.Load(load_id="l-1", model="tiny", path="/models/tiny.gguf")],
        M.Unload: [M.Unload(load_id="l-1", reason="idle for 300s (keep_alive)"), M.Unload(load_id="l-2")],
        M.LoadStatus: [
            M.LoadStatus(worker_id="w0", load_id="l-1", phase="loaded", model="tiny", elapsed_s=1.5,
                         memory=M.ShardMemory(rss_bytes=3 << 30, param_bytes=1 << 30, kv_bytes=1 << 29)),
            M.LoadStatus(worker_id="w0", load_id="l-1", phase="failed", error="truncated safetensors"),
        ],
        M.ModelsControl: [M.ModelsControl(action="load", model="tiny"), M.ModelsControl(action="unload", model="x")],
        M.DetokNew: [
            M.DetokNew(
                items=[
                    M.DetokRequest(req_id="a-0", prompt_token_ids=arr([1, 2]), params=PARAMS),
                    M.DetokRequest(
                        req_id="a-1", prompt_token_ids=arr([1, 2]), output_token_ids=arr([5, 6]), text_offset=3
                    ),
                ]
            )
        ],
        M.DetokTokens: [M.DetokTokens.build(7, ["a-0", "a-1", "b"], [[5], [], [6, 7]], [None, "length", None])],
        M.DetokOutputs: [M.DetokOutputs(seq=7, req_ids=["a-0", "b"], text_deltas=["he", ""], stop_strs=[None, "\n\n"]),
                         M.DetokOutputs(seq=8, req_ids=["a-0", "b"], text_deltas=["he", ""], stop_strs=[None, "\n\n"],
                                        stop_tokens=[2, 1])],
        M.DetokFree: [M.DetokFree(req_ids=["a-0"])],
        M.Event: [M.Event(kind="group_joined", ts=1.5, data={"group": "g0", "ranks": [0, 1], "x": {"y": None}})],
    }


SAMPLES = sample_messages()
ALL_SAMPLES = [m for ms in SAMPLES.values() for m in ms]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def messages_equal(a: Any, b: Any) -> bool:
    """Deep equality: arrays by dtype, shape and bytes (NaN-exact, subclass ignored), structs by
    type and fields, floats with NaN == NaN, everything else by type and value."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())
    if type(a) is not type(b):
        return False
    if isinstance(a, msgspec.Struct):
        return all(messages_equal(x, y) for x, y in zip(msgspec.structs.astuple(a), msgspec.structs.astuple(b)))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(messages_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(messages_equal(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def frames_as_bytes(frames):
    return [bytes(f) for f in frames]


def tag(cls: type) -> bytes:
    return cls.__name__.encode()


def assert_bad(frames, *fragments, **kw) -> str:
    with pytest.raises(C.ProtocolError) as ei:
        C.decode(frames, **kw)
    reason = str(ei.value)
    for frag in fragments:
        assert frag in reason, f"{frag!r} not in {reason!r}"
    assert ei.value.reason == reason
    assert "malformed message" not in reason, reason  # the catch-all: every case should be foreseen
    return reason


def body_of(msg) -> list:
    return msgpack.unpackb(bytes(C.encode(msg)[1]))


def reencode(msg, body) -> list[bytes]:
    return [C.encode(msg)[0], msgpack.packb(body, use_bin_type=True)]


def fi(cls: type, name: str) -> int:
    """Position of a field in the wire array."""
    return cls.__struct_fields__.index(name)


class Unchecked:
    """A struct's fields as a sender would put them on the wire, never validated here."""

    def __init__(self, cls: type, **kw: Any) -> None:
        unknown = set(kw) - set(cls.__struct_fields__)
        assert not unknown, unknown
        self.cls, self.kw = cls, kw

    def build(self) -> Any:
        """Construct it for real (what a sender does): runs coercion and check()."""
        return self.cls(**{k: _build(v) for k, v in self.kw.items()})


def _build(v: Any) -> Any:
    if isinstance(v, Unchecked):
        return v.build()
    if isinstance(v, list):
        return [_build(x) for x in v]
    return v


def _field_value(cls: type, f: msgspec.structs.FieldInfo, kw: dict) -> Any:
    if f.name in kw:
        return kw[f.name]
    if f.default is not msgspec.NODEFAULT:
        return f.default
    if f.default_factory is not msgspec.NODEFAULT:
        return f.default_factory()
    raise AssertionError(f"{cls.__name__}.{f.name} needs a value")


def _is_default(v: Any, default: Any) -> bool:
    """msgspec's omit_defaults: equal and of the same type (temperature=1 is sent, 1.0 is not)."""
    return type(v) is type(default) and v == default


def wire(v: Any, bufs: list | None = None) -> Any:
    """A value as plain msgpack data in the documented v2 layout, built without the codec:
    structs are arrays of their fields in declaration order, SamplingParams and ChatMessage
    maps of the fields that differ from their defaults, arrays ``[dtype code, shape, bin]`` (or, with
    ``bufs``, ``[dtype code, shape, frame index]`` with the bytes appended to ``bufs``)."""
    if isinstance(v, msgspec.Struct) and not type(v).__struct_config__.array_like:  # SamplingParams, ChatMessage
        out = {}
        for f, x in zip(msgspec.structs.fields(v), msgspec.structs.astuple(v)):
            if f.required or not _is_default(x, _field_value(type(v), f, {})):
                out[f.name] = wire(x, bufs)
        return out
    if isinstance(v, Unchecked) and not v.cls.__struct_config__.array_like:
        return {k: wire(x, bufs) for k, x in v.kw.items()}
    if isinstance(v, Unchecked):
        return [wire(_field_value(v.cls, f, v.kw), bufs) for f in msgspec.structs.fields(v.cls)]
    if isinstance(v, msgspec.Struct):
        return [wire(x, bufs) for x in msgspec.structs.astuple(v)]
    if isinstance(v, np.ndarray):
        code = {dt: c for c, dt in C.DTYPE_CODES.items()}[v.dtype]
        data = np.ascontiguousarray(v).tobytes()
        if bufs is None:
            return [code, list(v.shape), data]
        bufs.append(data)
        return [code, list(v.shape), len(bufs) - 1]
    if isinstance(v, (list, tuple)):
        return [wire(x, bufs) for x in v]
    if isinstance(v, dict):
        return {k: wire(x, bufs) for k, x in v.items()}
    return v


def packed(v: Unchecked | Any) -> list[bytes]:
    """Frames of a message body built with plain msgpack (inline arrays)."""
    cls = v.cls if isinstance(v, Unchecked) else type(v)
    return [tag(cls), msgpack.packb(wire(v), use_bin_type=True)]


def walk(v: Any):
    yield v
    if isinstance(v, msgspec.Struct):
        for x in msgspec.structs.astuple(v):
            yield from walk(x)
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from walk(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from walk(x)


def load_v1():
    """Protocol v1 (common/protocol.py) as it was last committed, imported as `protocol_v1`;
    None when there is no git history to read it from."""
    if "protocol_v1" in sys.modules:
        return sys.modules["protocol_v1"]
    try:
        rev = subprocess.run(["git", "rev-list", "-1", "HEAD", "--", "common/protocol.py"], cwd=ROOT,
                             capture_output=True, text=True, timeout=30).stdout.strip()
        src = None
        for r in (rev, f"{rev}^"):
            p = subprocess.run(["git", "show", f"{r}:common/protocol.py"], cwd=ROOT, capture_output=True,
                               text=True, timeout=30)
            if p.returncode == 0 and "PROTOCOL_VERSION = 1" in p.stdout:
                src = p.stdout
                break
    except (OSError, subprocess.SubprocessError):
        return None
    if not rev or src is None:
        return None
    spec = importlib.util.spec_from_loader("protocol_v1", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["protocol_v1"] = mod  # dataclasses look their module up while the class is made
    try:
        exec(compile(src, "protocol_v1.py", "exec"), mod.__dict__)
    except Exception:
        del sys.modules["protocol_v1"]
        raise
    return mod


# --------------------------------------------------------------------------------------------
# catalogue and round trips
# --------------------------------------------------------------------------------------------


def test_every_message_type_has_samples():
    assert set(SAMPLES) == set(M.MESSAGE_TYPES.values())
    assert M.PROTOCOL_VERSION == 2
    for t, cls in M.MESSAGE_TYPES.items():
        assert t == cls.__name__.encode()
        assert issubclass(cls, M.Message)
    seen = {type(x) for m in ALL_SAMPLES for x in walk(m)}
    for nested in M.NESTED_TYPES:
        assert nested in seen, f"no sample holds a {nested.__name__}"
        assert nested not in M.MESSAGE_TYPES.values()
    assert {c.dtype_.name for c in M.ARRAY_TYPES} <= {dt.name for dt in C.DTYPE_CODES.values()}


def test_protocol_error_is_invalid_request():
    e = C.ProtocolError("bad")
    assert isinstance(e, InvalidRequest) and isinstance(e, ValueError)
    assert e.code == "invalid_request" and e.reason == "bad" and e.identity is None and e.peer_version is None


@pytest.mark.parametrize("msg", ALL_SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = C.encode(msg)
    assert frames[0] == type(msg).__name__.encode()
    for variant in (frames, frames_as_bytes(frames), [bytearray(f) for f in frames],
                    [memoryview(bytes(f)) for f in frames]):
        out = C.decode(variant)
        assert type(out) is type(msg)
        assert messages_equal(out, msg), (out, msg)
    # decoded messages encode again to the same bytes
    assert frames_as_bytes(C.encode(C.decode(frames))) == frames_as_bytes(frames)


@pytest.mark.parametrize("inline", [-1, 0, 8, 1 << 30])
def test_round_trip_inline_and_out_of_band(monkeypatch, inline):
    """Arrays inline in the body or in their own frames (-1: even empty arrays), all decode the same."""
    monkeypatch.setattr(C, "INLINE_ARRAY_MAX_BYTES", inline)
    for msg in ALL_SAMPLES:
        frames = C.encode(msg)
        out = C.decode(frames_as_bytes(frames))
        assert messages_equal(out, msg)
        assert frames_as_bytes(C.encode(out)) == frames_as_bytes(frames)
    # Step sample: 2 arrays per new request, 4 in cached; one of them (b's block_ids) is empty
    n_frames = len(C.encode(SAMPLES[M.Step][0]))
    assert n_frames == {-1: 2 + 8, 0: 2 + 7, 1 << 30: 2}.get(inline, n_frames)


def test_dtypes_and_shapes_preserved():
    msg = SAMPLES[M.StepResult][0]
    out = C.decode(C.encode(msg))
    assert out.sampled_token_ids.dtype == np.int32 and out.sampled_token_ids.shape == (2,)
    assert out.logprobs.dtype == np.float32 and out.logprobs.shape == (2, 4)
    assert out.logprob_token_ids.dtype == np.int32 and out.logprob_token_ids.shape == (2, 4)
    assert isinstance(out.logprobs, M.F32_2D) and isinstance(out.sampled_token_ids, M.I32)
    np.testing.assert_array_equal(out.logprobs, msg.logprobs)
    # NaN / inf / -0.0 logprobs survive bit-exactly, inline and out of band
    lp = np.array([[np.nan, -np.inf, -0.0]], dtype=np.float32)
    lp.view(np.uint32)[0, 0] = 0x7FC01234  # a NaN with a payload
    o = M.Output(request_id="x", token_ids=arr([1]), logprobs=lp, logprob_token_ids=arr([[1, 2, 3]]))
    assert C.decode(C.encode(o)).logprobs.tobytes() == lp.tobytes()
    big = np.full((3000, 2), np.nan, dtype=np.float32)
    big.view(np.uint32)[:, 1] = np.arange(3000, dtype=np.uint32) | 0x7F800001
    o = M.Output(request_id="x", token_ids=np.zeros(3000, I32), logprobs=big, logprob_token_ids=np.zeros((3000, 2), I32))
    frames = C.encode(o)
    assert len(frames) == 4  # both 2-D arrays out of band
    assert C.decode(frames_as_bytes(frames)).logprobs.tobytes() == big.tobytes()


def test_large_arrays_are_zero_copy_frames():
    big = np.arange(100_000, dtype=np.int32)
    msg = M.Submit(request_id="big", prompt_token_ids=big)
    assert msg.prompt_token_ids is big  # the right dtype is not copied at construction
    frames = C.encode(msg)
    assert len(frames) == 3 and memoryview(frames[2]).nbytes == big.nbytes
    assert np.shares_memory(np.frombuffer(frames[2], dtype=np.uint8), big)  # encode did not copy
    received = [bytearray(f) for f in frames]
    out = C.decode(received)
    assert np.shares_memory(out.prompt_token_ids, np.frombuffer(received[2], dtype=np.uint8))  # nor decode
    np.testing.assert_array_equal(out.prompt_token_ids, big)
    assert not C.decode(frames_as_bytes(frames)).prompt_token_ids.flags.writeable
    # just over / at the inline limit
    at = np.zeros(C.INLINE_ARRAY_MAX_BYTES // 4, np.int32)
    assert len(C.encode(M.Submit(request_id="a", prompt_token_ids=at))) == 2
    over = np.zeros(C.INLINE_ARRAY_MAX_BYTES // 4 + 1, np.int32)
    assert len(C.encode(M.Submit(request_id="a", prompt_token_ids=over))) == 3


def test_decoded_arrays_are_read_only_whatever_the_frames():
    frames = C.encode(M.Submit(request_id="big", prompt_token_ids=np.arange(100_000, dtype=np.int32)))
    out = C.decode([bytearray(f) for f in frames])
    assert not out.prompt_token_ids.flags.writeable  # messages.py: "read-only views of the received frames"


def test_encode_converts_lists_scalars_and_other_dtypes():
    msg = M.StepResult(
        seq=np.int64(3),
        worker_id="w",
        req_ids=["a", "b"],
        sampled_token_ids=np.array([1, 2], dtype=np.int64),
        ranks=[1, 1],
        step_time_s=np.float32(0.5),
    )
    # arrays are coerced at construction, numpy scalars at encode
    assert msg.sampled_token_ids.dtype == np.int32 and msg.ranks.dtype == np.int32
    out = C.decode(C.encode(msg))
    assert out.seq == 3 and type(out.seq) is int
    assert out.sampled_token_ids.dtype == np.int32 and out.ranks.dtype == np.int32
    assert out.step_time_s == 0.5 and type(out.step_time_s) is float
    # tuples, ranges and generators-made arrays
    sub = M.Submit(request_id="a", prompt_token_ids=(1, 2, 3))
    assert sub.prompt_token_ids.dtype == np.int32 and sub.prompt_token_ids.tolist() == [1, 2, 3]
    assert M.NewRequest(req_id="a", token_ids=range(4), num_prompt_tokens=4).token_ids.dtype == np.int32
    assert M.Output(request_id="a", token_ids=[1], logprobs=[[0.5]], logprob_token_ids=[[1]]).logprobs.dtype == np.float32
    # non-contiguous and big-endian input
    strided = np.arange(20, dtype=np.int32)[::2]
    be = np.arange(5, dtype=">i4")
    out = C.decode(C.encode(M.DetokTokens.build(0, ["a", "b"], [strided, be])))
    np.testing.assert_array_equal(out.token_ids, np.concatenate([strided, be.astype(np.int32)]))
    out = C.decode(C.encode(M.Submit(request_id="s", prompt_token_ids=strided)))
    np.testing.assert_array_equal(out.prompt_token_ids, strided)
    out = C.decode(C.encode(M.Submit(request_id="s", prompt_token_ids=be)))
    assert out.prompt_token_ids.dtype == np.int32 and out.prompt_token_ids.tolist() == [0, 1, 2, 3, 4]
    # int fields holding floats are refused on the wire
    frames = C.encode(M.Ping(nonce=1.5))
    assert_bad(frames, "Ping.nonce: expected int, got float")


def test_construction_refuses_arrays_it_cannot_coerce():
    with pytest.raises(ValueError, match=r"prompt_token_ids: expected a 1-D int32 array, got shape \(2, 2\)"):
        M.Submit(request_id="a", prompt_token_ids=np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="prompt_token_ids: cannot make a int32 array of list"):
        M.Submit(request_id="a", prompt_token_ids=["x"])
    with pytest.raises(ValueError, match="logprobs: expected a 2-D float32 array"):
        M.Output(request_id="a", token_ids=[1], logprobs=[0.5], logprob_token_ids=[[1]])
    with pytest.raises(ValueError, match="token_ids"):
        M.NewRequest(req_id="a", token_ids=[[1, 2], [3]], num_prompt_tokens=1)  # ragged
    with pytest.raises(ValueError, match="token_ids"):
        M.NewRequest(req_id="a", token_ids=5, num_prompt_tokens=0)  # 0-D


def test_encode_errors_are_protocol_errors():
    with pytest.raises(C.ProtocolError, match="not a registered message type"):
        C.encode(object())
    for nested in (M.NewRequest(req_id="a", token_ids=arr([1]), num_prompt_tokens=1), M.CachedRequests(),
                   M.ModelCard(id="m"), M.ShardMemory(), M.DetokRequest(req_id="a"), SamplingParams()):
        with pytest.raises(C.ProtocolError, match="not a registered"):
            C.encode(nested)  # nested-only structs
    with pytest.raises(ValueError, match="JSON-like"):  # free-form fields are checked where they are built
        M.StatsReply(stats={"x": object()})
    with pytest.raises(C.ProtocolError, match="cannot encode Ping: OverflowError"):
        C.encode(M.Ping(nonce=2**70))
    sub = M.Submit(request_id="a", prompt="x")
    sub.prompt_token_ids = np.arange(3, dtype=np.float64)  # set after construction: not coerced
    with pytest.raises(C.ProtocolError, match="cannot put a float64 array on the wire"):
        C.encode(sub)
    with pytest.raises(C.ProtocolError, match="over the 100-byte message limit"):
        C.encode(M.Submit(request_id="a", prompt="x" * 1000), max_message_size=100)
    with pytest.raises(C.ProtocolError, match="message limit"):  # buffer frames count too
        C.encode(M.Submit(request_id="a", prompt_token_ids=np.zeros(100_000, I32)), max_message_size=200_000)
    # the thread-local buffer list does not leak from a failed encode into the next one
    assert len(C.encode(SAMPLES[M.Ping][0])) == 2


# --------------------------------------------------------------------------------------------
# the wire layout, read with the plain msgpack package (what docs/architecture.md documents)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_of_band", [False, True], ids=["inline", "frames"])
def test_wire_layout_read_with_plain_msgpack(monkeypatch, out_of_band):
    """body = array of the fields in declaration order (``__struct_fields__``), nested structs
    arrays too, SamplingParams a map of its non-default fields, arrays ``[dtype code, shape,
    bin or frame index]`` with int32=1, int64=2, float32=3, every buffer frame used once."""
    assert C.DTYPE_CODES == {1: np.dtype("<i4"), 2: np.dtype("<i8"), 3: np.dtype("<f4")}
    if out_of_band:
        monkeypatch.setattr(C, "INLINE_ARRAY_MAX_BYTES", -1)
    for msg in ALL_SAMPLES:
        frames = frames_as_bytes(C.encode(msg))
        assert frames[0] == type(msg).__name__.encode("ascii")
        body = msgpack.unpackb(frames[1])  # raw=False, strict_map_key=True: str keys, UTF-8 strings
        assert isinstance(body, list) and len(body) == len(type(msg).__struct_fields__)
        bufs: list[bytes] | None = [] if out_of_band else None
        expected = wire(msg, bufs)
        assert messages_equal(body, expected), (type(msg).__name__, body, expected)
        assert frames[2:] == (bufs or [])
    # spot checks, by hand
    sub = SAMPLES[M.Submit][1]
    frames = frames_as_bytes(C.encode(sub))
    body = msgpack.unpackb(frames[1])
    assert body[fi(M.Submit, "request_id")] == "q2" and body[fi(M.Submit, "params")] == {}
    desc = body[fi(M.Submit, "prompt_token_ids")]
    if out_of_band:
        assert desc == [1, [3], 0] and frames[2] == arr([1, 2, 3]).tobytes()
    else:
        assert desc == [1, [3], arr([1, 2, 3]).astype("<i4").tobytes()]
    res = msgpack.unpackb(frames_as_bytes(C.encode(SAMPLES[M.StepResult][0]))[1])
    assert res[fi(M.StepResult, "logprobs")][:2] == [3, [2, 4]]
    nr = msgpack.unpackb(frames_as_bytes(C.encode(SAMPLES[M.Step][0]))[1])[fi(M.Step, "new_reqs")][0]
    assert nr[fi(M.NewRequest, "params")] == {"temperature": 0.0, "seed": 7, "stop": ["\n\n"], "max_tokens": 32,
                                               "logprobs": 2}


def test_plain_msgpack_bodies_decode():
    """A body a third party packs by the documented layout decodes to the same message."""
    for msg in ALL_SAMPLES:
        assert messages_equal(C.decode(packed(msg)), msg), type(msg).__name__
    # trailing fields at their defaults may be left out
    out = C.decode([b"Submit", msgpack.packb(["a", "x"])])
    assert out == M.Submit(request_id="a", prompt="x")
    assert C.decode([b"Ping", msgpack.packb([])]).nonce == 0


# --------------------------------------------------------------------------------------------
# hostile input: each gives a ProtocolError with a readable reason
# --------------------------------------------------------------------------------------------


def test_frame_count_and_type_errors():
    good = C.encode(M.Ping(nonce=1))
    assert_bad(None, "expected a list of frames")
    assert_bad(42, "expected a list of frames")
    assert_bad([], "at least 2 frames")
    assert_bad([b"Ping"], "at least 2 frames")
    assert_bad([b"Ping", 5], "bytes-like")
    assert_bad([b"Ping", "text"], "bytes-like")
    assert_bad([b"Ping", None], "bytes-like")
    assert_bad([b"Nope", good[1]], "unknown message type b'Nope'")
    assert_bad([b"", good[1]], "unknown message type")
    assert_bad([b"ping", good[1]], "unknown message type")  # tags are case-sensitive
    assert_bad([b"Message", b"\x90"], "unknown message type")  # the base class is no message
    assert_bad([b"NewRequest", b"\x90"], "unknown message type")  # nested-only structs neither
    assert_bad([b"X" * 10_000, good[1]], "unknown message type")
    assert_bad([good[0], good[1], b"extra"], "Ping: 1 buffer frame(s) not referenced by any field [0]")
    assert_bad([b"Ping", b""], "Ping: body is not valid msgpack")
    assert_bad([b"Ping", b"\xc1"], "not valid msgpack")
    assert_bad([b"Ping", good[1] + b"\x00"], "not valid msgpack")  # trailing bytes
    assert len(assert_bad([b"Ping", b"\xc1" * 5000], "not valid msgpack")) <= 300


def test_body_of_the_wrong_shape():
    ping = C.encode(M.Ping(nonce=1))[0]
    assert_bad([ping, msgpack.packb({"nonce": 1})], "Ping: expected list, got map")
    assert_bad([ping, msgpack.packb(7)], "Ping: expected list, got int")
    assert_bad([ping, msgpack.packb("x")], "Ping: expected list, got str")
    assert_bad([ping, msgpack.packb(None)], "Ping: expected list")
    sub = M.Submit(request_id="a", prompt="x")
    assert_bad(reencode(sub, []), "Submit: expected list of at least length 1, got 0")  # a required field missing
    assert_bad([b"Hello", msgpack.packb(["worker", 2])], "Hello: expected list of at least length 3, got 2")


def test_extra_trailing_fields_are_refused():
    assert_bad([b"Ping", msgpack.packb([1, [], 0, 2])], "Ping: expected list of at most length 3, got 4")
    sub = M.Submit(request_id="a", prompt="x")
    n = len(M.Submit.__struct_fields__)
    assert_bad(reencode(sub, body_of(sub) + [None]), f"Submit: expected list of at most length {n}, got {n + 1}")
    step = SAMPLES[M.Step][0]
    body = body_of(step)
    body[fi(M.Step, "new_reqs")][0].append(0)
    assert_bad(reencode(step, body), "Step.new_reqs[0]: expected list of at most length")


@pytest.mark.parametrize(
    "field,value,fragments",
    [
        ("request_id", 5, ["Submit.request_id: expected str, got int"]),
        ("request_id", None, ["Submit.request_id: expected str, got"]),
        ("request_id", b"bytes", ["Submit.request_id: expected str, got bytes"]),
        ("request_id", "", ["Submit.request_id: expected str of length >= 1"]),
        ("request_id", "x" * 257, ["Submit.request_id: expected str of length <= 256"]),
        ("prompt", 3.5, ["Submit.prompt: expected str or nil, got float"]),
        ("params", [], ["Submit.params: expected map, got list"]),
        ("params", {"stop": [b"x"]}, ["Submit.params.stop[0]: expected str, got bytes"]),
        ("params", {"stop": "x"}, ["Submit.params.stop: expected ", " or nil, got str"]),
        ("params", {"temperature": "hot"}, ["Submit.params.temperature: expected float, got str"]),
        ("params", {"n": 0}, ["Submit.params: SamplingParams: n must be an integer in [1, 128], got 0"]),
        ("params", {"bogus": 1}, ["Submit.params", "unknown field", "bogus"]),
        ("params", {1: 1}, ["Submit.params: map key: expected str, got int"]),
        ("stream", 1, ["Submit.stream: expected bool, got int"]),
        ("timeout_s", "soon", ["Submit.timeout_s: expected float or nil, got str"]),
        ("timeout_s", -1.0, ["Submit.timeout_s: expected float > 0"]),
        ("timeout_s", 0, ["Submit.timeout_s: expected float > 0"]),
        ("timeout_s", float("nan"), ["Submit.timeout_s: expected float > 0"]),
        ("timeout_s", float("inf"), ["Submit.timeout_s: expected float <= 1000000000"]),
        ("prompt_token_ids", [3, [2], b"\x00" * 8], ["Submit.prompt_token_ids: expected int32 array", "got float32"]),
        ("prompt_token_ids", [1, 2], ["Submit.prompt_token_ids: expected an array descriptor"]),
        ("prompt_token_ids", [1, 2, 3], ["Submit.prompt_token_ids: expected int32 array with 1 dimension, got shape 2"]),
    ],
)
def test_wrong_field_types(field, value, fragments):
    sub = M.Submit(request_id="a", prompt="x", params=SamplingParams(temperature=0.5))
    body = body_of(sub)
    body[fi(M.Submit, field)] = value
    frames = [b"Submit", msgpack.packb(body, use_bin_type=True, strict_types=False)]
    assert_bad(frames, *fragments)


def test_bad_submit_names_its_request_id():
    """So the scheduler can answer the client's request with an Error it can match."""
    sub = M.Submit(request_id="req-7", prompt="x")
    body = body_of(sub)
    body[fi(M.Submit, "stream")] = "yes"
    with pytest.raises(C.ProtocolError) as ei:
        C.decode(reencode(sub, body))
    assert ei.value.request_id == "req-7"
    for bad_id in (5, "", "x" * 300):
        body = body_of(sub)
        body[fi(M.Submit, "request_id")] = bad_id
        with pytest.raises(C.ProtocolError) as ei:
            C.decode(reencode(sub, body))
        assert ei.value.request_id is None
    with pytest.raises(C.ProtocolError) as ei:  # other types name none
        C.decode([b"Abort", msgpack.packb(["req-7", 1])])
    assert ei.value.request_id is None


def test_nil_is_called_nil():
    sub = M.Submit(request_id="a", prompt="x")
    body = body_of(sub)
    body[0] = None
    assert_bad(reencode(sub, body), "Submit.request_id: expected str, got nil")


def test_nested_paths_in_reasons():
    step = SAMPLES[M.Step][0]
    S, NR, CR = (lambda n: fi(M.Step, n)), (lambda n: fi(M.NewRequest, n)), (lambda n: fi(M.CachedRequests, n))
    body = body_of(step)
    body[S("new_reqs")][1][NR("req_id")] = 17
    assert_bad(reencode(step, body), "Step.new_reqs[1].req_id: expected str, got int")
    body = body_of(step)
    body[S("cached")][CR("req_ids")][2] = 5
    assert_bad(reencode(step, body), "Step.cached.req_ids[2]: expected str, got int")
    body = body_of(step)
    body[S("cached")][CR("new_block_ids")] = [3, [3], b"\x00" * 12]
    assert_bad(reencode(step, body), "Step.cached.new_block_ids: expected int32 array with 1 dimension, got float32")
    body = body_of(step)
    body[S("new_reqs")][0][NR("params")]["stop"] = [5]
    assert_bad(reencode(step, body), "Step.new_reqs[0].params.stop[0]: expected str, got int")
    body = body_of(step)
    body[S("new_reqs")][0][NR("seed")] = -1
    assert_bad(reencode(step, body), "Step.new_reqs[0].seed: expected int >= 0")
    body = body_of(step)
    body[S("new_reqs")][0][NR("block_ids")] = [1, [2], 0]
    assert_bad(reencode(step, body), "Step.new_reqs[0].block_ids: array refers to buffer 0")
    body = body_of(step)
    body[S("finished_req_ids")] = ["a", None]
    assert_bad(reencode(step, body), "Step.finished_req_ids[1]: expected str")
    body = body_of(step)
    body[S("cached")] = {"req_ids": []}
    assert_bad(reencode(step, body), "Step.cached: expected list, got map")
    outs = SAMPLES[M.Outputs][0]
    body = body_of(outs)
    body[0][1][fi(M.Output, "finish_reason")] = 5
    assert_bad(reencode(outs, body), "Outputs.items[1].finish_reason: expected str or nil, got int")
    body = body_of(outs)
    body[0][0][fi(M.Output, "logprobs")] = [3, [3, 2], b"\x00" * 24]
    assert_bad(reencode(outs, body), "Outputs.items[0]: logprobs shape (3, 2) != logprob_token_ids shape (3, 3)")
    hello = SAMPLES[M.Hello][0]
    body = body_of(hello)
    body[fi(M.Hello, "memory")][0] = 1.5
    assert_bad(reencode(hello, body), "Hello.memory.rss_bytes: expected int, got float")
    body = body_of(hello)
    body[fi(M.Hello, "memory")] = {"rss_bytes": 1}
    assert_bad(reencode(hello, body), "Hello.memory: expected list, got map")
    mr = SAMPLES[M.ModelsReply][0]
    body = body_of(mr)
    body[0][1][fi(M.ModelCard, "max_model_len")] = -3
    assert_bad(reencode(mr, body), "ModelsReply.models[1].max_model_len: expected int >= 0")
    dn = SAMPLES[M.DetokNew][0]
    body = body_of(dn)
    body[0][1][fi(M.DetokRequest, "output_token_ids")] = [1, [2], b"\x00" * 4]
    assert_bad(reencode(dn, body), "DetokNew.items[1].output_token_ids: shape [2] of int32 needs 8 bytes, the buffer has 4")
    hb = SAMPLES[M.Heartbeat][0]
    body = body_of(hb)
    body[fi(M.Heartbeat, "stats")]["steps"] = "ten"
    assert_bad(reencode(hb, body), "Heartbeat.stats", "expected int or float, got str")


def test_literal_and_union_fields():
    hello = SAMPLES[M.Hello][0]
    body = body_of(hello)
    body[fi(M.Hello, "role")] = "admin"
    assert_bad(reencode(hello, body), "Hello.role", "admin")
    body[fi(M.Hello, "role")] = 1
    assert_bad(reencode(hello, body), "Hello.role: expected str, got int")
    w = SAMPLES[M.Welcome][0]
    body = body_of(w)
    body[fi(M.Welcome, "status")] = True  # v1's "accepted" bool in v2's status position
    assert_bad(reencode(w, body), "Welcome.status: expected str, got bool")
    body[fi(M.Welcome, "status")] = "maybe"
    assert_bad(reencode(w, body), "Welcome.status", "maybe")
    out = M.Output(request_id="a", token_ids=arr([1]), stop_reason=5)
    body = body_of(out)
    body[fi(M.Output, "stop_reason")] = 1.5
    assert_bad(reencode(out, body), "Output.stop_reason: expected", "str", "int", "nil, got float")
    body[fi(M.Output, "stop_reason")] = True
    assert_bad(reencode(out, body), "Output.stop_reason", "got bool")
    body[fi(M.Output, "stop_reason")] = [1]
    assert_bad(reencode(out, body), "Output.stop_reason", "got list")
    body = body_of(out)
    body[fi(M.Output, "finish_reason")] = "done"
    assert_bad(reencode(out, body), "Output.finish_reason", "done")
    dt = SAMPLES[M.DetokTokens][0]
    body = body_of(dt)
    body[fi(M.DetokTokens, "finish_reasons")][1] = "x"
    assert_bad(reencode(dt, body), "DetokTokens.finish_reasons[1]", "'x'")
    # every union member is accepted
    for v in ("s", 3, None):
        body = body_of(out)
        body[fi(M.Output, "stop_reason")] = v
        assert C.decode(reencode(out, body)).stop_reason == v


def test_literal_reasons_name_the_allowed_values():
    hello = SAMPLES[M.Hello][0]
    body = body_of(hello)
    body[fi(M.Hello, "role")] = "admin"
    assert_bad(reencode(hello, body), "Hello.role", "detokenizer", "worker")


def _array_frames(descriptor, extra=()):
    """A Submit whose prompt_token_ids descriptor is replaced."""
    sub = M.Submit(request_id="a", prompt="x")
    body = body_of(sub)
    body[fi(M.Submit, "prompt_token_ids")] = descriptor
    return reencode(sub, body) + list(extra)


@pytest.mark.parametrize(
    "descriptor,extra,fragments",
    [
        ([1, [2]], (), ["array descriptor"]),
        ([1, [2], b"\x00" * 8, 0], (), ["array descriptor"]),
        ("abc", (), ["array descriptor"]),
        ({"a": 1}, (), ["array descriptor"]),
        (5, (), ["array descriptor"]),
        (b"\x00" * 8, (), ["array descriptor"]),
        ([9, [2], b"\x00" * 8], (), ["unknown dtype code 9"]),
        ([0, [2], b"\x00" * 8], (), ["unknown dtype code 0"]),
        ([-1, [2], b"\x00" * 8], (), ["unknown dtype code -1"]),
        ([3, [2], b"\x00" * 8], (), ["expected int32 array", "got float32"]),
        ([2, [1], b"\x00" * 8], (), ["got int64"]),
        (["i4", [2], b"\x00" * 8], (), ["unknown dtype code 'i4'"]),
        ([True, [2], b"\x00" * 8], (), ["unknown dtype code True"]),
        ([1.0, [2], b"\x00" * 8], (), ["unknown dtype code 1.0"]),
        ([None, [2], b"\x00" * 8], (), ["unknown dtype code None"]),
        ([1, [2, 1], b"\x00" * 8], (), ["got shape [2, 1]"]),
        ([1, [], b""], (), ["got shape []"]),
        ([1, 2, b"\x00" * 8], (), ["got shape 2"]),
        ([1, None, b""], (), ["got shape None"]),
        ([1, [-2], b"\x00" * 8], (), ["bad array shape"]),
        ([1, [True], b"\x00" * 4], (), ["bad array shape"]),
        ([1, [2.0], b"\x00" * 8], (), ["bad array shape"]),
        ([1, ["2"], b"\x00" * 8], (), ["bad array shape"]),
        ([1, [3], b"\x00" * 8], (), ["needs 12 bytes", "has 8"]),
        ([1, [2], b"\x00" * 7], (), ["needs 8 bytes"]),
        ([1, [2**62], b"\x00" * 8], (), ["bad array shape"]),  # each dimension < 2**31
        ([1, [2**64 - 1], b"\x00" * 8], (), ["bad array shape"]),
        ([1, [2], 0], (), ["buffer 0", "0 buffer frame"]),
        ([1, [2], 1], (b"\x00" * 8,), ["refers to buffer 1"]),
        ([1, [2], -1], (b"\x00" * 8,), ["refers to buffer -1"]),
        ([1, [2], 2**64 - 1], (b"\x00" * 8,), ["refers to buffer 18446744073709551615"]),
        ([1, [2], 0], (b"\x00" * 7,), ["needs 8 bytes", "has 7"]),  # truncated buffer frame
        ([1, [2], 0], (b"\x00" * 8, b"\x00"), ["1 buffer frame(s) not referenced"]),
        ([1, [2], "0"], (b"\x00" * 8,), ["frame index or bin, got str"]),
        ([1, [2], None], (), ["frame index or bin, got"]),
        ([1, [2], True], (b"\x00" * 8,), ["frame index or bin, got bool"]),
        ([1, [2], 0.0], (b"\x00" * 8,), ["frame index or bin, got float"]),
        ([1, [2], [0]], (b"\x00" * 8,), ["frame index or bin, got list"]),
    ],
)
def test_bad_array_descriptors(descriptor, extra, fragments):
    reason = assert_bad(_array_frames(descriptor, extra), "Submit", *fragments)
    if "not referenced" not in reason:
        assert reason.startswith("Submit.prompt_token_ids: ")


@pytest.mark.parametrize("shape", [[0, 2**62], [0, 2**63], [0, 2**64 - 1], [2**63, 0], [2**40, 2**40], [1, 2**31]])
def test_bad_2d_shapes(shape):
    """Zero-sized arrays with absurd other dimensions: refused naming the field, never an overflow."""
    body = body_of(M.Output(request_id="r", token_ids=arr([1])))
    body[fi(M.Output, "logprobs")] = [3, shape, b""]
    body[fi(M.Output, "logprob_token_ids")] = [1, shape, b""]
    assert_bad([b"Output", msgpack.packb(body)], "Output.logprob")


def test_buffer_referenced_twice():
    res = M.StepResult(seq=1, worker_id="w", req_ids=["a", "b"], sampled_token_ids=arr([1, 2]), ranks=arr([1, 1]))
    body = body_of(res)
    body[fi(M.StepResult, "sampled_token_ids")] = [1, [2], 0]
    body[fi(M.StepResult, "ranks")] = [1, [2], 0]
    frames = reencode(res, body) + [b"\x00" * 8]
    assert_bad(frames, "StepResult.ranks: buffer frame 0 is referenced twice")
    # and a referenced + an unreferenced frame
    body[fi(M.StepResult, "ranks")] = [1, [2], b"\x00" * 8]
    assert_bad(reencode(res, body) + [b"\x00" * 8, b"\x00" * 8], "StepResult: 1 buffer frame(s) not referenced", "[1]")


def test_good_out_of_band_descriptor_decodes():
    out = C.decode(_array_frames([1, [2], 0], (np.array([7, 8], dtype=np.int32).tobytes(),)))
    np.testing.assert_array_equal(out.prompt_token_ids, [7, 8])
    # buffer frames may come in any order the descriptors name
    res = M.StepResult(seq=1, worker_id="w", req_ids=["a", "b"], sampled_token_ids=arr([1, 2]), ranks=arr([3, 4]))
    body = body_of(res)
    body[fi(M.StepResult, "sampled_token_ids")] = [1, [2], 1]
    body[fi(M.StepResult, "ranks")] = [1, [2], 0]
    out = C.decode(reencode(res, body) + [arr([3, 4]).tobytes(), arr([1, 2]).tobytes()])
    assert messages_equal(out, res)
    # bytes-like frames of any kind, including a non-byte memoryview
    frames = C.encode(M.Submit(request_id="a", prompt_token_ids=np.arange(10_000, dtype=np.int32)))
    frames[2] = memoryview(np.arange(10_000, dtype=np.int32))
    assert C.decode(frames).prompt_token_ids.tolist() == list(range(10_000))


def test_oversized_messages():
    frames = C.encode(M.Submit(request_id="a", prompt="x" * 10_000))
    assert_bad(frames, "over the 1000-byte limit", max_message_size=1000)
    big = C.encode(M.Submit(request_id="a", prompt_token_ids=np.zeros(1000, dtype=np.int32)))
    assert len(big) == 2
    assert_bad(big, "over the 2000-byte limit", max_message_size=2000)
    # the limit counts buffer frames too
    monkey = [big[0], big[1], b"\x00" * 5000]
    assert_bad(monkey, "limit", max_message_size=4000)
    assert C.MAX_MESSAGE_SIZE == 64 * 1024 * 1024
    with pytest.raises(C.ProtocolError, match="over the"):
        C.decode([b"Ping", b"\x91\x01", b"\x00" * (C.MAX_MESSAGE_SIZE + 1)])
    # a body alone over the limit is refused before it is unpacked (no time spent on it)
    huge_body = b"\xdd\xff\xff\xff\xff" + b"\x01" * (C.MAX_MESSAGE_SIZE + 1)
    t0 = time.process_time()
    assert_bad([b"StatsReply", huge_body], "over the 67108864-byte limit")
    assert time.process_time() - t0 < 0.5
    # exactly at the limit is fine
    frames = frames_as_bytes(C.encode(M.Ping(nonce=1)))
    C.decode(frames, max_message_size=sum(map(len, frames)))
    assert_bad(frames, "limit", max_message_size=sum(map(len, frames)) - 1)


def test_msgpack_hazards():
    ping = b"Ping"
    # ext types and timestamps are refused in typed fields
    assert_bad([ping, msgpack.packb([msgpack.ExtType(5, b"abc")])], "Ping.nonce", "got ext")
    ts = msgpack.packb([datetime.datetime.now(datetime.UTC)], datetime=True)
    assert_bad([ping, ts], "Ping.nonce")
    assert_bad([b"Submit", msgpack.packb([msgpack.ExtType(1, b"a"), "x"])], "Submit.request_id")
    # invalid UTF-8
    bad_str = b"\x91\xa2\xff\xfe"
    assert_bad([b"Abort", bad_str], "not valid msgpack", "UTF-8")
    assert_bad([b"StatsReply", msgpack.packb([{"a": b"\xff"}], use_bin_type=False)], "not valid msgpack")
    # non-string map keys
    assert_bad([b"StatsReply", msgpack.packb([{1: 2}])], "StatsReply.stats: map key: expected str, got int")
    assert_bad([b"StatsReply", msgpack.packb([{b"k": 2}], use_bin_type=True)], "StatsReply.stats", "map key")
    assert_bad([b"Heartbeat", msgpack.packb(["w", {1: 2}])], "Heartbeat.stats: map key")
    assert_bad([b"StatsReply", b"\x91\x81\xa1a\x81\x80\x01"], "not valid msgpack")  # an unhashable map as key
    # a huge declared length in a tiny body
    t0 = time.process_time()
    assert_bad([ping, b"\xdd\xff\xff\xff\xff"], "not valid msgpack")
    assert_bad([b"StatsReply", b"\x91\xdf\xff\xff\xff\xff"], "not valid msgpack")
    assert_bad([b"Submit", b"\x91\xdb\xff\xff\xff\xff"], "not valid msgpack")  # str32
    assert_bad([b"Submit", b"\x96\xa1a\xc0\x93\x01\x91\x02\xc6\xff\xff\xff\xff"], "not valid msgpack")  # bin32
    assert_bad([b"Event", b"\x93\xa1k\xcb" + b"\x00" * 8 + b"\xdf\xff\xff\xff\xff"], "not valid msgpack")
    assert time.process_time() - t0 < 0.5


@pytest.mark.parametrize("value", [msgpack.ExtType(5, b"abc"), datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC),
                                   b"bin", {1: 2}, {b"k": 1}, [{None: 1}], {(1, 2): 3}],
                         ids=["ext", "timestamp", "bin", "int-key", "bin-key", "nil-key", "array-key"])
def test_free_form_fields_hold_json_like_values_only(value):
    assert_bad([b"Event", msgpack.packb(["k", 0.0, {"x": value}], use_bin_type=True, datetime=True)], "Event")


def test_numpy_values_in_free_form_fields_round_trip():
    ev = M.Event(kind="k", data={"small": np.arange(3, dtype=np.int32), "big": np.arange(5000, dtype=np.int32)})
    out = C.decode(C.encode(ev))
    assert out.data["small"] == [0, 1, 2] and out.data["big"] == list(range(5000))


def _nest(depth: int, leaf: Any = 1) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@pytest.mark.parametrize("cls,prefix", [(M.StatsReply, []), (M.Event, ["k", 0.0])], ids=["StatsReply", "Event"])
def test_deep_nesting(cls, prefix):
    name = cls.__name__
    # within the 32-level limit of free-form fields (the map itself is level 1)
    ok = C.decode([tag(cls), msgpack.packb(prefix + [{"x": _nest(31)}])])
    assert isinstance(ok, cls)
    assert_bad([tag(cls), msgpack.packb(prefix + [{"x": _nest(32)}])], f"{name}", "nested deeper than 32 levels")
    assert_bad([tag(cls), msgpack.packb(prefix + [{"x": _nest(40)}])], "nested deeper than 32 levels")
    deep_maps: Any = 1
    for _ in range(40):
        deep_maps = {"k": deep_maps}
    assert_bad([tag(cls), msgpack.packb(prefix + [deep_maps])], "nested deeper than 32 levels")
    # the sender is refused the same
    with pytest.raises(ValueError, match="nested deeper than 32 levels"):
        cls(**{"stats" if cls is M.StatsReply else "data": {"x": _nest(40)}}, **({} if cls is M.StatsReply else {"kind": "k"}))
    # far beyond: the decoder's recursion limit (RecursionError) is a ProtocolError too
    head = msgpack.packb(prefix + [{}])[:-1]  # the array header and fixed fields, then the map
    for n in (5_000, 200_000):
        very_deep = head + b"\x81\xa1x" + b"\x91" * n + b"\x01"
        assert_bad([tag(cls), very_deep], name)
        very_deep_maps = head + b"\x81\xa1x" * n + b"\x01"
        assert_bad([tag(cls), very_deep_maps], name)
    # deep nesting where a typed field is expected stops at the first level
    assert_bad([b"Step", b"\x91" * 200_000 + b"\x01"], "Step")
    assert_bad([b"Hello", b"\x91" * 200_000 + b"\x01"], "Hello")  # the version sniffing survives it too
    assert_bad([b"Outputs", b"\x91" * 200_000 + b"\x01"], "Outputs")


# --------------------------------------------------------------------------------------------
# semantic invariants: the sender's constructor refuses them, and the receiver refuses the same
# body packed by hand
# --------------------------------------------------------------------------------------------

U = Unchecked
INVARIANTS = [
    (U(M.Submit, request_id="a"), "Submit", "give a prompt or prompt_token_ids"),
    (U(M.Output, request_id="a", token_ids=[1, 2], logprobs=np.zeros((2, 3), F32)), "Output", "come together"),
    (U(M.Output, request_id="a", token_ids=[1, 2], logprob_token_ids=np.zeros((2, 3), I32)), "Output",
     "come together"),
    (U(M.Output, request_id="a", token_ids=[1, 2], logprobs=np.zeros((1, 3), F32),
       logprob_token_ids=np.zeros((1, 3), I32)), "Output", "does not fit 2 tokens"),
    (U(M.Output, request_id="a", token_ids=[1], logprobs=np.zeros((1, 0), F32),
       logprob_token_ids=np.zeros((1, 0), I32)), "Output", "does not fit 1 tokens"),
    (U(M.Output, request_id="a", token_ids=[1], logprobs=np.zeros((1, 3), F32),
       logprob_token_ids=np.zeros((1, 2), I32)), "Output", "!= logprob_token_ids shape"),
    (U(M.Output, request_id="a", token_ids=[1], ranks=arr([1, 2])), "Output", "ranks has 2 entries for 1 tokens"),
    (U(M.Outputs, items=[U(M.Output, request_id="a", token_ids=[1], ranks=arr([1, 2]))]), "Outputs.items[0]",
     "ranks has 2 entries for 1 tokens"),
    (U(M.Hello, role="worker", worker_id="w", tp_rank=2, tp_size=2), "Hello", "need 0 <= tp_rank < tp_size"),
    (U(M.Step, seq=1, new_reqs=[U(M.NewRequest, req_id="a", token_ids=arr([1, 2]), num_prompt_tokens=3)]),
     "Step.new_reqs[0]", "num_prompt_tokens 3 not in [0, 2]"),
    (U(M.Step, seq=1, new_reqs=[U(M.NewRequest, req_id="a", token_ids=arr([1, 2]), num_prompt_tokens=2),
                                U(M.NewRequest, req_id="b", token_ids=arr([1, 2]), num_prompt_tokens=2,
                                  num_computed_tokens=1, num_scheduled_tokens=2)]),
     "Step.new_reqs[1]", "num_computed_tokens 1 + num_scheduled_tokens 2 > 2 tokens"),
    (U(M.Step, seq=1, cached=U(M.CachedRequests, req_ids=["a"], num_computed_tokens=arr([1]))),
     "Step.cached", "num_scheduled_tokens has 0 entries for 1 req_ids"),
    (U(M.Step, seq=1, cached=U(M.CachedRequests, req_ids=["a"], num_computed_tokens=arr([1]),
                                num_scheduled_tokens=arr([1]), new_block_counts=arr([2]), new_block_ids=arr([1]))),
     "Step.cached", "new_block_counts add up to 2, new_block_ids has 1"),
    (U(M.Step, seq=1, cached=U(M.CachedRequests, req_ids=["a"], num_computed_tokens=arr([1]),
                                num_scheduled_tokens=arr([1]), new_block_counts=arr([-1]), new_block_ids=arr([]))),
     "Step.cached", "must be >= 0"),
    (U(M.Step, seq=1, cached=U(M.CachedRequests, req_ids=["a"], num_computed_tokens=arr([1]),
                                num_scheduled_tokens=arr([-1]), new_block_counts=arr([0]))),
     "Step.cached", "must be >= 0"),
    (U(M.Step, seq=1, cached=U(M.CachedRequests, req_ids=["a", "b"], num_computed_tokens=arr([1, 1]),
                                num_scheduled_tokens=arr([1, 1]), new_block_counts=arr([2**31 - 1, 2]),
                                new_block_ids=arr([1]))),
     "Step.cached", "new_block_counts add up to 2147483649"),  # no int32 overflow in the sum
    (U(M.StepResult, seq=1, worker_id="w", req_ids=["a"]), "StepResult", "sampled_token_ids has 0 entries for 1 req_ids"),
    (U(M.StepResult, seq=1, req_ids=["a"], sampled_token_ids=arr([1]), logprobs=np.zeros((2, 2), F32),
       logprob_token_ids=np.zeros((2, 2), I32)), "StepResult", "must both be (1, 1+k)"),
    (U(M.StepResult, seq=1, req_ids=["a"], sampled_token_ids=arr([1]), logprobs=np.zeros((1, 2), F32)),
     "StepResult", "come together"),
    (U(M.StepResult, seq=1, req_ids=[], ranks=arr([1])), "StepResult", "ranks has 1 entries"),
    (U(M.DetokTokens, seq=1, req_ids=["a"], counts=arr([1]), token_ids=arr([1, 2]), finish_reasons=[None]),
     "DetokTokens", "counts add up to 1"),
    (U(M.DetokTokens, seq=1, req_ids=["a"], counts=arr([1]), token_ids=arr([1])), "DetokTokens",
     "finish_reasons (0) need 1"),
    (U(M.DetokTokens, seq=1, req_ids=["a", "b"], counts=arr([-1, 2]), token_ids=arr([1]), finish_reasons=[None, None]),
     "DetokTokens", "counts must be >= 0"),
    (U(M.DetokOutputs, seq=1, req_ids=["a"], text_deltas=[], stop_strs=[None]), "DetokOutputs", "text_deltas (0)"),
    (U(M.DetokOutputs, seq=1, req_ids=["a"], text_deltas=["x"], stop_strs=[]), "DetokOutputs", "stop_strs (0)"),
    (U(M.DetokOutputs, seq=1, req_ids=["a"], text_deltas=["x"], stop_strs=["x"], stop_tokens=[1, 2]), "DetokOutputs",
     "stop_tokens (2)"),
    (U(M.StatsReply, stats={"x": _nest(40)}), "StatsReply", "nested deeper than 32 levels"),
    (U(M.Event, kind="k", data={"x": _nest(40)}), "Event", "nested deeper than 32 levels"),
    (U(M.Submit, request_id="a", prompt="x", params=U(SamplingParams, n=0)), "Submit.params",
     "SamplingParams: n must be an integer in [1, 128]"),
    (U(M.Submit, request_id="a", prompt="x", params=U(SamplingParams, min_tokens=5, max_tokens=2)), "Submit.params",
     "min_tokens (5) must not exceed max_tokens (2)"),
    (U(M.DetokNew, items=[U(M.DetokRequest, req_id="a", params=U(SamplingParams, top_p=0.0))]),
     "DetokNew.items[0].params", "top_p must be in (0, 1]"),
]


@pytest.mark.parametrize("case,path,fragment", INVARIANTS, ids=lambda x: x.cls.__name__ if isinstance(x, U) else "")
def test_semantic_invariants(case, path, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        case.build()  # the sender finds its mistake where it makes it
    assert_bad(packed(case), f"{path}: ", fragment)


@pytest.mark.parametrize(
    "case,fragment",
    [
        (U(M.Submit, request_id="", prompt="x"), "Submit.request_id: expected str of length >= 1"),
        (U(M.Output, request_id="a", index=-1), "Output.index: expected int >= 0"),
        (U(M.Output, request_id="a", num_cached_tokens=2**31), "Output.num_cached_tokens: expected int <= 2147483647"),
        (U(M.Hello, role="worker", worker_id="w", tp_size=0), "Hello.tp_size: expected int >= 1"),
        (U(M.Hello, role="worker", worker_id=""), "Hello.worker_id: expected str of length >= 1"),
        (U(M.Hello, role="worker", worker_id="w", num_kv_blocks=-1), "Hello.num_kv_blocks: expected int >= 0"),
        (U(M.Step, seq=-1, group="g"), "Step.seq: expected int >= 0"),
        (U(M.Step, seq=2**63, group="g"), "Step.seq: expected int <= 9223372036854775807"),
        (U(M.Step, seq=1, finished_req_ids=[""]), "Step.finished_req_ids[0]: expected str of length >= 1"),
        (U(M.DetokNew, items=[U(M.DetokRequest, req_id="a", text_offset=-1)]),
         "DetokNew.items[0].text_offset: expected int >= 0"),
        (U(M.Error, code="x" * 65), "Error.code: expected str of length <= 64"),
        (U(M.Welcome, status="refused", detail="x" * 70_000), "Welcome.detail: expected str of length <= 65536"),
        (U(M.ModelsReply, models=[U(M.ModelCard, id="")]), "ModelsReply.models[0].id: expected str of length >= 1"),
        (U(M.WorkerError, worker_id="w", seq=-1), "WorkerError.seq: expected int >= 0"),
    ],
    ids=lambda x: x.cls.__name__ if isinstance(x, U) else "",
)
def test_field_ranges_checked_by_the_receiver(case, fragment):
    assert_bad(packed(case), fragment)


# --------------------------------------------------------------------------------------------
# version check and v1 peers
# --------------------------------------------------------------------------------------------

V1_HELLO = ["worker", 1, "w9", "g", 0, 1, "m", "", "", 0, 1, 16, 0, {}]


def test_check_version():
    hello = SAMPLES[M.Hello][0]
    assert C.check_version(hello) is None
    assert C.check_version(C.decode(C.encode(hello))) is None
    old = M.Hello(role="worker", worker_id="w9", protocol_version=1)
    decoded = C.decode(C.encode(old))  # a peer with the same layout and another version decodes...
    reason = C.check_version(decoded)  # ...and the scheduler refuses it with a reason
    assert reason and "speaks version 1" in reason and "speaks 2" in reason and "w9" in reason
    future = C.decode([b"Hello", msgpack.packb(["detokenizer", 3, "d1"])])
    assert "speaks version 3" in C.check_version(future) and "detokenizer" in C.check_version(future)


def test_v1_hello_is_refused_naming_the_version():
    with pytest.raises(C.ProtocolError) as ei:
        C.decode([b"Hello", msgpack.packb(V1_HELLO)])
    assert "peer speaks protocol version 1" in ei.value.reason and "this side 2" in ei.value.reason
    assert ei.value.peer_version == 1
    assert ei.value.reason.startswith("Hello.")  # and it names the field that did not fit
    # a v2 HELLO with a bad field is not blamed on the version
    body = body_of(SAMPLES[M.Hello][0])
    body[fi(M.Hello, "group")] = 5
    with pytest.raises(C.ProtocolError) as ei:
        C.decode([b"Hello", msgpack.packb(body)])
    assert ei.value.peer_version is None and "version" not in ei.value.reason


@pytest.mark.parametrize("body", [{"a": 1}, ["worker", "x" * 100, 5], ["worker", [1] * 100, 5], "ab", [],
                                  ["worker", None, "w"], ["worker", True, "w"]],
                         ids=["map", "str", "list", "str-body", "empty", "nil", "bool"])
def test_garbage_hello_has_no_peer_version(body):
    with pytest.raises(C.ProtocolError) as ei:
        C.decode([b"Hello", msgpack.packb(body)])
    assert ei.value.peer_version is None and ei.value.reason.startswith("Hello")


@pytest.mark.parametrize("body", [["worker", "x" * 100, 5], ["worker", [1] * 100, 5]], ids=["str", "list"])
def test_garbage_hello_names_no_version(body):
    with pytest.raises(C.ProtocolError) as ei:
        C.decode([b"Hello", msgpack.packb(body)])
    assert "peer speaks" not in ei.value.reason


def test_v1_refusal_in_v1_layout():
    frames = C.v1_refusal("peer speaks protocol version 1; upgrade")
    assert frames[0] == b"Welcome"
    body = msgpack.unpackb(frames[1])
    assert body[0] is False and body[1] == "peer speaks protocol version 1; upgrade"
    assert len(body) == 7  # v1's Welcome: accepted, reason, group, step_addr, dist_init_addr, scheduler_id, version
    assert body[6] == 2
    # a v2 peer reading it is told what is wrong, too
    assert_bad(frames, "Welcome.status")


def test_v1_peers_against_the_real_v1_codec():
    """v1 (common/protocol.py from git) and v2 side by side: a v1 HELLO is refused naming the
    version, v2's refusal reads as a v1 WELCOME, and no v1 message makes v2 raise anything but
    a readable ProtocolError."""
    v1 = load_v1()
    if v1 is None:
        pytest.skip("no git history with common/protocol.py (v1)")
    assert v1.PROTOCOL_VERSION == 1
    hello = v1.Hello(role="worker", worker_id="w9", group="g", model="m", num_kv_blocks=1, block_size=16)
    frames = v1.encode(hello)
    with pytest.raises(C.ProtocolError) as ei:
        C.decode(frames)
    assert ei.value.peer_version == 1 and "peer speaks protocol version 1" in ei.value.reason
    welcome = v1.decode(C.v1_refusal("peer speaks protocol version 1, this side 2"))
    assert isinstance(welcome, v1.Welcome) and welcome.accepted is False
    assert welcome.reason == "peer speaks protocol version 1, this side 2"
    v1_msgs = [
        hello,
        v1.Ping(nonce=3), v1.Abort(request_id="q"), v1.Heartbeat(worker_id="w", stats={"a": 1}),
        v1.Submit(request_id="q", prompt="hi", params=v1.encode_params(PARAMS)),
        v1.Welcome(accepted=True, group="g"),
        v1.Step(seq=1, group="g", cached_reqs=v1.CachedRequests.build(["a"], [1], [1], [[2]])),
        v1.StepResult(seq=1, worker_id="w", req_ids=["a"], sampled_token_ids=arr([5])),
        v1.Outputs(items=[v1.Output(request_id="a", token_ids=arr([1]), text="x")]),
    ]
    for m in v1_msgs:
        try:
            got = C.decode(v1.encode(m))
        except C.ProtocolError as e:
            assert "malformed" not in e.reason and e.reason.startswith(type(m).__name__), e.reason
        else:  # same layout in both versions
            assert type(got).__name__ == type(m).__name__
    # and the other way: v1 refuses v2 messages with its own ProtocolError, never a crash
    for m in ALL_SAMPLES:
        try:
            v1.decode(C.encode(m))
        except v1.ProtocolError:
            pass


# --------------------------------------------------------------------------------------------
# PUB helpers, params, builders, errors
# --------------------------------------------------------------------------------------------


def test_pub_frames_and_group_topics():
    step = SAMPLES[M.Step][0]
    topic = C.group_topic("g1")
    frames = C.encode_pub(topic, step)
    assert frames[0] == b"g1\x00"
    got_topic, msg = C.decode_pub(frames_as_bytes(frames))
    assert got_topic == topic and messages_equal(msg, step)
    assert not C.group_topic("g10").startswith(C.group_topic("g1"))  # SUB prefix filter is exact
    assert C.group_topic("é") == "é".encode() + b"\x00"
    with pytest.raises(C.ProtocolError, match="at least 3 frames"):
        C.decode_pub([topic, b"Step"])
    for bad in (None, 5, [None, b"Ping", b"\x90"]):
        with pytest.raises(C.ProtocolError):
            C.decode_pub(bad)
    with pytest.raises(C.ProtocolError, match="unknown message type"):
        C.decode_pub([topic, b"Bogus", b"\x90"])
    with pytest.raises(C.ProtocolError, match="topic must be bytes"):
        C.encode_pub("g1", step)
    with pytest.raises(C.ProtocolError, match="over the"):
        C.encode_pub(topic, step, max_message_size=10)
    with pytest.raises(C.ProtocolError, match="limit"):
        C.decode_pub(frames_as_bytes(frames), max_message_size=10)


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0, max_tokens=100, stop="x", seed=3, logprobs=5),
        SamplingParams(max_tokens=None, stop_token_ids=[2, 3], n=4, top_k=-1, ignore_eos=True),
        SamplingParams(temperature=1, top_p=0.5, min_tokens=2, presence_penalty=0.5, model="tiny"),
        SamplingParams(top_k=50, min_p=0.1, repetition_penalty=1.2, frequency_penalty=-0.5,
                       include_stop_str_in_output=True, skip_special_tokens=False),
    ],
)
def test_params_round_trip(sp):
    sub = C.decode(C.encode(M.Submit(request_id="a", prompt="x", params=sp)))
    assert isinstance(sub.params, SamplingParams) and sub.params == sp
    # on the wire: a map of the fields that differ from their defaults, nothing else
    wire_map = body_of(M.Submit(request_id="a", prompt="x", params=sp))[fi(M.Submit, "params")]
    defaults = SamplingParams()
    expected = {k: v for k, v in sp.to_dict().items() if not _is_default(v, getattr(defaults, k))}
    assert wire_map == expected
    assert set(wire_map) <= set(SamplingParams.__struct_fields__)
    # every field spelled out decodes the same
    full = body_of(M.Submit(request_id="a", prompt="x"))
    full[fi(M.Submit, "params")] = sp.to_dict()
    assert C.decode([b"Submit", msgpack.packb(full)]).params == sp
    assert SamplingParams.from_dict(sp.to_dict()) == sp
    # travels the same inside NewRequest and DetokRequest
    nr = M.NewRequest(req_id="a", token_ids=arr([1]), num_prompt_tokens=1, params=sp)
    step = C.decode(C.encode(M.Step(seq=1, new_reqs=[nr])))
    assert step.new_reqs[0].params == sp
    dn = C.decode(C.encode(M.DetokNew(items=[M.DetokRequest(req_id="a", params=sp)])))
    assert dn.items[0].params == sp


def test_params_normalised_and_validated():
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(top_k=-1).top_k == 0
    assert body_of(M.Submit(request_id="a", prompt="x", params=SamplingParams(top_k=-1)))[fi(M.Submit, "params")] == {}
    body = body_of(M.Submit(request_id="a", prompt="x"))
    body[fi(M.Submit, "params")] = {"top_k": -1}  # normalised on decode too
    assert C.decode([b"Submit", msgpack.packb(body)]).params.top_k == 0
    with pytest.raises(InvalidRequest):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequest, match="unknown field"):
        SamplingParams.from_dict({"bogus": 1})
    with pytest.raises(InvalidRequest):
        SamplingParams.from_dict({"temperature": "hot"})


def test_builders_and_splitters():
    cr = M.CachedRequests.build(["a", "b", "c"], [1, 2, 3], [1, 1, 1], [[4, 5], [], [6]])
    assert cr.new_block_counts.tolist() == [2, 0, 1] and cr.new_block_ids.tolist() == [4, 5, 6]
    parts = C.decode(C.encode(M.Step(seq=1, group="g", cached=cr))).cached.blocks_per_request()
    assert [p.tolist() for p in parts] == [[4, 5], [], [6]]
    assert M.CachedRequests().blocks_per_request() == []
    assert [p.tolist() for p in M.CachedRequests.build(["a"], [0], [1], [[]]).blocks_per_request()] == [[]]
    step = M.Step(seq=1, cached=cr, new_reqs=[M.NewRequest(req_id="n", token_ids=arr([1, 2]), num_prompt_tokens=2,
                                                           num_scheduled_tokens=2)])
    assert step.req_ids() == ["a", "b", "c", "n"] and step.total_tokens == 5 and not step.empty
    assert M.Step(seq=1).empty and M.Step(seq=1).total_tokens == 0
    dt = M.DetokTokens.build(3, ["a", "b"], [[1, 2, 3], [4]])
    assert dt.finish_reasons == [None, None]
    assert [p.tolist() for p in C.decode(C.encode(dt)).per_request()] == [[1, 2, 3], [4]]
    assert M.DetokTokens().per_request() == []
    assert M.DetokTokens.build(0, [], []).token_ids.shape == (0,)
    assert [p.tolist() for p in M.DetokTokens.build(1, ["a", "b"], [[], []]).per_request()] == [[], []]
    assert M.Welcome(status="accepted").accepted and not M.Welcome(status="rejoin").accepted


def test_error_message_maps_to_typed_exception():
    from zeroserve.common.errors import Overloaded, RequestTimeout, ZeroserveError

    err = M.Error.from_exception(Overloaded("queue is full"), request_id="r")
    out = C.decode(C.encode(err))
    assert out.code == "overloaded" and out.request_id == "r"
    exc = out.to_exception()
    assert isinstance(exc, Overloaded) and str(exc) == "queue is full"
    pe = M.Error.from_exception(C.ProtocolError("bad frame"))
    assert pe.code == "invalid_request" and isinstance(C.decode(C.encode(pe)).to_exception(), InvalidRequest)
    assert M.Error.from_exception(RuntimeError("boom")).code == "internal"
    assert isinstance(M.Error(code="timeout", message="t").to_exception(), RequestTimeout)
    unknown = M.Error(code="from-the-future", message="?").to_exception()
    assert type(unknown) is ZeroserveError and str(unknown) == "?"


def test_messages_equal():
    a = SAMPLES[M.Step][0]
    assert messages_equal(a, C.decode(C.encode(a)))
    assert not messages_equal(a, SAMPLES[M.Step][1])
    assert not messages_equal(arr([1]), np.array([1], dtype=np.int64))
    assert not messages_equal(arr([1]), [1])
    assert not messages_equal(arr([1, 2]), arr([[1, 2]]))
    assert messages_equal(arr([1]), arr([1]).view(M.I32))
    assert messages_equal(float("nan"), float("nan"))
    assert not messages_equal(1, True) and not messages_equal(1, 1.0)
    assert not messages_equal(M.Ping(nonce=1), M.Abort(request_id="1"))


# --------------------------------------------------------------------------------------------
# fuzz: decode never raises anything but ProtocolError, and what it accepts re-encodes
# --------------------------------------------------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "neg", "big", "float", "nan", "str", "bytes", "bool", "nil", "list", "map", "desc"]
    if depth > 3:
        kinds = kinds[:9]
    k = rng.choice(kinds)
    if k == "int":
        return rng.randint(0, 300)
    if k == "neg":
        return -rng.randint(1, 2**31)
    if k == "big":
        return rng.choice([2**31, 2**63 - 1, 2**64 - 1, -(2**63)])
    if k == "float":
        return rng.uniform(-1e6, 1e6)
    if k == "nan":
        return rng.choice([math.nan, math.inf, -math.inf])
    if k == "str":
        return "".join(rng.choice("ab\x00é✓") for _ in range(rng.randint(0, 5)))
    if k == "bytes":
        return rng.randbytes(rng.randint(0, 12))
    if k == "bool":
        return rng.random() < 0.5
    if k == "nil":
        return None
    if k == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if k == "map":
        return {str(rng.randint(0, 5)): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return [rng.choice([0, 1, 2, 3, 4, -1]), [rng.randint(-1, 4) for _ in range(rng.randint(0, 3))],
            rng.choice([0, 1, -1, b"\x00" * rng.randint(0, 16)])]


def _mutate_structure(rng: random.Random, body):
    """Replace, drop or add one random element somewhere inside a decoded body."""
    if not isinstance(body, (list, dict)) or not body or rng.random() < 0.2:
        return _random_value(rng)
    if isinstance(body, list):
        i = rng.randrange(len(body))
        r = rng.random()
        if r < 0.1:
            return body[:i] + body[i + 1:]
        if r < 0.15:
            return body + [_random_value(rng)]
        body = list(body)
        body[i] = _mutate_structure(rng, body[i])
        return body
    body = dict(body)
    k = rng.choice(list(body))
    if rng.random() < 0.2:
        body[b"k" if rng.random() < 0.5 else str(k) + "x"] = _random_value(rng)
    else:
        body[k] = _mutate_structure(rng, body[k])
    return body


def _check_decode(frames) -> bool:
    try:
        msg = C.decode(frames)
    except C.ProtocolError as e:
        assert isinstance(e.reason, str) and e.reason
        # decode's last-resort net says "malformed message (...)"; every case the fuzz finds
        # should have been foreseen with a precise reason instead
        assert "malformed message" not in e.reason, (e.reason, frames)
        return False
    except Exception as e:  # noqa: BLE001 - this is the bug the fuzz looks for
        pytest.fail(f"decode raised {type(e).__name__}: {e} on {frames!r:.300}")
    assert type(msg) in M.MESSAGE_TYPES.values()
    again = C.decode(C.encode(msg))  # accepted => valid => re-encodes to an equal message
    assert messages_equal(again, msg), (again, msg)
    return True


def test_fuzz_random_frames():
    rng = random.Random(1234)
    tags = list(M.MESSAGE_TYPES)
    accepted = 0
    for _ in range(1500):
        n = rng.randint(0, 5)
        frames = [rng.randbytes(rng.randint(0, 40)) for _ in range(n)]
        if n and rng.random() < 0.7:
            frames[0] = rng.choice(tags)
        if n > 1 and rng.random() < 0.5:
            frames[1] = msgpack.packb(_random_value(rng), use_bin_type=True)
        accepted += _check_decode(frames)
    assert accepted < 150  # random frames rarely make a valid message


def test_fuzz_mutated_valid_messages():
    rng = random.Random(99)
    encoded = [frames_as_bytes(C.encode(m)) for m in ALL_SAMPLES]
    # with out-of-band buffers too
    big = M.Submit(request_id="b", prompt_token_ids=np.arange(5000, dtype=np.int32))
    encoded.append(frames_as_bytes(C.encode(big)))
    res = M.StepResult(seq=1, worker_id="w", req_ids=[f"r{i}" for i in range(3000)],
                       sampled_token_ids=np.arange(3000, dtype=np.int32), ranks=np.ones(3000, np.int32),
                       logprobs=np.zeros((3000, 2), F32), logprob_token_ids=np.zeros((3000, 2), I32))
    encoded.append(frames_as_bytes(C.encode(res)))
    accepted = 0
    for _ in range(2500):
        frames = list(rng.choice(encoded))
        r = rng.random()
        if r < 0.3:  # flip bytes in the body
            body = bytearray(frames[1])
            for _ in range(rng.randint(1, 4)):
                if body:
                    body[rng.randrange(len(body))] = rng.randrange(256)
            frames[1] = bytes(body)
        elif r < 0.4:  # truncate a frame
            i = rng.randrange(len(frames))
            frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
        elif r < 0.5:  # drop, duplicate or swap frames
            if rng.random() < 0.5 and len(frames) > 0:
                del frames[rng.randrange(len(frames))]
            elif rng.random() < 0.5 and len(frames) > 3:
                i, j = rng.sample(range(2, len(frames)), 2)
                frames[i], frames[j] = frames[j], frames[i]
            else:
                frames.insert(rng.randrange(len(frames) + 1), rng.choice(frames))
        elif r < 0.55:  # another type's tag on this body
            frames[0] = rng.choice(list(M.MESSAGE_TYPES))
        else:  # a structural mutation of the decoded body
            body = msgpack.unpackb(frames[1], strict_map_key=False)
            frames[1] = msgpack.packb(_mutate_structure(rng, body), use_bin_type=True)
        accepted += _check_decode(frames)
    assert 50 < accepted < 2000  # the fuzz reaches both sides of the validator


# --------------------------------------------------------------------------------------------
# perf sanity (not a benchmark): the per-step messages are cheap
# --------------------------------------------------------------------------------------------


def _best_of(fn, repeat: int = 7) -> float:
    """Best CPU time of a few runs (CPU time: a busy shared machine does not make it flaky)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def test_step_with_256_requests_encodes_fast():
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=256, seed=1)
    new = [
        M.NewRequest(
            req_id=f"req-{i}",
            token_ids=np.arange(128, dtype=np.int32),
            num_prompt_tokens=128,
            params=params,
            seed=i,
            block_ids=np.arange(8, dtype=np.int32),
            num_scheduled_tokens=128,
        )
        for i in range(256)
    ]
    ids = [f"run-{i}" for i in range(256)]
    cached = M.CachedRequests.build(ids, np.arange(256) + 100, np.ones(256), [[i] if i % 16 == 0 else [] for i in range(256)])
    for step in (M.Step(seq=1, group="g", new_reqs=new), M.Step(seq=2, group="g", cached=cached)):
        frames = C.encode(step)
        assert _best_of(lambda s=step: C.encode(s)) < 5e-3
        assert _best_of(lambda f=frames: C.decode(f)) < 20e-3
    # the steady-state (decode) step and its result are far cheaper
    step = M.Step(seq=2, group="g", cached=cached)
    res = M.StepResult(seq=2, worker_id="w", req_ids=ids, sampled_token_ids=np.arange(256, dtype=np.int32))
    outs = M.Outputs(items=[M.Output(request_id=i, token_ids=arr([7]), text="x") for i in ids])
    assert _best_of(lambda: C.decode(C.encode(step))) < 2e-3
    assert _best_of(lambda: C.decode(C.encode(res))) < 2e-3
    assert _best_of(lambda: C.decode(C.encode(outs))) < 5e-3


def test_pool_messages_refuse_what_their_fields_cannot_say():
    with pytest.raises(ValueError, match="says why"):
        M.LoadStatus(worker_id="w0", load_id="l", phase="failed")
    with pytest.raises(ValueError, match="one shard"):
        M.Hello(role="worker", worker_id="p", pool=True, tp_size=2)
    good = ["w0", "l", "loading", "tiny", "", 1.0]  # LoadStatus's fields in order (memory left out)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(good), type=M.LoadStatus).elapsed_s == 1.0
    for field, bad in ((2, "half"), (5, -1.0), (1, "")):
        raw = list(good)
        raw[field] = bad
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=M.LoadStatus)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(["reload", "tiny"]), type=M.ModelsControl)


def test_new_request_lora_path_comes_with_params_lora():
    with pytest.raises(ValueError, match="lora_path comes with params.lora"):
        M.NewRequest(req_id="a", token_ids=np.array([1], np.int32), num_prompt_tokens=1, lora_path="/a")
    with pytest.raises(ValueError, match="lora_path comes with params.lora"):
        M.NewRequest(req_id="a", token_ids=np.array([1], np.int32), num_prompt_tokens=1,
                     params=SamplingParams(lora="x"))
