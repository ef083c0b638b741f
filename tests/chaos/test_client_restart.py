"""The client follows the scheduler's identity (no cluster: a raw ROUTER plays the scheduler).

Every Pong names the scheduler. A request belongs to the one that answers the first Ping sent
after its Submit; when a Pong names another one (the scheduler restarted), requests the old
one held are re-attached to the new one under a new wire id, with what they received (the
stream pauses, then goes on); a request over ``reattach_max_tokens``, or any with
``reattach=False``, fails at once with ClusterUnavailable, or, with ``retries``, is submitted
again when none of its output had arrived.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import zmq

from zeroserve.common import codec
from zeroserve.common import messages as P
from zeroserve.common.errors import ClusterUnavailable
from zeroserve.common.transport import bind_free_port
from zeroserve import AsyncClient


class FakeScheduler:
    """Answers Pings with `self.sid`; records Submits and Aborts."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = bind_free_port(self.sock)
        self.sid = "sched-A"
        self.submits: list[tuple[bytes, P.Submit]] = []
        self.aborts: list[str] = []
        self.reattaches: list[tuple[bytes, P.Reattach]] = []
        self.forgets = False  # True: a Pong names every asked-about request it has no Submit for

    def drop_all(self) -> None:
        """Take in and lose everything waiting (the scheduler died after reading it)."""
        while self.sock.poll(0):
            self.sock.recv_multipart()

    def pump(self) -> None:
        while self.sock.poll(0):
            ident, *frames = self.sock.recv_multipart()
            m = codec.decode(frames)
            if isinstance(m, P.Ping):
                held = {sub.request_id for _, sub in self.submits}
                unknown = [r for r in m.request_ids if r not in held] if self.forgets else []
                self.sock.send_multipart([ident, *codec.encode(P.Pong(nonce=m.nonce, scheduler_id=self.sid,
                                                                      unknown=unknown))])
            elif isinstance(m, P.Submit):
                self.submits.append((ident, m))
            elif isinstance(m, P.Reattach):
                self.reattaches.append((ident, m))
            elif isinstance(m, P.Abort):
                self.aborts.append(m.request_id)

    def output(self, ident: bytes, rid: str, token: int, finish: str | None = None, **kw) -> None:
        self.sock.send_multipart([ident, *codec.encode(P.Outputs(items=[
            P.Output(request_id=rid, token_ids=[token], text="x", finish_reason=finish, **kw)]))])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


async def _until(cond, fake: FakeScheduler, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        fake.pump()
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.timeout(30)
def test_a_restarted_scheduler_fails_live_requests_at_once_and_retries_unstarted_ones():
    fake = FakeScheduler()

    async def main():
        async with AsyncClient(fake.address, timeout_s=30.0, retries=1, reattach=False) as c:
            started = c.stream([1, 2, 3], {"max_tokens": 8})  # gets output: cannot be retried
            it = started.__aiter__()
            first = asyncio.ensure_future(it.__anext__())
            await _until(lambda: len(fake.submits) == 1, fake)
            ident, sub = fake.submits[0]
            fake.output(ident, sub.request_id, 7)
            assert (await first).token_ids == [7]
            waiting = asyncio.ensure_future(c.generate([4, 5], {"max_tokens": 4}, request_id="w"))
            await _until(lambda: len(fake.submits) == 2, fake)
            # both are known to sched-A once a Ping sent after their Submit is answered
            await _until(lambda: all(r.sid == "sched-A" for r in c._reqs.values()), fake)
            fake.sid = "sched-B"  # "restart": the next Pong names another scheduler
            t0 = time.monotonic()
            nxt = asyncio.ensure_future(it.__anext__())
            await _until(lambda: nxt.done(), fake, timeout=3.0)
            with pytest.raises(ClusterUnavailable, match="scheduler restarted"):
                nxt.result()
            assert time.monotonic() - t0 < 2.5, "not detected by the next pong"
            # the request without output went again, under a new wire id (the old one aborted)
            await _until(lambda: len(fake.submits) == 3, fake)
            ident, again = fake.submits[2]
            assert again.request_id == "w~1" and again.prompt_token_ids.tolist() == [4, 5]
            assert "w" in fake.aborts and sub.request_id in fake.aborts
            fake.output(ident, "w~1", 9, finish="length")
            out = await asyncio.wait_for(waiting, 5)
            assert out.request_id == "w" and out.outputs[0].token_ids == [9]

    try:
        asyncio.run(main())
    finally:
        fake.close()


@pytest.mark.timeout(30)
def test_without_retries_an_unstarted_request_fails_too_and_new_ones_go_to_the_new_scheduler():
    fake = FakeScheduler()

    async def main():
        async with AsyncClient(fake.address, timeout_s=30.0, reattach=False) as c:
            fut = asyncio.ensure_future(c.generate(np.array([1, 2]), {"max_tokens": 2}, request_id="a"))
            await _until(lambda: fake.submits and all(r.sid for r in c._reqs.values()), fake)
            fake.sid = "sched-B"
            await _until(fut.done, fake, timeout=3.0)
            with pytest.raises(ClusterUnavailable, match="scheduler restarted"):
                fut.result()
            fut = asyncio.ensure_future(c.generate([3], {"max_tokens": 1}, request_id="b"))
            await _until(lambda: len(fake.submits) == 2, fake)
            ident, sub = fake.submits[1]
            fake.output(ident, sub.request_id, 5, finish="length")
            await _until(fut.done, fake)
            assert fut.result().outputs[0].token_ids == [5]
            await asyncio.sleep(1.2)  # pongs from B now: b stays B's, nothing more fails
            fake.pump()

    try:
        asyncio.run(main())
    finally:
        fake.close()


@pytest.mark.timeout(30)
def test_a_scheduler_that_died_before_the_first_pong_is_noticed_too():
    """The first request of a fresh client: its Submit and Ping reach a scheduler that dies
    before answering; the restarted one (whose id the client never saw) says in its Pong that
    it does not hold the request, which goes again (retries) or fails at once, never hangs."""
    fake = FakeScheduler()

    async def main():
        async with AsyncClient(fake.address, timeout_s=30.0, retries=1, reattach=False) as c:
            retried = asyncio.ensure_future(c.generate([1, 2], {"max_tokens": 2}, request_id="a"))
            await asyncio.sleep(0.2)
            fake.drop_all()  # Submit "a" and its Ping: read, then lost with the scheduler
            fake.sid, fake.forgets = "sched-B", True
            await _until(lambda: len(fake.submits) == 1, fake, timeout=3.0)
            ident, again = fake.submits[0]
            assert again.request_id == "a~1"
            fake.output(ident, "a~1", 5, finish="length")
            assert (await asyncio.wait_for(retried, 5)).outputs[0].token_ids == [5]
        async with AsyncClient(fake.address, timeout_s=30.0, reattach=False) as c:  # no retries: a typed error, at once
            fut = asyncio.ensure_future(c.generate([3], {"max_tokens": 2}, request_id="b"))
            await asyncio.sleep(0.2)
            fake.drop_all()
            fake.submits.clear()
            await _until(fut.done, fake, timeout=3.0)
            with pytest.raises(ClusterUnavailable, match="scheduler restarted"):
                fut.result()

    try:
        asyncio.run(main())
    finally:
        fake.close()


@pytest.mark.timeout(30)
def test_a_restarted_scheduler_gets_the_open_requests_back_with_what_they_received():
    fake = FakeScheduler()

    async def main():
        async with AsyncClient(fake.address, timeout_s=30.0) as c:
            stream = c.stream([1, 2, 3], {"max_tokens": 8})
            it = stream.__aiter__()
            first = asyncio.ensure_future(it.__anext__())
            await _until(lambda: len(fake.submits) == 1, fake)
            ident, sub = fake.submits[0]
            fake.output(ident, sub.request_id, 7, prompt_token_ids=np.asarray([1, 2, 3], np.int32), seed=99)
            assert (await first).token_ids == [7]
            fake.output(ident, sub.request_id, 8)
            assert (await it.__anext__()).token_ids == [8]
            waiting = asyncio.ensure_future(c.generate([4, 5], {"max_tokens": 4}, request_id="w"))
            await _until(lambda: len(fake.submits) == 2, fake)
            await _until(lambda: all(r.sid == "sched-A" for r in c._reqs.values()), fake)
            fake.sid = "sched-B"
            nxt = asyncio.ensure_future(it.__anext__())
            await _until(lambda: len(fake.reattaches) == 2, fake, timeout=3.0)
            assert not nxt.done(), "the stream pauses, it does not fail"
            got = {m.submit.request_id: (i, m) for i, m in fake.reattaches}
            assert set(got) == {sub.request_id + "~1", "w~1"} and {sub.request_id, "w"} <= set(fake.aborts)
            i, ra = got[sub.request_id + "~1"]
            assert ra.prompt_token_ids.tolist() == [1, 2, 3] and ra.seed == 99
            assert [(s.index, s.token_ids.tolist(), s.chars, s.finish_reason) for s in ra.seqs] == [(0, [7, 8], 2, None)]
            assert ra.submit.prompt_token_ids.tolist() == [1, 2, 3] and ra.submit.stream
            _, plain = got["w~1"]  # no output yet: it simply runs again
            assert plain.prompt_token_ids is None and not plain.seqs and plain.submit.prompt_token_ids.tolist() == [4, 5]
            fake.output(i, ra.submit.request_id, 9, finish="length")
            fake.output(i, "w~1", 5, finish="length")
            d = await asyncio.wait_for(nxt, 5)
            assert d.token_ids == [9] and d.finish_reason == "length"
            assert (await asyncio.wait_for(waiting, 5)).outputs[0].token_ids == [5]
            # restarted again: the re-attached request moves on to ~2 the same way
            more = asyncio.ensure_future(c.generate([6], {"max_tokens": 4}, request_id="m"))
            await _until(lambda: len(fake.submits) == 3, fake)
            ident, sub = fake.submits[2]
            fake.output(ident, "m", 1, prompt_token_ids=np.asarray([6], np.int32), seed=5)
            await _until(lambda: all(r.sid == "sched-B" and r.started for r in c._reqs.values()), fake)
            fake.sid = "sched-C"
            await _until(lambda: len(fake.reattaches) == 3, fake, timeout=3.0)
            i, ra = fake.reattaches[2]
            assert ra.submit.request_id == "m~1" and ra.seqs[0].token_ids.tolist() == [1]
            fake.output(i, "m~1", 2, finish="length")
            assert (await asyncio.wait_for(more, 5)).outputs[0].token_ids == [1, 2]

    try:
        asyncio.run(main())
    finally:
        fake.close()


@pytest.mark.timeout(30)
def test_a_request_over_the_reattach_limit_fails_with_the_typed_error():
    fake = FakeScheduler()

    async def main():
        async with AsyncClient(fake.address, timeout_s=30.0, reattach_max_tokens=1) as c:
            fut = asyncio.ensure_future(c.generate([1], {"max_tokens": 8}, request_id="a"))
            await _until(lambda: len(fake.submits) == 1, fake)
            ident, _ = fake.submits[0]
            fake.output(ident, "a", 3, prompt_token_ids=np.asarray([1], np.int32))
            fake.output(ident, "a", 4)  # the second token is over the limit: nothing kept
            await _until(lambda: all(r.sid == "sched-A" and r.kept is None for r in c._reqs.values()), fake)
            fake.sid = "sched-B"
            await _until(fut.done, fake, timeout=3.0)
            with pytest.raises(ClusterUnavailable, match="reattach_max_tokens"):
                fut.result()
            assert not fake.reattaches

    try:
        asyncio.run(main())
    finally:
        fake.close()
