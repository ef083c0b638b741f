"""common.protocol: round trips of every message, validation of hostile input, a seeded fuzz."""

from __future__ import annotations

import math
import random
import time

import msgpack
import numpy as np
import pytest

from common import protocol as P
from common.errors import InvalidRequest
from common.sampling_params import SamplingParams

I32 = np.int32
F32 = np.float32


def arr(values, dtype=I32):
    return np.asarray(values, dtype=dtype)


def logprob_block(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        -rng.random((n, 1 + k), dtype=np.float32),
        rng.integers(0, 32000, size=(n, 1 + k), dtype=np.int32),
    )


PARAMS = P.encode_params(SamplingParams(temperature=0.0, max_tokens=32, stop=["\n\n"], logprobs=2, seed=7))


def sample_messages() -> dict[type, list]:
    """At least one instance of every registered message type (and the nested structs)."""
    lp, lp_ids = logprob_block(3, 2)
    output = P.Output(
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
    plain_output = P.Output(request_id="r2", token_ids=arr([9]), text="x", stop_reason=2)
    step = P.Step(
        seq=42,
        group="g0",
        new_reqs=[
            P.NewRequest(
                req_id="a",
                token_ids=arr(range(40)),
                num_prompt_tokens=40,
                params=PARAMS,
                seed=123456789012,
                block_ids=arr([3, 4, 5]),
                num_computed_tokens=16,
                num_scheduled_tokens=24,
            ),
            P.NewRequest(req_id="b", token_ids=arr([1]), num_prompt_tokens=1, num_scheduled_tokens=1),
        ],
        cached_reqs=P.CachedRequests.build(
            ["c", "d", "e"], [10, 20, 30], [1, 1, 1], [[7], [], [8, 9]], resync_tokens={"d": [11, 12]}
        ),
        finished_req_ids=["z", "y"],
    )
    slp, slp_ids = logprob_block(2, 3, seed=1)
    return {
        P.Submit: [
            P.Submit(request_id="q", prompt="Hello", params=PARAMS, stream=True, timeout_s=2.5),
            P.Submit(request_id="q2", prompt_token_ids=arr([1, 2, 3])),
        ],
        P.Abort: [P.Abort(request_id="q")],
        P.Ping: [P.Ping(nonce=2**40)],
        P.Pong: [P.Pong(nonce=-5, scheduler_id="sched-1")],
        P.StatsRequest: [P.StatsRequest()],
        P.StatsReply: [P.StatsReply(stats={"running": 3, "groups": {"g0": {"kv_free": 0.5}}, "ids": [1, "a", None]})],
        P.ModelsRequest: [P.ModelsRequest()],
        P.ModelsReply: [P.ModelsReply(models=[{"id": "tiny", "max_model_len": 256}, {}])],
        P.Output: [output, plain_output],
        P.Outputs: [P.Outputs(items=[output, plain_output]), P.Outputs()],
        P.Error: [P.Error(request_id=None, code="overloaded", message="queue full"), P.Error(request_id="q")],
        P.Hello: [
            P.Hello(
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
                memory={"total_gb": 80.0, "kv_gb": 60.5},
            ),
            P.Hello(role="detokenizer", worker_id="detok-1"),
        ],
        P.Welcome: [
            P.Welcome(
                accepted=True,
                group="g0",
                step_addr="tcp://127.0.0.1:5557",
                dist_init_addr="tcp://127.0.0.1:29500",
                scheduler_id="s",
            ),
            P.Welcome(accepted=False, reason="model mismatch"),
        ],
        P.Heartbeat: [P.Heartbeat(worker_id="w0", stats={"steps": 10, "busy": 0.25})],
        P.Probe: [P.Probe(probe_id="p-1")],
        P.ProbeAck: [P.ProbeAck(worker_id="w0", probe_id="p-1")],
        P.Step: [step, P.Step(seq=0, group="g1")],
        P.StepResult: [
            P.StepResult(
                seq=42,
                worker_id="w0",
                req_ids=["a", "c"],
                sampled_token_ids=arr([17, -1]),
                logprob_token_ids=slp_ids,
                logprobs=slp,
                ranks=arr([1, 2]),
                step_time_s=0.0125,
            ),
            P.StepResult(seq=1, worker_id="w0"),
        ],
        P.WorkerError: [P.WorkerError(worker_id="w0", seq=3, message="CUDA OOM"), P.WorkerError(worker_id="w0")],
        P.Drain: [P.Drain(worker_id="w0")],
        P.Goodbye: [P.Goodbye(worker_id="w0", reason="SIGTERM")],
        P.Shutdown: [P.Shutdown(reason="zeroserve down")],
        P.DetokNew: [
            P.DetokNew(
                items=[
                    P.DetokRequest(req_id="a-0", prompt_token_ids=arr([1, 2]), params=PARAMS),
                    P.DetokRequest(
                        req_id="a-1", prompt_token_ids=arr([1, 2]), output_token_ids=arr([5, 6]), text_offset=3
                    ),
                ]
            )
        ],
        P.DetokTokens: [P.DetokTokens.build(7, ["a-0", "a-1", "b"], [[5], [], [6, 7]], [None, "length", None])],
        P.DetokOutputs: [P.DetokOutputs(seq=7, req_ids=["a-0", "b"], text_deltas=["he", ""], stop_strs=[None, "\n\n"])],
        P.DetokFree: [P.DetokFree(req_ids=["a-0"])],
        P.Event: [P.Event(kind="group_joined", ts=1.5, data={"group": "g0"})],
    }


SAMPLES = sample_messages()
ALL_SAMPLES = [m for ms in SAMPLES.values() for m in ms]


def frames_as_bytes(frames):
    return [bytes(f) for f in frames]


def assert_bad(frames, *fragments, **kw):
    with pytest.raises(P.ProtocolError) as ei:
        P.decode(frames, **kw)
    reason = str(ei.value)
    for frag in fragments:
        assert frag in reason, f"{frag!r} not in {reason!r}"
    assert ei.value.reason == reason
    return reason


def body_of(msg) -> list:
    return msgpack.unpackb(bytes(P.encode(msg)[1]))


def reencode(msg, body) -> list[bytes]:
    return [P.encode(msg)[0], msgpack.packb(body, use_bin_type=True)]


# --------------------------------------------------------------------------------------------
# catalogue and round trips
# --------------------------------------------------------------------------------------------


def test_every_message_type_has_samples():
    assert set(SAMPLES) == set(P.MESSAGE_TYPES.values())
    assert P.PROTOCOL_VERSION == 1
    for tag, cls in P.MESSAGE_TYPES.items():
        assert tag == cls.__name__.encode()
        assert cls.__name__ in P.__doc__, f"{cls.__name__} is not documented in the module docstring"
    for nested in (P.NewRequest, P.CachedRequests, P.DetokRequest):
        assert nested.__name__ in P.__doc__


def test_protocol_error_is_invalid_request():
    e = P.ProtocolError("bad")
    assert isinstance(e, InvalidRequest) and e.code == "invalid_request" and e.reason == "bad"


@pytest.mark.parametrize("msg", ALL_SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = P.encode(msg)
    assert frames[0] == type(msg).__name__.encode()
    for variant in (frames, frames_as_bytes(frames), [bytearray(f) for f in frames], [memoryview(bytes(f)) for f in frames]):
        out = P.decode(variant)
        assert type(out) is type(msg)
        assert P.messages_equal(out, msg), (out, msg)
    # decoded messages encode again to the same bytes
    assert frames_as_bytes(P.encode(P.decode(frames))) == frames_as_bytes(frames)


@pytest.mark.parametrize("inline", [-1, 0, 8, 1 << 30])
def test_round_trip_inline_and_out_of_band(monkeypatch, inline):
    """Arrays inline in the body or in their own frames (-1: even empty arrays), all decode the same."""
    monkeypatch.setattr(P, "INLINE_ARRAY_MAX_BYTES", inline)
    for msg in ALL_SAMPLES:
        frames = P.encode(msg)
        out = P.decode(frames_as_bytes(frames))
        assert P.messages_equal(out, msg)
    n_frames = len(P.encode(SAMPLES[P.Step][0]))  # 9 arrays: 2 per new request, 4 cached, 1 resync
    assert n_frames == {-1: 2 + 9, 1 << 30: 2}.get(inline, n_frames)


def test_dtypes_and_shapes_preserved():
    msg = SAMPLES[P.StepResult][0]
    out = P.decode(P.encode(msg))
    assert out.sampled_token_ids.dtype == np.int32 and out.sampled_token_ids.shape == (2,)
    assert out.logprobs.dtype == np.float32 and out.logprobs.shape == (2, 4)
    assert out.logprob_token_ids.dtype == np.int32 and out.logprob_token_ids.shape == (2, 4)
    np.testing.assert_array_equal(out.logprobs, msg.logprobs)
    # NaN / inf logprobs survive bit-exactly
    lp = np.array([[np.nan, -np.inf]], dtype=np.float32)
    o = P.Output(request_id="x", token_ids=arr([1]), logprobs=lp, logprob_token_ids=arr([[1, 2]]))
    out = P.decode(P.encode(o))
    assert out.logprobs.tobytes() == lp.tobytes()


def test_large_arrays_are_zero_copy_frames():
    big = np.arange(100_000, dtype=np.int32)
    msg = P.Submit(request_id="big", prompt_token_ids=big)
    frames = P.encode(msg)
    assert len(frames) == 3 and memoryview(frames[2]).nbytes == big.nbytes
    assert np.shares_memory(np.frombuffer(frames[2], dtype=np.uint8), big)  # encode did not copy
    received = [bytearray(f) for f in frames]
    out = P.decode(received)
    assert np.shares_memory(out.prompt_token_ids, np.frombuffer(received[2], dtype=np.uint8))  # nor decode
    np.testing.assert_array_equal(out.prompt_token_ids, big)
    assert not P.decode(frames_as_bytes(frames)).prompt_token_ids.flags.writeable


def test_encode_converts_lists_scalars_and_other_dtypes():
    msg = P.StepResult(
        seq=np.int64(3),
        worker_id="w",
        req_ids=["a", "b"],
        sampled_token_ids=np.array([1, 2], dtype=np.int64),
        ranks=[1, 1],
        step_time_s=np.float32(0.5),
    )
    out = P.decode(P.encode(msg))
    assert out.seq == 3 and type(out.seq) is int
    assert out.sampled_token_ids.dtype == np.int32 and out.ranks.dtype == np.int32
    assert out.step_time_s == 0.5 and type(out.step_time_s) is float
    # non-contiguous and big-endian input
    strided = np.arange(20, dtype=np.int32)[::2]
    be = np.arange(5, dtype=">i4")
    out = P.decode(P.encode(P.DetokTokens.build(0, ["a", "b"], [strided, be])))
    np.testing.assert_array_equal(out.token_ids, np.concatenate([strided, be.astype(np.int32)]))
    # int fields holding floats are refused on the wire
    frames = P.encode(P.Ping(nonce=1.5))
    assert_bad(frames, "Ping.nonce", "expected int, got float")


def test_encode_errors_are_protocol_errors():
    with pytest.raises(P.ProtocolError, match="not a registered message type"):
        P.encode(object())
    with pytest.raises(P.ProtocolError, match="not a registered"):
        P.encode(P.NewRequest(req_id="a", token_ids=arr([1]), num_prompt_tokens=1))  # nested-only struct
    with pytest.raises(P.ProtocolError, match="Submit"):
        P.encode(P.Submit(request_id="a", prompt_token_ids=np.zeros((2, 2), dtype=np.int32)))  # 2-D
    with pytest.raises(P.ProtocolError, match="cannot encode"):
        P.encode(P.Submit(request_id="a", prompt_token_ids=["x"]))
    with pytest.raises(P.ProtocolError, match="cannot encode"):
        P.encode(P.StatsReply(stats={"x": object()}))
    with pytest.raises(P.ProtocolError, match="message limit"):
        P.encode(P.Submit(request_id="a", prompt="x" * 1000), max_message_size=100)


# --------------------------------------------------------------------------------------------
# hostile input: each gives a ProtocolError with a readable reason
# --------------------------------------------------------------------------------------------


def test_frame_count_and_type_errors():
    good = P.encode(P.Ping(nonce=1))
    assert_bad(None, "expected a list of frames")
    assert_bad(42, "expected a list of frames")
    assert_bad([], "at least 2 frames")
    assert_bad([b"Ping"], "at least 2 frames")
    assert_bad([b"Ping", 5], "bytes-like")
    assert_bad([b"Nope", good[1]], "unknown message type")
    assert_bad([b"", good[1]], "unknown message type")
    assert_bad([good[0], good[1], b"extra"], "not referenced")
    assert_bad([b"Ping", b""], "not valid msgpack")
    assert_bad([b"Ping", b"\xc1"], "not valid msgpack")
    assert_bad([b"Ping", good[1] + b"\x00"], "not valid msgpack")  # trailing bytes


def test_body_of_the_wrong_shape():
    ping = P.encode(P.Ping(nonce=1))[0]
    assert_bad([ping, msgpack.packb({"nonce": 1})], "expected a list of 1 Ping fields ['nonce'], got map")
    assert_bad([ping, msgpack.packb(7)], "Ping fields", "got int")
    assert_bad([ping, msgpack.packb([])], "got a list of 0")
    assert_bad([ping, msgpack.packb([1, 2])], "got a list of 2")  # extra field
    sub = P.Submit(request_id="a", prompt="x")
    body = body_of(sub)
    assert_bad(reencode(sub, body[:-1]), "expected a list of 6 Submit fields", "got a list of 5")  # missing field
    assert_bad(reencode(sub, body + [None]), "got a list of 7")


@pytest.mark.parametrize(
    "index,value,fragments",
    [
        (0, 5, ["Submit.request_id", "expected str, got int"]),
        (0, None, ["Submit.request_id", "expected str, got nil"]),
        (0, b"bytes", ["expected str, got bytes"]),
        (1, 3.5, ["Submit.prompt", "expected str or nil"]),
        (3, [], ["Submit.params", "expected map, got list"]),
        (3, {"stop": [b"x"]}, ["Submit.params['stop'][0]", "JSON-like"]),
        (4, 1, ["Submit.stream", "expected bool, got int"]),
        (5, "soon", ["Submit.timeout_s", "expected float or nil, got str"]),
        (5, -1.0, ["timeout_s must be a positive"]),
        (5, float("nan"), ["timeout_s must be a positive"]),
        (2, [3, [2], b"\x00" * 8], ["Submit.prompt_token_ids", "expected int32 array", "got float32"]),
    ],
)
def test_wrong_field_types(index, value, fragments):
    sub = P.Submit(request_id="a", prompt="x", params={"temperature": 0.5})
    body = body_of(sub)
    body[index] = value
    assert_bad(reencode(sub, body), *fragments)


def test_nested_paths_in_reasons():
    step = SAMPLES[P.Step][0]
    body = body_of(step)
    body[2][1][0] = 17  # new_reqs[1].req_id
    assert_bad(reencode(step, body), "Step.new_reqs[1].req_id: expected str, got int")
    body = body_of(step)
    body[3][0][2] = 5  # cached_reqs.req_ids[2]
    assert_bad(reencode(step, body), "Step.cached_reqs.req_ids", "[2]", "expected str, got int")
    body = body_of(step)
    body[3][5]["d"] = [3, [2], b"\x00" * 8]  # resync float32
    assert_bad(reencode(step, body), "Step.cached_reqs.resync_tokens['d']", "got float32")
    body = body_of(step)
    body[4] = ["a", None]
    assert_bad(reencode(step, body), "Step.finished_req_ids", "[1]", "got nil")
    outs = SAMPLES[P.Outputs][0]
    body = body_of(outs)
    body[0][1][7] = 5  # items[1].finish_reason
    assert_bad(reencode(outs, body), "Outputs.items[1].finish_reason: expected str or nil, got int")


def test_literal_and_union_fields():
    hello = SAMPLES[P.Hello][0]
    body = body_of(hello)
    body[0] = "admin"
    assert_bad(reencode(hello, body), "Hello.role", "expected one of ['detokenizer', 'worker']")
    out = P.Output(request_id="a", token_ids=arr([1]), stop_reason=5)
    body = body_of(out)
    body[8] = 1.5
    assert_bad(reencode(out, body), "Output.stop_reason: expected str or int or nil, got float")
    body[8] = True
    assert_bad(reencode(out, body), "Output.stop_reason", "got bool")


def _array_frames(descriptor, extra=()):
    """A Submit whose prompt_token_ids descriptor is replaced."""
    sub = P.Submit(request_id="a", prompt="x")
    body = body_of(sub)
    body[2] = descriptor
    return reencode(sub, body) + list(extra)


@pytest.mark.parametrize(
    "descriptor,extra,fragments",
    [
        ([1, [2]], (), ["array descriptor"]),
        ("abc", (), ["array descriptor"]),
        ([9, [2], b"\x00" * 8], (), ["unknown dtype code 9"]),
        ([3, [2], b"\x00" * 8], (), ["expected int32 array", "got float32"]),
        ([2, [1], b"\x00" * 8], (), ["got int64"]),
        (["i4", [2], b"\x00" * 8], (), ["unknown dtype code 'i4'"]),
        ([1, [2, 1], b"\x00" * 8], (), ["got shape [2, 1]"]),
        ([1, [], b""], (), ["got shape []"]),
        ([1, 2, b"\x00" * 8], (), ["got shape 2"]),
        ([1, [-2], b"\x00" * 8], (), ["bad array shape"]),
        ([1, [True], b"\x00" * 4], (), ["bad array shape"]),
        ([1, [3], b"\x00" * 8], (), ["needs 12 bytes", "has 8"]),
        ([1, [2], b"\x00" * 7], (), ["needs 8 bytes"]),
        ([1, [2**62], b"\x00" * 8], (), ["needs"]),
        ([1, [2], 0], (), ["buffer 0", "0 buffer frame"]),
        ([1, [2], 1], (b"\x00" * 8,), ["refers to buffer 1"]),
        ([1, [2], -1], (b"\x00" * 8,), ["refers to buffer -1"]),
        ([1, [2], 0], (b"\x00" * 7,), ["needs 8 bytes", "has 7"]),  # truncated buffer frame
        ([1, [2], 0], (b"\x00" * 8, b"\x00"), ["1 buffer frame(s) not referenced"]),
        ([1, [2], "0"], (b"\x00" * 8,), ["frame index or bin, got str"]),
        ([1, [2], None], (), ["frame index or bin, got nil"]),
    ],
)
def test_bad_array_descriptors(descriptor, extra, fragments):
    reason = assert_bad(_array_frames(descriptor, extra), "Submit", *fragments)
    if "not referenced" not in reason:
        assert reason.startswith("Submit.prompt_token_ids: ")


def test_buffer_referenced_twice():
    res = P.StepResult(seq=1, worker_id="w", req_ids=["a", "b"], sampled_token_ids=arr([1, 2]), ranks=arr([1, 1]))
    body = body_of(res)
    body[3] = [1, [2], 0]
    body[6] = [1, [2], 0]
    frames = reencode(res, body) + [b"\x00" * 8]
    assert_bad(frames, "StepResult.ranks", "referenced twice")


def test_good_out_of_band_descriptor_decodes():
    out = P.decode(_array_frames([1, [2], 0], (np.array([7, 8], dtype=np.int32).tobytes(),)))
    np.testing.assert_array_equal(out.prompt_token_ids, [7, 8])


def test_oversized_messages():
    frames = P.encode(P.Submit(request_id="a", prompt="x" * 10_000))
    assert_bad(frames, "over the 1000-byte limit", max_message_size=1000)
    big = P.encode(P.Submit(request_id="a", prompt_token_ids=np.zeros(1000, dtype=np.int32)))
    assert_bad(big, "over the 2000-byte limit", max_message_size=2000)
    # the limit counts buffer frames too
    monkey = [big[0], big[1], b"\x00" * 5000]
    assert_bad(monkey, "limit", max_message_size=4000)
    assert P.MAX_MESSAGE_SIZE == 64 * 1024 * 1024
    with pytest.raises(P.ProtocolError, match="over the"):
        P.decode([b"Ping", b"\x91\x01", b"\x00" * (P.MAX_MESSAGE_SIZE + 1)])


def test_msgpack_hazards():
    ping = b"Ping"
    # ext types and timestamps are refused
    assert_bad([ping, msgpack.packb([msgpack.ExtType(5, b"abc")])], "not valid msgpack")
    import datetime

    ts = msgpack.packb([datetime.datetime.now(datetime.UTC)], datetime=True)
    assert_bad([ping, ts], "not valid msgpack")
    # invalid UTF-8
    bad_str = b"\x91\xa2\xff\xfe"
    assert_bad([b"Abort", bad_str], "not valid msgpack")
    # non-string map keys
    stats = msgpack.packb([{1: 2}])
    assert_bad([b"StatsReply", stats], "not valid msgpack")
    stats = msgpack.packb([{b"k": 2}], use_bin_type=True)
    assert_bad([b"StatsReply", stats], "StatsReply.stats", "map key must be str")
    # deep nesting
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    assert_bad([b"StatsReply", msgpack.packb([{"x": deep}])], "nested deeper")
    very_deep = b"\x91" + b"\x91" * 5000 + b"\x01"
    assert_bad([b"StatsReply", very_deep], "StatsReply")
    # a huge declared length in a tiny body
    assert_bad([ping, b"\xdd\xff\xff\xff\xff"], "not valid msgpack")
    assert_bad([b"StatsReply", b"\x91\xdf\xff\xff\xff\xff"], "not valid msgpack")


@pytest.mark.parametrize(
    "msg,fragment",
    [
        (P.Submit(request_id="", prompt="x"), "request_id must not be empty"),
        (P.Submit(request_id="a"), "give a prompt or prompt_token_ids"),
        (P.Output(request_id="a", index=-1), "index must be >= 0"),
        (P.Output(request_id="a", token_ids=arr([1, 2]), logprobs=np.zeros((2, 3), F32)), "come together"),
        (
            P.Output(request_id="a", token_ids=arr([1, 2]), logprobs=np.zeros((1, 3), F32), logprob_token_ids=np.zeros((1, 3), I32)),
            "does not fit 2 tokens",
        ),
        (
            P.Output(request_id="a", token_ids=arr([1]), logprobs=np.zeros((1, 3), F32), logprob_token_ids=np.zeros((1, 2), I32)),
            "!= logprob_token_ids shape",
        ),
        (P.Output(request_id="a", token_ids=arr([1]), ranks=arr([1, 2])), "ranks has 2 entries for 1 tokens"),
        (P.Hello(role="worker", worker_id="w", tp_rank=2, tp_size=2), "need 0 <= tp_rank < tp_size"),
        (P.Hello(role="worker", worker_id="w", tp_size=0), "tp_size"),
        (P.Hello(role="worker", worker_id=""), "worker_id must not be empty"),
        (P.Hello(role="worker", worker_id="w", num_kv_blocks=-1), "must be >= 0"),
        (P.Step(seq=-1, group="g"), "seq must be >= 0"),
        (
            P.Step(seq=1, group="g", new_reqs=[P.NewRequest(req_id="a", token_ids=arr([1, 2]), num_prompt_tokens=3)]),
            "Step.new_reqs[0]: num_prompt_tokens 3 not in [0, 2]",
        ),
        (
            P.Step(
                seq=1,
                group="g",
                new_reqs=[
                    P.NewRequest(req_id="a", token_ids=arr([1, 2]), num_prompt_tokens=2, num_computed_tokens=1, num_scheduled_tokens=2)
                ],
            ),
            "> 2 tokens",
        ),
        (
            P.Step(seq=1, group="g", cached_reqs=P.CachedRequests(req_ids=["a"], num_computed_tokens=arr([1]))),
            "Step.cached_reqs: num_scheduled_tokens has 0 entries for 1 req_ids",
        ),
        (
            P.Step(
                seq=1,
                group="g",
                cached_reqs=P.CachedRequests(
                    req_ids=["a"], num_computed_tokens=arr([1]), num_scheduled_tokens=arr([1]), new_block_counts=arr([2]), new_block_ids_flat=arr([1])
                ),
            ),
            "new_block_counts add up to 2, new_block_ids_flat has 1",
        ),
        (
            P.Step(
                seq=1,
                group="g",
                cached_reqs=P.CachedRequests(
                    req_ids=["a"], num_computed_tokens=arr([1]), num_scheduled_tokens=arr([1]), new_block_counts=arr([-1]), new_block_ids_flat=arr([])
                ),
            ),
            "new_block_counts must be >= 0",
        ),
        (
            P.Step(seq=1, group="g", cached_reqs=P.CachedRequests.build(["a"], [1], [1], [[]], {"zz": [1]})),
            "resync_tokens for requests not in req_ids",
        ),
        (P.StepResult(seq=1, worker_id="w", req_ids=["a"]), "sampled_token_ids has 0 entries for 1 req_ids"),
        (
            P.StepResult(seq=1, worker_id="w", req_ids=["a"], sampled_token_ids=arr([1]), logprobs=np.zeros((2, 2), F32), logprob_token_ids=np.zeros((2, 2), I32)),
            "must both be (1, 1+k)",
        ),
        (P.StepResult(seq=1, worker_id="w", req_ids=[], ranks=arr([1])), "ranks has 1 entries"),
        (P.DetokTokens(seq=1, req_ids=["a"], counts=arr([1]), token_ids=arr([1, 2]), finish_reasons=[None]), "counts add up to 1"),
        (P.DetokTokens(seq=1, req_ids=["a"], counts=arr([1]), token_ids=arr([1])), "finish_reasons (0) need 1"),
        (P.DetokTokens(seq=1, req_ids=["a", "b"], counts=arr([-1, 2]), token_ids=arr([1]), finish_reasons=[None, None]), "counts must be >= 0"),
        (P.DetokOutputs(seq=1, req_ids=["a"], text_deltas=[], stop_strs=[None]), "text_deltas (0)"),
        (P.DetokNew(items=[P.DetokRequest(req_id="a", text_offset=-1)]), "DetokNew.items[0]: text_offset must be >= 0"),
    ],
)
def test_semantic_invariants(msg, fragment):
    frames = P.encode(msg)  # the sender is not checked (cheap), the receiver is
    assert_bad(frames, fragment)


# --------------------------------------------------------------------------------------------
# version check, PUB helpers, params, builders, errors
# --------------------------------------------------------------------------------------------


def test_check_version():
    hello = SAMPLES[P.Hello][0]
    assert P.check_version(hello) is None
    old = P.Hello(role="worker", worker_id="w9", protocol_version=0)
    decoded = P.decode(P.encode(old))  # an old peer with the same layout decodes...
    reason = P.check_version(decoded)  # ...and the scheduler refuses it with a reason
    assert reason and "version 0" in reason and "speaks 1" in reason and "w9" in reason
    # an old peer with another layout: the decode error names the version
    frames = [b"Hello", msgpack.packb(["worker", 0, "w9", "g"])]
    assert_bad(frames, "peer speaks protocol version 0", "this side 1")


def test_pub_frames_and_group_topics():
    step = SAMPLES[P.Step][0]
    topic = P.group_topic("g1")
    frames = P.encode_pub(topic, step)
    assert frames[0] == b"g1\x00"
    got_topic, msg = P.decode_pub(frames_as_bytes(frames))
    assert got_topic == topic and P.messages_equal(msg, step)
    assert not P.group_topic("g10").startswith(P.group_topic("g1"))  # SUB prefix filter is exact
    with pytest.raises(P.ProtocolError, match="at least 3 frames"):
        P.decode_pub([topic, b"Step"])
    with pytest.raises(P.ProtocolError):
        P.decode_pub(None)
    with pytest.raises(P.ProtocolError, match="unknown message type"):
        P.decode_pub([topic, b"Bogus", b"\x90"])
    with pytest.raises(P.ProtocolError, match="topic must be bytes"):
        P.encode_pub("g1", step)


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0, max_tokens=100, stop="x", seed=3, logprobs=5),
        SamplingParams(max_tokens=None, stop_token_ids=[2, 3], n=4, top_k=-1, ignore_eos=True),
        SamplingParams(temperature=1, top_p=0.5, min_tokens=2, presence_penalty=0.5, model="tiny"),
    ],
)
def test_params_round_trip(sp):
    d = P.encode_params(sp)
    assert len(d) <= len(P.encode_params(sp, compact=False))
    assert P.encode_params(sp, compact=False) == sp.to_dict()
    sub = P.decode(P.encode(P.Submit(request_id="a", prompt="x", params=d)))
    assert P.decode_params(sub.params) == sp
    assert P.decode_params(P.encode_params(sp, compact=False)) == sp
    assert P.encode_params(SamplingParams()) == {}
    with pytest.raises(InvalidRequest):
        P.decode_params({"temperature": "hot"})
    with pytest.raises(InvalidRequest):
        P.decode_params({"bogus": 1})


def test_builders_and_splitters():
    cr = P.CachedRequests.build(["a", "b", "c"], [1, 2, 3], [1, 1, 1], [[4, 5], [], [6]])
    parts = P.decode(P.encode(P.Step(seq=1, group="g", cached_reqs=cr))).cached_reqs.new_block_ids()
    assert [p.tolist() for p in parts] == [[4, 5], [], [6]]
    assert P.CachedRequests().new_block_ids() == []
    dt = P.DetokTokens.build(3, ["a", "b"], [[1, 2, 3], [4]])
    assert dt.finish_reasons == [None, None]
    assert [p.tolist() for p in P.decode(P.encode(dt)).per_request()] == [[1, 2, 3], [4]]
    assert P.DetokTokens().per_request() == []


def test_error_message_maps_to_typed_exception():
    from common.errors import Overloaded

    err = P.Error.from_exception(Overloaded("queue is full"), request_id="r")
    out = P.decode(P.encode(err))
    assert out.code == "overloaded" and out.request_id == "r"
    exc = out.to_exception()
    assert isinstance(exc, Overloaded) and str(exc) == "queue is full"
    pe = P.Error.from_exception(P.ProtocolError("bad frame"))
    assert pe.code == "invalid_request"
    assert P.Error.from_exception(RuntimeError("boom")).code == "internal"


def test_messages_equal():
    a = SAMPLES[P.Step][0]
    assert P.messages_equal(a, P.decode(P.encode(a)))
    assert not P.messages_equal(a, SAMPLES[P.Step][1])
    assert not P.messages_equal(arr([1]), np.array([1], dtype=np.int64))
    assert not P.messages_equal(arr([1]), [1])
    assert P.messages_equal(float("nan"), float("nan"))


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
        return rng.choice([2**63 - 1, 2**64 - 1, -(2**63)])
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
    return [rng.choice([0, 1, 2, 3, 4, -1]), [rng.randint(-1, 4) for _ in range(rng.randint(0, 3))], rng.choice([0, 1, -1, b"\x00" * rng.randint(0, 16)])]


def _mutate_structure(rng: random.Random, body):
    """Replace, drop or add one random element somewhere inside a decoded body."""
    if not isinstance(body, (list, dict)) or not body or rng.random() < 0.2:
        return _random_value(rng)
    if isinstance(body, list):
        i = rng.randrange(len(body))
        r = rng.random()
        if r < 0.1:
            return body[:i] + body[i + 1 :]
        if r < 0.15:
            return body + [_random_value(rng)]
        body = list(body)
        body[i] = _mutate_structure(rng, body[i])
        return body
    body = dict(body)
    k = rng.choice(list(body))
    if rng.random() < 0.2:
        body[b"k" if rng.random() < 0.5 else k + "x"] = _random_value(rng)
    else:
        body[k] = _mutate_structure(rng, body[k])
    return body


def _check_decode(frames) -> bool:
    try:
        msg = P.decode(frames)
    except P.ProtocolError as e:
        assert isinstance(e.reason, str) and e.reason
        # decode's last-resort net turns surprises into "malformed message (...)"; every case
        # the fuzz finds should have been foreseen with a precise reason instead
        assert not e.reason.startswith("malformed message"), (e.reason, frames)
        return False
    except Exception as e:  # noqa: BLE001 - this is the bug the fuzz looks for
        pytest.fail(f"decode raised {type(e).__name__}: {e} on {frames!r:.300}")
    assert type(msg) in P.MESSAGE_TYPES.values()
    again = P.decode(P.encode(msg))  # accepted => valid => re-encodes to an equal message
    assert P.messages_equal(again, msg)
    return True


def test_fuzz_random_frames():
    rng = random.Random(1234)
    tags = list(P.MESSAGE_TYPES)
    for _ in range(1500):
        n = rng.randint(0, 5)
        frames = [rng.randbytes(rng.randint(0, 40)) for _ in range(n)]
        if n and rng.random() < 0.7:
            frames[0] = rng.choice(tags)
        if n > 1 and rng.random() < 0.5:
            frames[1] = msgpack.packb(_random_value(rng), use_bin_type=True)
        _check_decode(frames)


def test_fuzz_mutated_valid_messages():
    rng = random.Random(99)
    encoded = [[bytes(f) for f in P.encode(m)] for m in ALL_SAMPLES]
    # with out-of-band buffers too
    big = P.Submit(request_id="b", prompt_token_ids=np.arange(5000, dtype=np.int32))
    encoded.append([bytes(f) for f in P.encode(big)])
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
            else:
                frames.insert(rng.randrange(len(frames) + 1), rng.choice(frames))
        elif r < 0.55:  # another type's tag on this body
            frames[0] = rng.choice(list(P.MESSAGE_TYPES))
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
    params = P.encode_params(SamplingParams(temperature=0.8, top_p=0.95, max_tokens=256, seed=1))
    new = [
        P.NewRequest(
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
    cached = P.CachedRequests.build(ids, np.arange(256) + 100, np.ones(256), [[i] if i % 16 == 0 else [] for i in range(256)])
    for step in (P.Step(seq=1, group="g", new_reqs=new), P.Step(seq=2, group="g", cached_reqs=cached)):
        frames = P.encode(step)
        assert _best_of(lambda s=step: P.encode(s)) < 5e-3
        assert _best_of(lambda f=frames: P.decode(f)) < 20e-3
    # the steady-state (decode) step and its result are far cheaper
    step = P.Step(seq=2, group="g", cached_reqs=cached)
    res = P.StepResult(seq=2, worker_id="w", req_ids=ids, sampled_token_ids=np.arange(256, dtype=np.int32))
    assert _best_of(lambda: P.decode(P.encode(step))) < 2e-3
    assert _best_of(lambda: P.decode(P.encode(res))) < 2e-3
