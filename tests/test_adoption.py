"""A restarted scheduler adopts re-attached requests (services/scheduler/adoption.py), without sockets.

One fake cluster runs a request part of the way and "dies"; a fresh Cluster (a new scheduler
instance) gets the client's `Reattach` with what the client had received, recomputes, and
streams on: the tokens and text the client ends up with are those of an undisturbed run, none
repeated, and the detokenizer was handed each sequence's history and text offset. A worker that
kept its KV (`Hello.kept`) saves the recompute of its full blocks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.common import messages as P  # noqa: E402
from zeroserve.common.sampling_params import SamplingParams  # noqa: E402
from tests.scheduler_sim import (  # noqa: E402
    CLIENT_ID,
    MODEL,
    FakeWorker,
    Net,
    make_cluster,
    prompt,
    reference,
    text_of,
)


def _cluster() -> Net:
    net = Net(make_cluster())
    net.join("g0")
    net.join_detok("detok")
    return net


def _first_part(rid: str, p: list[int], max_tokens: int, keep: int, **params):
    """Run `rid` on one scheduler until its client has at least `keep` tokens; return (what the
    client got: tokens, text; the first Output's prompt ids and seed)."""
    net = _cluster()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    net.send(net.c.on_submit(CLIENT_ID, P.Submit(request_id=rid, prompt_token_ids=np.asarray(p, np.int32), params=sp),
                             net.now))
    net.run(lambda: len(net.got(rid)[0]) >= keep)
    toks, text, reasons, errors = net.got(rid)
    assert not reasons and not errors
    first = next(m for m in net.clients[CLIENT_ID] if isinstance(m, P.Outputs)).items[0]
    return toks, text, first, sp


def test_a_reattached_request_goes_on_with_the_same_tokens_and_text():
    p = prompt(37, 1)
    toks, text, first, sp = _first_part("r", p, 40, keep=5)
    assert first.prompt_token_ids.tolist() == p and first.seed is not None  # what a client re-attaches with
    net = _cluster()  # the restarted scheduler: new state, workers rejoined
    sub = P.Submit(request_id="r~1", prompt="text is not tokenized again", params=sp)
    net.send(net.c.on_reattach(CLIENT_ID, P.Reattach(
        submit=sub, prompt_token_ids=first.prompt_token_ids, seed=first.seed,
        seqs=[P.ResumeSeq(index=0, token_ids=np.asarray(toks, np.int32), chars=len(text))]), net.now))
    net.run(lambda: net.done("r~1"))
    more, more_text, reasons, errors = net.got("r~1")
    assert not errors and reasons == ["length"]
    assert toks + more == reference(p, 40) and text + more_text == text_of(toks + more)
    outs = [o for m in net.clients[CLIENT_ID] if isinstance(m, P.Outputs) for o in m.items]
    assert all(o.prompt_token_ids is None for o in outs), "the client has the prompt ids already"
    (replayed,) = net.detok.new  # the detokenizer got the history and the text offset
    assert replayed.output_token_ids.tolist() == toks and replayed.text_offset == len(text)
    m = net.c.metrics  # counted as re-attached; its first token was timed by the scheduler before
    assert m.totals["reattached"] == 1 and m._sums["ttft"][1] == 0 and m.totals["requests_finished"] == 1
    (new,) = net.workers["g0"][0].seen_new  # recomputed as a preempted request is: prompt + tokens so far
    assert new.token_ids.tolist() == p + toks and new.num_prompt_tokens == len(p) and new.seed == first.seed
    assert not net.c.live, "it ended and was forgotten"


def test_n2_with_one_completion_done_resumes_only_the_other():
    p = prompt(20, 2)
    net = _cluster()
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2, seed=7)
    want = reference(p, 12)  # the fake model is deterministic: both completions agree
    net.send(net.c.on_reattach(CLIENT_ID, P.Reattach(
        submit=P.Submit(request_id="q~1", params=sp, prompt_token_ids=np.asarray(p, np.int32)),
        prompt_token_ids=np.asarray(p, np.int32), seed=7,
        seqs=[P.ResumeSeq(index=0, token_ids=np.asarray(want, np.int32), chars=len(text_of(want)),
                          finish_reason="length"),
              P.ResumeSeq(index=1, token_ids=np.asarray(want[:3], np.int32), chars=len(text_of(want[:3])))]),
        net.now))
    net.run(lambda: not net.c.live)
    outs = [o for m in net.clients[CLIENT_ID] if isinstance(m, P.Outputs) for o in m.items]
    assert {o.index for o in outs} == {1}, "completion 0 had ended: nothing more for it"
    assert [t for o in outs for t in o.token_ids] == want[3:] and outs[-1].finish_reason == "length"


def test_without_output_a_reattach_is_a_submit():
    p = prompt(10, 3)
    net = _cluster()
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    net.send(net.c.on_reattach(CLIENT_ID, P.Reattach(
        submit=P.Submit(request_id="s~1", params=sp, prompt_token_ids=np.asarray(p, np.int32))), net.now))
    net.run(lambda: net.done("s~1"))
    toks, text, reasons, errors = net.got("s~1")
    assert toks == reference(p, 6) and reasons == ["length"] and not errors
    first = next(m for m in net.clients[CLIENT_ID] if isinstance(m, P.Outputs)).items[0]
    assert first.prompt_token_ids.tolist() == p


@pytest.mark.parametrize("seqs, match", [
    ([P.ResumeSeq(index=3, token_ids=np.asarray([5], np.int32))], "do not exist"),
    ([P.ResumeSeq(index=0, token_ids=np.asarray([5] * 8, np.int32))], "no room"),
    ([P.ResumeSeq(index=0, token_ids=np.asarray([600], np.int32))], "re-attached token ids"),
])
def test_a_state_no_run_can_have_is_refused_in_words(seqs, match):
    net = _cluster()
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    p = np.asarray(prompt(10, 4), np.int32)
    net.send(net.c.on_reattach(CLIENT_ID, P.Reattach(submit=P.Submit(request_id="x~1", params=sp, prompt_token_ids=p),
                                                     prompt_token_ids=p, seqs=seqs), net.now))
    _, _, _, errors = net.got("x~1")
    assert len(errors) == 1 and match in errors[0].message and not net.c.live


def test_resumed_completions_need_the_prompt_ids():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        P.Reattach(submit=P.Submit(request_id="a", prompt="x"), seqs=[P.ResumeSeq(index=0)])


# ================================================================== KV a worker kept


def test_adopted_blocks_are_found_and_handed_out_last():
    from zeroserve.services.scheduler.block_manager import BlockManager
    from zeroserve.services.scheduler.request import Request

    bm = BlockManager(16, 4)
    toks = list(range(10, 22))  # 3 full blocks
    assert bm.adopt_cached(toks, [9, 2, 5]) == 3
    assert bm.adopt_cached(toks[:8], [9, 2]) == 0, "a shared prefix reported again adds nothing"
    assert bm.adopt_cached([1, 2, 3, 4, 5, 6, 7, 8], [2, 7]) == 0, "block 2 holds other tokens: the chain ends"
    assert bm.lookup(toks + [99]) == [9, 2, 5] and bm.num_free_blocks == 16
    assert bm.adopt_cached(list(range(30, 34)), [11], lora_path="/a/x") == 1  # KV computed under an adapter
    assert bm.lookup(list(range(30, 35))) == [] and bm.lookup(list(range(30, 35)), "/a/x") == [11]
    r = Request("x", [50] * 40, SamplingParams(max_tokens=1), 0, 64)
    got = bm.allocate(r, 40)  # 10 blocks: the never-used ones first, the kept ones last
    assert not set(got) & {9, 2, 5} and bm.lookup(toks + [99]) == [9, 2, 5]
    r2 = Request("y", [60] * 24, SamplingParams(max_tokens=1), 0, 64)
    bm.allocate(r2, 24)  # 6 more: the kept content goes, least recently freed first
    assert bm.num_free_blocks == 0 and bm.lookup(toks + [99]) == []


def test_a_group_that_kept_its_kv_skips_recomputing_it():
    p = prompt(37, 5)
    toks, text, first, sp = _first_part("k", p, 40, keep=20)
    seq = p + toks
    full = len(seq) // 16
    net = Net(make_cluster())  # the restarted scheduler; the worker's cache holds blocks 3.. for the sequence
    w = FakeWorker("g0-r0")
    h = P.Hello(role="worker", worker_id=w.worker_id, group="g0", model=MODEL, num_kv_blocks=64, block_size=16,
                max_model_len=2048,
                kept=[P.KeptSeq(token_ids=np.asarray(seq[:full * 16], np.int32), block_ids=np.arange(3, 3 + full))])
    net.send(net.c.on_hello(w.ident, h, net.now))
    net.now += 0.2
    net.send(net.c.tick(net.now))
    probe = [m for g, m in net.published if isinstance(m, P.Probe)][-1]
    net.send(net.c.on_probe_ack(w.ident, P.ProbeAck(worker_id=w.worker_id, probe_id=probe.probe_id), net.now))
    net.workers["g0"] = [w]
    net.join_detok("detok")
    net.send(net.c.on_reattach(CLIENT_ID, P.Reattach(
        submit=P.Submit(request_id="k~1", params=sp, prompt_token_ids=np.asarray(p, np.int32)),
        prompt_token_ids=first.prompt_token_ids, seed=first.seed,
        seqs=[P.ResumeSeq(index=0, token_ids=np.asarray(toks, np.int32), chars=len(text))]), net.now))
    net.run(lambda: net.done("k~1"))
    more, more_text, reasons, errors = net.got("k~1")
    assert not errors and toks + more == reference(p, 40) and text + more_text == text_of(toks + more)
    new = [n for n in w.seen_new if n.num_prompt_tokens == len(p)][-1]
    assert new.num_computed_tokens == full * 16, "the kept blocks were not computed again"
    assert new.block_ids.tolist()[:full] == list(range(3, 3 + full))


def test_a_worker_keeps_full_computed_blocks_for_a_while():
    from types import SimpleNamespace

    from zeroserve.services.worker.kept import KEPT_TTL_S, Kept

    k = Kept()
    k.take([SimpleNamespace(token_ids=list(range(40)), num_computed=37, block_ids=[4, 5, 6], lora_path="/a/x"),
            SimpleNamespace(token_ids=[1, 2, 3], num_computed=3, block_ids=[7], lora_path=None)], 16, now=0.0)
    (s,) = k.report(now=1.0)  # two full computed blocks (and their adapter); the short one holds none
    assert s.token_ids.tolist() == list(range(32)) and s.block_ids.tolist() == [4, 5] and s.lora_path == "/a/x"
    assert k.report(now=KEPT_TTL_S + 1) == [] and k.report(now=2.0) == []
