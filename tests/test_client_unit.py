"""zeroserve.Client / AsyncClient against a scripted TEST DOUBLE of the scheduler's client port.

``ScriptedScheduler`` (below, test-only, never shipped) is a real ZeroMQ ROUTER on a free
loopback port, served by a thread, that answers with real protocol messages: Pong,
StatsReply, ModelsReply, Outputs sequences (one Outputs message per "step", items of all live
requests of a client batched together like the real scheduler does), Error, or silence. It
records everything it receives so tests can check what the client sent (Submit, Abort, Ping).

Every wait has a timeout; every socket and thread is closed at teardown.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from zeroserve.common import messages as P
from zeroserve.common import codec
from zeroserve.common.errors import ClusterUnavailable, InvalidRequest, ModelLoadError, Overloaded, RequestTimeout, ZeroserveError
from zeroserve.common.outputs import Logprob
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.common.transport import bind_free_port, free_port, make_socket
from zeroserve import AsyncClient, Client
from zeroserve.client import StreamDelta

pytestmark = pytest.mark.timeout(60)

WAIT = 5.0  # seconds; generous, never reached when things work

TINY_CARD = [{"id": "tiny", "max_model_len": 128, "groups": 1, "tool_call_parser": "", "state": "loaded", "reason": "",
              "pinned": False, "waiting": 0, "parent": None}]  # the fake scheduler's one ModelCard, as models() gives it


# ================================================================================================
# Test double: a scripted scheduler client port
# ================================================================================================


class _Scripted:
    __slots__ = ("not_before", "steps")

    def __init__(self, steps: list) -> None:
        self.steps = collections.deque(steps)
        self.not_before = 0.0


class ScriptedScheduler:
    """TEST DOUBLE of the scheduler's client ROUTER. ``script(submit)`` decides the answer:

    * a list of steps: each step is a list of ``P.Output`` items (sent in one ``Outputs`` per
      client per step, ``step_s`` apart) or a number = wait that many seconds first;
    * a ``P.Error``: sent at once (its request_id filled in);
    * None: silence (the request stays open).

    ``answer_pings`` / ``answer_control`` switch off Pong / Stats+Models replies (a silent peer).
    An Abort for a request it knows is answered like the real scheduler: an Output with
    finish_reason "abort" (which the client must ignore, it already let go of the request).
    """

    def __init__(self, script: Callable[[P.Submit], Any] | None = None, *, answer_pings: bool = True,
                 answer_control: bool = True, step_s: float = 0.002) -> None:
        self.script = script or (lambda m: None)
        self.answer_pings = answer_pings
        self.answer_control = answer_control
        self.step_s = step_s
        self.stats = {"requests_running": 3, "tokens_per_s": 12.5}
        self.models = [P.ModelCard(id="tiny", max_model_len=128, groups=1)]
        self.scheduler_id = "sched-test"
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER)
        self.address = bind_free_port(self.sock)
        self.received: list[tuple[bytes, Any, float]] = []
        self.cv = threading.Condition()
        self.active: dict[tuple[bytes, str], _Scripted] = {}
        self.submitted: set[tuple[bytes, str]] = set()
        self._last_step = 0.0
        self._outbox: collections.deque = collections.deque()  # (ident, msg) pushed by tests
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scripted-scheduler", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- inspection (any thread)
    def messages(self, kind: type | None = None) -> list[Any]:
        with self.cv:
            return [m for _, m, _ in self.received if kind is None or isinstance(m, kind)]

    def find(self, kind: type, request_id: str | None = None) -> Any:
        for m in self.messages(kind):
            if request_id is None or getattr(m, "request_id", None) == request_id:
                return m
        return None

    def wait_for(self, kind: type, request_id: str | None = None, timeout: float = WAIT) -> Any:
        deadline = time.monotonic() + timeout
        with self.cv:
            while True:
                for _, m, _ in self.received:
                    if isinstance(m, kind) and (request_id is None or getattr(m, "request_id", None) == request_id):
                        return m
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"the peer got no {kind.__name__} for {request_id!r} within {timeout} s")
                self.cv.wait(left)

    async def await_for(self, kind: type, request_id: str | None = None, timeout: float = WAIT) -> Any:
        """wait_for without blocking the event loop (the client's loop must keep running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.find(kind, request_id)
            if m is not None:
                return m
            await asyncio.sleep(0.01)
        raise AssertionError(f"the peer got no {kind.__name__} for {request_id!r} within {timeout} s")

    def push(self, msg: Any) -> None:
        """Send ``msg`` (from the peer thread: sockets are not thread-safe) to the last client heard."""
        with self.cv:
            ident = self.received[-1][0]
        self._outbox.append((ident, msg))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT)
        assert not self._thread.is_alive()
        self.sock.close(linger=0)
        self.ctx.term()

    # ---------------------------------------------------------------- peer thread
    def _send(self, ident: bytes, msg: Any) -> None:
        try:
            self.sock.send_multipart([ident, *codec.encode(msg)], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            pass  # client gone

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(max(1, int(self.step_s * 1000))):
                while True:
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    ident = frames[0].bytes
                    msg = codec.decode(frames[1:])
                    with self.cv:
                        self.received.append((ident, msg, time.monotonic()))
                        self.cv.notify_all()
                    self._handle(ident, msg)
            while self._outbox:
                self._send(*self._outbox.popleft())
            self._step()

    def _handle(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, P.Ping):
            if self.answer_pings:
                self._send(ident, P.Pong(nonce=msg.nonce, scheduler_id=self.scheduler_id))
        elif isinstance(msg, P.StatsRequest):
            if self.answer_control:
                self._send(ident, P.StatsReply(stats=self.stats))
        elif isinstance(msg, P.ModelsRequest):
            if self.answer_control:
                self._send(ident, P.ModelsReply(models=self.models))
        elif isinstance(msg, P.Submit):
            key = (ident, msg.request_id)
            self.submitted.add(key)
            res = self.script(msg)
            if isinstance(res, P.Error):
                res.request_id = msg.request_id
                self._send(ident, res)
            elif res is not None:
                self.active[key] = _Scripted(res)
        elif isinstance(msg, P.Abort):
            key = (ident, msg.request_id)
            self.active.pop(key, None)
            if key in self.submitted:
                self.submitted.discard(key)
                self._send(ident, P.Outputs(items=[P.Output(request_id=msg.request_id, finish_reason="abort")]))

    def _step(self) -> None:
        now = time.monotonic()
        if now - self._last_step < self.step_s:
            return
        self._last_step = now
        batches: dict[bytes, list] = {}
        for key, st in list(self.active.items()):
            if st.not_before > now:
                continue
            while st.steps and isinstance(st.steps[0], (int, float)):
                st.not_before = now + st.steps.popleft()
            if st.not_before > now:
                continue
            if st.steps:
                batches.setdefault(key[0], []).extend(st.steps.popleft())
            if not st.steps:
                del self.active[key]
        for ident, items in batches.items():
            self._send(ident, P.Outputs(items=items))


def out(rid: str, toks: list[int], text: str, index: int = 0, finish: str | None = None, stop: Any = None,
        lp: tuple | None = None, prompt_ids: list[int] | None = None, cached: int = 0) -> P.Output:
    o = P.Output(request_id=rid, index=index, token_ids=np.asarray(toks, np.int32), text=text,
                 finish_reason=finish, stop_reason=stop, num_cached_tokens=cached,
                 prompt_token_ids=None if prompt_ids is None else np.asarray(prompt_ids, np.int32))
    if lp is not None:
        ids, vals, ranks = lp
        o.logprob_token_ids = np.asarray(ids, np.int32)
        o.logprobs = np.asarray(vals, np.float32)
        o.ranks = np.asarray(ranks, np.int32)
    return o


def simple_script(tokens_per_step: int = 2, steps: int = 3) -> Callable[[P.Submit], list]:
    """Tokens derived from the request id; the last step finishes with "length"."""

    def script(m: P.Submit) -> list:
        base = (abs(hash(m.request_id)) % 1000) * 100
        res = []
        for s in range(steps):
            toks = [base + s * tokens_per_step + j for j in range(tokens_per_step)]
            res.append([out(m.request_id, toks, "".join(f"<{t}>" for t in toks),
                            finish="length" if s == steps - 1 else None,
                            prompt_ids=[1, 2, 3] if s == 0 else None)])
        return res

    return script


def expected_tokens(rid: str, tokens_per_step: int = 2, steps: int = 3) -> list[int]:
    base = (abs(hash(rid)) % 1000) * 100
    return [base + i for i in range(tokens_per_step * steps)]


@pytest.fixture
def peers():
    made: list[ScriptedScheduler] = []

    def make(*a, **kw) -> ScriptedScheduler:
        p = ScriptedScheduler(*a, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def client_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "zeroserve-client" and t.is_alive()]


# ================================================================================================
# generate / stream
# ================================================================================================


def _n2_logprob_script(m: P.Submit) -> list:
    r = m.request_id
    return [
        [out(r, [5, 6], "ab", 0, lp=([[5, 5, 9], [6, 1, 6]], [[-0.1, -0.1, -2.0], [-0.5, -0.2, -0.5]], [1, 2]),
             prompt_ids=[11, 12, 13], cached=2),
         out(r, [7], "c", 1, lp=([[7, 3, 4]], [[-1.5, -0.3, -0.9]], [3]))],
        [out(r, [8], "d", 0, finish="length", lp=([[8, 8, 2]], [[-0.01, -0.01, -4.0]], [1])),
         out(r, [9, 10], "ef", 1, lp=([[9, 9, 1], [10, 10, 1]], [[-0.2, -0.2, -1.0], [-0.3, -0.3, -1.1]], [1, 1]))],
        [out(r, [11], "g", 1, finish="stop", stop="</s>", lp=([[11, 11, 0]], [[-0.4, -0.4, -2.2]], [1]))],
    ]


async def test_generate_assembles_n2_logprobs_across_messages(peers):
    peer = peers(_n2_logprob_script)
    async with AsyncClient(peer.address, timeout_s=WAIT) as c:
        res = await c.generate("hello", SamplingParams(n=2, logprobs=2, max_tokens=3), request_id="r1")
    assert res.request_id == "r1" and res.prompt == "hello" and res.finished
    assert res.prompt_token_ids == [11, 12, 13] and res.num_cached_tokens == 2
    o0, o1 = res.outputs
    assert (o0.index, o0.text, o0.token_ids, o0.finish_reason, o0.stop_reason) == (0, "abd", [5, 6, 8], "length", None)
    assert (o1.index, o1.text, o1.token_ids, o1.finish_reason, o1.stop_reason) == (1, "cefg", [7, 9, 10, 11], "stop",
                                                                                    "</s>")
    assert len(o0.logprobs) == 3 and len(o1.logprobs) == 4
    # column 0 = sampled token with its rank; a top-k entry equal to it keeps the sampled rank
    assert o0.logprobs[0] == {5: Logprob(pytest.approx(-0.1), 1), 9: Logprob(pytest.approx(-2.0), 2)}
    assert o0.logprobs[1] == {6: Logprob(pytest.approx(-0.5), 2), 1: Logprob(pytest.approx(-0.2), 1)}
    assert o1.logprobs[0] == {7: Logprob(pytest.approx(-1.5), 3), 3: Logprob(pytest.approx(-0.3), 1),
                              4: Logprob(pytest.approx(-0.9), 2)}
    assert all(isinstance(k, int) for d in o1.logprobs for k in d)
    sub = peer.find(P.Submit, "r1")
    assert sub.prompt == "hello" and sub.prompt_token_ids is None and sub.stream is False
    assert sub.params == SamplingParams(n=2, logprobs=2, max_tokens=3)
    assert peer.find(P.Abort) is None  # a request that finished is not aborted


async def test_generate_with_token_ids_and_dict_prompts(peers):
    def script(m: P.Submit) -> list:  # no prompt_token_ids echoed: the client falls back to what it sent
        return [[out(m.request_id, [4], "x", finish="stop", stop=2)]]

    peer = peers(script)
    async with AsyncClient(peer.address, timeout_s=WAIT) as c:
        a = await c.generate([1, 2, 3])
        b = await c.generate({"prompt_token_ids": np.array([7, 8], np.int64)}, {"max_tokens": 4})
        d = await c.generate({"prompt": "hi"})
    assert a.prompt is None and a.prompt_token_ids == [1, 2, 3]
    assert a.outputs[0].token_ids == [4] and a.outputs[0].stop_reason == 2 and a.outputs[0].logprobs is None
    assert b.prompt_token_ids == [7, 8] and d.prompt == "hi" and d.prompt_token_ids == []
    subs = peer.messages(P.Submit)
    assert subs[0].prompt is None and subs[0].prompt_token_ids.dtype == np.int32
    assert subs[0].prompt_token_ids.tolist() == [1, 2, 3]
    assert subs[1].params.max_tokens == 4
    assert len({s.request_id for s in subs}) == 3  # unique ids generated


async def test_stream_yields_deltas_in_order(peers):
    peer = peers(_n2_logprob_script)
    async with AsyncClient(peer.address, timeout_s=WAIT) as c:
        deltas = [d async for d in c.stream("hello", {"n": 2, "logprobs": 2}, request_id="s1")]
    assert all(isinstance(d, StreamDelta) and d.request_id == "s1" for d in deltas)
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in deltas] == [
        (0, "ab", [5, 6], None), (1, "c", [7], None), (0, "d", [8], "length"), (1, "ef", [9, 10], None),
        (1, "g", [11], "stop")]
    assert deltas[0].prompt_token_ids == [11, 12, 13] and deltas[0].num_cached_tokens == 2
    assert all(d.prompt_token_ids is None for d in deltas[1:])
    assert deltas[-1].stop_reason == "</s>" and deltas[-1].finished
    assert deltas[0].logprobs[0][5] == Logprob(pytest.approx(-0.1), 1) and len(deltas[3].logprobs) == 2
    assert peer.find(P.Submit, "s1").stream is True
    assert peer.find(P.Abort) is None


async def test_breaking_out_of_a_stream_sends_abort(peers):
    peer = peers(lambda m: [[out(m.request_id, [1], "a")], [out(m.request_id, [2], "b")]])  # never finishes
    async with AsyncClient(peer.address, timeout_s=WAIT) as c:
        async for d in c.stream("x", request_id="b1"):
            assert d.text == "a"
            break  # dropping the iterator aborts (no gc needed: CPython frees it at once)
        ab = await peer.await_for(P.Abort, "b1", timeout=1.0)
        assert ab.request_id == "b1" and not c._reqs
        # aclose() and leaving `async with` abort too
        s = c.stream("x", request_id="b2")
        assert (await s.__anext__()).text == "a"
        await s.aclose()
        await peer.await_for(P.Abort, "b2")
        with pytest.raises(StopAsyncIteration):
            await s.__anext__()
        async with c.stream("x", request_id="b3") as s3:
            await s3.__anext__()
        await peer.await_for(P.Abort, "b3")
        # a stream that was never iterated sent nothing
        c.stream("x", request_id="b4")
        gc.collect()
        await asyncio.sleep(0.05)
        assert peer.find(P.Submit, "b4") is None
        assert not c._reqs


async def test_cancelling_the_consumer_sends_abort(peers):
    peer = peers(lambda m: None)  # silent about requests, answers pings
    async with AsyncClient(peer.address, timeout_s=WAIT) as c:
        task = asyncio.create_task(c.generate("x", request_id="g1"))
        await peer.await_for(P.Submit, "g1")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT)
        await peer.await_for(P.Abort, "g1")

        async def consume() -> list:
            return [d async for d in c.stream("x", request_id="s1")]

        task = asyncio.create_task(consume())
        await peer.await_for(P.Submit, "s1")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT)
        await peer.await_for(P.Abort, "s1")
        assert not c._reqs


async def test_abort_ends_generate_with_partial_output(peers):
    peer = peers(lambda m: [[out(m.request_id, [1, 2], "ab", prompt_ids=[9])]])  # then silence
    async with AsyncClient(peer.address, timeout_s=WAIT) as c:
        task = asyncio.create_task(c.generate("x", {"n": 2}, request_id="a1"))
        for _ in range(500):
            if c._reqs.get("a1") is not None and c._reqs["a1"].parts[0]:
                break
            await asyncio.sleep(0.01)
        await c.abort("a1")
        res = await asyncio.wait_for(task, WAIT)
        await peer.await_for(P.Abort, "a1")
        assert [o.finish_reason for o in res.outputs] == ["abort", "abort"]
        assert res.outputs[0].token_ids == [1, 2] and res.outputs[0].text == "ab" and res.prompt_token_ids == [9]
        # the scheduler's late "abort" Output for a1 is ignored; the id is free again
        peer.script = lambda m: [[out(m.request_id, [5], "z", finish="stop")]]
        again = await asyncio.wait_for(c.generate("x", request_id="a2"), WAIT)
        assert again.outputs[0].token_ids == [5]
        # aborting a stream ends it with an "abort" delta
        peer.script = lambda m: [[out(m.request_id, [1], "a")]]
        s = c.stream("x", request_id="a3")
        first = await s.__anext__()
        await c.abort("a3")
        rest = [d async for d in s]
        assert first.text == "a" and [(d.text, d.finish_reason) for d in rest] == [("", "abort")]


@pytest.mark.parametrize("code,exc", [("invalid_request", InvalidRequest), ("overloaded", Overloaded),
                                      ("timeout", RequestTimeout), ("unavailable", ClusterUnavailable),
                                      ("model_load", ModelLoadError), ("something_new", ZeroserveError)])
async def test_error_codes_become_typed_exceptions(peers, code, exc):
    peer = peers(lambda m: P.Error(code=code, message=f"{code}: do this instead"))
    async with AsyncClient(peer.address, timeout_s=WAIT) as c:
        with pytest.raises(exc, match=f"{code}: do this instead"):
            await c.generate("x")
        with pytest.raises(exc):
            async for _ in c.stream("x"):
                pass
        assert not c._reqs
    assert peer.find(P.Abort) is None  # the scheduler already dropped it


async def test_stream_error_after_some_deltas(peers):
    def script(m: P.Submit) -> list:
        return [[out(m.request_id, [1], "a")], [out(m.request_id, [2], "b")]]

    peer = peers(script)
    async with AsyncClient(peer.address, timeout_s=WAIT) as c:
        got = []
        s = c.stream("x", request_id="e1")
        got.append(await s.__anext__())
        got.append(await s.__anext__())
        peer.push(P.Error(request_id="e1", code="overloaded", message="queue full"))  # the scheduler fails it
        with pytest.raises(Overloaded, match="queue full"):
            await asyncio.wait_for(s.__anext__(), WAIT)
    assert [d.text for d in got] == ["a", "b"]


def test_split_prompt_forms_agree():
    """The list fast path and the general path give the same ids and the same refusals."""
    from zeroserve.services.scheduler.admission import split_prompt

    ids = [0, 5, 2**31 - 1]
    for form in (ids, tuple(ids), np.array(ids, np.int64), {"prompt_token_ids": ids}):
        text, arr = split_prompt(form)
        assert text is None and arr.dtype == np.int32 and arr.tolist() == ids
    assert split_prompt([np.int64(3), 4])[1].tolist() == [3, 4]  # numpy scalars take the general path
    for bad in ([-1], [2**31], (2**31,), [3, 7], (7,)):
        with pytest.raises(InvalidRequest, match=r"\[0, 7\)" if 7 in bad else r"\[0, 2147483648\)"):
            split_prompt(bad, vocab_size=7 if 7 in bad else None)


async def test_client_side_validation_fails_fast(peers):
    peer = peers(simple_script())
    async with AsyncClient(peer.address, timeout_s=WAIT) as c:
        bad = [("x", {"temperature": -1}), ("x", {"nope": 1}), ("x", {"max_tokens": "3"}), ("x", 3),
               ("", None), ([], None), ([1.5], None), ([-1], None), ([[1, 2]], None), ({"text": "x"}, None),
               (None, None), ([2**40], None), ([2**31], None), ([1, True], None), ([True], None), ([1, "2"], None)]
        for prompt, params in bad:
            with pytest.raises(InvalidRequest):
                await c.generate(prompt, params)
            with pytest.raises(InvalidRequest):
                c.stream(prompt, params)
        sp = SamplingParams()
        sp.top_p = 7.0  # changed after construction
        with pytest.raises(InvalidRequest, match="top_p"):
            await c.generate("x", sp)
        for t in (0, -1, float("nan"), "1"):
            with pytest.raises(InvalidRequest, match="request_timeout_s"):
                await c.generate("x", request_timeout_s=t)
        with pytest.raises(InvalidRequest, match="request_id"):
            await c.generate("x", request_id="")
        await asyncio.sleep(0.05)
        assert peer.find(P.Submit) is None  # nothing reached the wire
        # the same id twice at once on one client
        peer.script = lambda m: None
        t1 = asyncio.create_task(c.generate("x", request_id="dup"))
        await peer.await_for(P.Submit, "dup")
        with pytest.raises(InvalidRequest, match="already running"):
            await c.generate("x", request_id="dup")
        t1.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t1
    for kw in ({"timeout_s": 0}, {"request_timeout_s": -2}, {"address": "localhost"}):
        with pytest.raises(InvalidRequest):
            AsyncClient(**kw)


def test_params_travel_as_the_typed_struct():
    for sp in (SamplingParams(), SamplingParams(temperature=1, top_k=-1, logprobs=0, max_tokens=None),
               SamplingParams(n=3, seed=7, stop="END", stop_token_ids=[2], model="m", ignore_eos=True)):
        sub = codec.decode(codec.encode(P.Submit(request_id="a", prompt="x", params=sp)))
        assert sub.params == sp


# ================================================================================================
# Liveness and timeouts
# ================================================================================================


async def test_silent_peer_raises_cluster_unavailable(peers):
    peer = peers(lambda m: None, answer_pings=False, answer_control=False)
    async with AsyncClient(peer.address, timeout_s=0.8) as c:
        t0 = time.monotonic()
        with pytest.raises(ClusterUnavailable) as ei:
            await c.generate("x", request_id="u1")
        took = time.monotonic() - t0
        assert 0.7 < took < 2.5, took
        msg = str(ei.value)
        assert peer.address in msg and "zeroserve up" in msg and "0.8 s" in msg
        await peer.await_for(P.Abort, "u1")
        assert len(peer.messages(P.Ping)) >= 2  # it did ping while waiting
        with pytest.raises(ClusterUnavailable):
            async for _ in c.stream("x"):
                pass
        for call in (c.health, c.stats, c.models):
            t0 = time.monotonic()
            with pytest.raises(ClusterUnavailable, match="zeroserve up"):
                await call()
            assert time.monotonic() - t0 < 2.0


async def test_nobody_listening_raises_cluster_unavailable():
    async with AsyncClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.5) as c:
        with pytest.raises(ClusterUnavailable):
            await c.health()
        with pytest.raises(ClusterUnavailable):
            await c.generate("x")
    bad = AsyncClient("tcp://127.0.0.1:notaport")
    with pytest.raises(InvalidRequest, match="tcp://HOST:PORT"):
        await bad.health()
    await bad.close()


async def test_pings_keep_a_slow_request_alive(peers):
    # the request takes 3x timeout_s; only the Pongs show the scheduler is alive meanwhile
    peer = peers(lambda m: [1.5, [out(m.request_id, [1], "a", finish="stop")]])
    async with AsyncClient(peer.address, timeout_s=0.5) as c:
        res = await asyncio.wait_for(c.generate("x"), WAIT)
        assert res.outputs[0].finish_reason == "stop"
        pings = len(peer.messages(P.Ping))
        assert pings >= 5  # every timeout_s / 4 while live
        await asyncio.sleep(0.5)
        assert len(peer.messages(P.Ping)) <= pings + 1  # idle: no more pings


async def test_request_timeout_raises_and_aborts(peers):
    peer = peers(lambda m: None)  # answers pings, never finishes
    async with AsyncClient(peer.address, timeout_s=WAIT, request_timeout_s=0.4) as c:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout, match="t1.*0.4 s"):
            await c.generate("x", request_id="t1")
        assert 0.35 < time.monotonic() - t0 < 2.0
        await peer.await_for(P.Abort, "t1")
        assert peer.find(P.Submit, "t1").timeout_s == pytest.approx(0.4)  # the scheduler enforces it too
        # per-call value beats the client default; streams time out the same way
        with pytest.raises(RequestTimeout):
            async for _ in c.stream("x", request_id="t2", request_timeout_s=0.2):
                pass
        await peer.await_for(P.Abort, "t2")
        assert peer.find(P.Submit, "t2").timeout_s == pytest.approx(0.2)


async def test_health_stats_models(peers):
    peer = peers()
    async with AsyncClient(peer.address, timeout_s=WAIT) as c:
        h = await c.health()
        assert h["ok"] is True and h["scheduler_id"] == "sched-test"
        assert h["protocol_version"] == P.PROTOCOL_VERSION and h["latency_ms"] >= 0
        assert await c.stats() == peer.stats
        assert await c.models() == TINY_CARD
        hs = await asyncio.gather(*(c.health() for _ in range(5)))
        assert all(x["ok"] for x in hs)


async def test_fifty_concurrent_generates_over_one_client(peers):
    peer = peers(simple_script(tokens_per_step=2, steps=3))
    async with AsyncClient(peer.address, timeout_s=WAIT) as c:
        ids = [f"req-{i}" for i in range(50)]
        res = await asyncio.wait_for(asyncio.gather(*(c.generate("p", request_id=i) for i in ids)), 15)
        assert not c._reqs
    for rid, r in zip(ids, res):
        toks = expected_tokens(rid)
        assert r.request_id == rid and r.outputs[0].token_ids == toks
        assert r.outputs[0].text == "".join(f"<{t}>" for t in toks) and r.outputs[0].finish_reason == "length"
    # the peer batched items of many requests per Outputs message (one per step), like the scheduler
    assert len(peer.find(P.Submit).request_id) > 0


# ================================================================================================
# Lifecycle
# ================================================================================================


async def test_async_close_releases_everything(peers):
    peer = peers(lambda m: None)
    c = AsyncClient(peer.address, timeout_s=WAIT)
    task = asyncio.create_task(c.generate("x", request_id="c1"))
    await peer.await_for(P.Submit, "c1")
    sock, ctx, tasks = c._sock, c._ctx, list(c._tasks)
    await c.close()
    with pytest.raises(ZeroserveError, match="closed"):
        await asyncio.wait_for(task, WAIT)
    assert sock.closed and ctx.closed and all(t.done() for t in tasks)
    await asyncio.to_thread(peer.wait_for, P.Abort, "c1")
    with pytest.raises(ZeroserveError, match="closed"):
        await c.generate("x")
    await c.close()  # idempotent
    await AsyncClient(peer.address).close()  # never used: nothing to release


# ================================================================================================
# Blocking Client
# ================================================================================================


def test_sync_client_generate_stream_and_errors(peers):
    before = len(client_threads())
    peer = peers(_n2_logprob_script)
    with Client(peer.address, timeout_s=WAIT) as c:
        res = c.generate("hello", {"n": 2, "logprobs": 2})
        assert [o.token_ids for o in res.outputs] == [[5, 6, 8], [7, 9, 10, 11]]
        deltas = list(c.stream("hello", {"n": 2, "logprobs": 2}))
        assert [d.text for d in deltas] == ["ab", "c", "d", "ef", "g"] and deltas[-1].finish_reason == "stop"
        assert c.health()["ok"] and c.stats() == peer.stats and c.models() == TINY_CARD
        # leaving a stream early aborts it
        peer.script = lambda m: [[out(m.request_id, [1], "a")]]
        for d in c.stream("x", request_id="sb"):
            break
        peer.wait_for(P.Abort, "sb", timeout=1.0)
        with c.stream("x", request_id="sc") as s:
            assert next(s).text == "a"
        peer.wait_for(P.Abort, "sc")
        # typed errors and client-side validation
        peer.script = lambda m: P.Error(code="overloaded", message="retry later")
        with pytest.raises(Overloaded, match="retry later"):
            c.generate("x")
        with pytest.raises(Overloaded):
            list(c.stream("x"))
        with pytest.raises(InvalidRequest):
            c.generate("x", {"temperature": -3})
        with pytest.raises(InvalidRequest):
            c.stream("x", {"top_k": -5})
        # abort from another thread ends a blocking generate
        peer.script = lambda m: None
        th = threading.Timer(0.2, c.abort, args=("ab",))
        th.start()
        res = c.generate("x", request_id="ab")
        th.join(WAIT)
        assert res.outputs[0].finish_reason == "abort"
        peer.wait_for(P.Abort, "ab")
    assert len(client_threads()) == before
    with pytest.raises(ZeroserveError, match="closed"):
        c.generate("x")


def test_sync_client_timeouts(peers):
    peer = peers(lambda m: None, answer_pings=False, answer_control=False)
    with Client(peer.address, timeout_s=0.6) as c:
        with pytest.raises(RequestTimeout):
            c.generate("x", request_id="rt", request_timeout_s=0.2)
        peer.wait_for(P.Abort, "rt")
        t0 = time.monotonic()
        with pytest.raises(ClusterUnavailable, match="zeroserve up"):
            list(c.stream("x", request_id="cu"))
        assert time.monotonic() - t0 < 2.5
        peer.wait_for(P.Abort, "cu")
        with pytest.raises(ClusterUnavailable):
            c.health()


def test_sync_client_from_many_threads(peers):
    peer = peers(simple_script(tokens_per_step=3, steps=2))
    results: dict[str, Any] = {}
    errors: list[BaseException] = []
    with Client(peer.address, timeout_s=WAIT) as c:

        def worker(t: int) -> None:
            try:
                for i in range(5):
                    rid = f"t{t}-{i}"
                    if i % 2:
                        results[rid] = [tok for d in c.stream("p", request_id=rid) for tok in d.token_ids]
                    else:
                        results[rid] = c.generate("p", request_id=rid).outputs[0].token_ids
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(20)
        assert not any(th.is_alive() for th in threads)
    assert not errors, errors
    assert len(results) == 40
    for rid, toks in results.items():
        assert toks == expected_tokens(rid, tokens_per_step=3, steps=2)


def test_sync_close_leaves_no_threads_or_sockets(peers):
    peer = peers(lambda m: None, answer_pings=True)
    before = {t.ident for t in threading.enumerate()}
    c = Client(peer.address, timeout_s=WAIT)
    assert c.health()["ok"]
    errs: list[BaseException] = []

    def waiter() -> None:
        try:
            c.generate("x", request_id="w1")
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    th = threading.Thread(target=waiter)
    th.start()
    peer.wait_for(P.Submit, "w1")
    ac = c._ac
    c.close()
    th.join(WAIT)
    assert not th.is_alive() and len(errs) == 1 and isinstance(errs[0], ZeroserveError)
    peer.wait_for(P.Abort, "w1")
    assert ac._sock.closed and ac._ctx.closed and c._loop.is_closed()
    assert not c._thread.is_alive()
    assert {t.ident for t in threading.enumerate()} <= before | {th.ident}
    c.close()  # idempotent
    with pytest.raises(ZeroserveError, match="closed"):
        c.health()
    # a client dropped without close() stops its thread too
    c2 = Client(peer.address, timeout_s=WAIT)
    assert c2.health()["ok"]
    t2 = c2._thread
    del c2
    gc.collect()
    t2.join(WAIT)
    assert not t2.is_alive()
