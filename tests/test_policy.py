"""Block manager and scheduling policy, without a model: pure accounting."""

import pytest

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.messages import StepResult
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.services.scheduler.block_manager import BlockManager
from zeroserve.services.scheduler.policy import Scheduler
from zeroserve.services.scheduler.request import Request, Status

BS = 16


def make_sched(num_blocks=64, max_seqs=8, budget=64, max_len=1024, prefix=True):
    return Scheduler(BlockManager(num_blocks, BS, prefix), max_seqs, budget, max_len, eos_token_ids=[2])


def req(rid, n_prompt, max_tokens=8, base=100, **kw):
    p = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return Request(rid, list(range(base, base + n_prompt)), p, seed=0, max_model_len=1024)


def run_step(s, token=7):
    so = s.schedule()
    ids = so.req_ids()
    sampled = [token if s.requests[r].num_computed_tokens == s.requests[r].num_tokens else -1 for r in ids]
    return so, s.update(so, StepResult(seq=0, req_ids=ids, sampled_token_ids=sampled))


def test_block_refcount_and_lru_eviction():
    bm = BlockManager(4, BS)
    a, b = req("a", 40), req("b", 40, base=500)
    assert bm.can_allocate(a, 40)
    bm.allocate(a, 40)
    a_blocks = list(a.block_ids)
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 1
    assert not bm.can_allocate(b, 40)
    a.num_computed_tokens = 40
    bm.commit_full_blocks(a, 40)  # 2 full blocks cached
    bm.release(a)
    assert bm.num_free_blocks == 4 and bm.ref_cnt == [0, 0, 0, 0]
    # the cached prefix is still findable after release
    c = req("c", 40)
    assert bm.lookup(c.token_ids) == a_blocks[:2]
    # allocating everything evicts the cached blocks (LRU), after which the lookup misses
    bm.allocate(b, 64)
    assert bm.lookup(c.token_ids) == []


def test_prefix_cache_equality_check_and_chaining():
    bm = BlockManager(16, BS)
    a = req("a", 33)
    bm.allocate(a, 33)
    a.num_computed_tokens = 33
    bm.commit_full_blocks(a, 33)
    # same second block but a different first block: chained keys must not match
    other = list(range(900, 916)) + a.token_ids[16:32] + [5]
    assert bm.lookup(other) == []
    # same first block only
    assert len(bm.lookup(a.token_ids[:16] + [1] * 17)) == 1
    # every full block counts, the last one too (take_cached leaves the last token to compute)
    assert len(bm.lookup(a.token_ids[:32])) == 2
    assert bm.num_cached_prefix_tokens(a.token_ids[:32]) == 31


def test_continuous_batching_respects_budget_and_seats():
    s = make_sched(max_seqs=3, budget=50)
    for i in range(5):
        s.add_request(req(f"r{i}", 30, base=100 * (i + 1)))
    so = s.schedule()
    assert so.total_tokens <= 50
    assert len(s.running) <= 3
    # chunked prefill: the second request got only the remaining budget
    assert so.num_scheduled() == {"r0": 30, "r1": 20}


def test_mixed_decode_and_prefill_and_finish_by_length():
    s = make_sched(budget=32)
    s.add_request(req("a", 10, max_tokens=3))
    run_step(s)  # prefill a, samples token 1
    s.add_request(req("b", 40, max_tokens=2, base=300))
    so, _ = run_step(s)
    assert so.num_scheduled()["a"] == 1 and so.num_scheduled()["b"] == 31
    for _ in range(10):
        if not s.has_work():
            break
        run_step(s)
    assert not s.has_work()
    assert s.bm.num_used_blocks == 0


def test_eos_min_tokens_and_stop_ids():
    s = make_sched()
    r = req("a", 5, max_tokens=10, min_tokens=2)
    s.add_request(r)
    _, ev = run_step(s, token=2)  # eos before min_tokens: ignored
    assert not ev[0].finished
    _, ev = run_step(s, token=2)
    assert ev[0].finished and r.finish_reason == "stop"
    r2 = req("b", 5, max_tokens=10, stop_token_ids=[9])
    s.add_request(r2)
    run_step(s, token=4)
    _, ev = run_step(s, token=9)
    assert ev[0].finished and r2.stop_reason == 9
    r3 = req("c", 5, max_tokens=10, ignore_eos=True)
    s.add_request(r3)
    for _ in range(9):
        _, ev = run_step(s, token=2)
        assert not ev[0].finished
    _, ev = run_step(s, token=2)
    assert ev[0].finished and r3.finish_reason == "length"


def test_preemption_when_blocks_run_out_then_recompute():
    s = make_sched(num_blocks=6, budget=256, max_seqs=8)
    a, b = req("a", 40, max_tokens=40), req("b", 40, max_tokens=40, base=400)
    s.add_request(a)
    s.add_request(b)
    preempted_seen = False
    for _ in range(200):
        if not s.has_work():
            break
        so, _ = run_step(s)
        if so.finished_req_ids and any(s.requests.get(r) and s.requests[r].status != Status.FINISHED for r in so.finished_req_ids):
            preempted_seen = True
    assert not s.has_work()
    assert s.num_preemptions > 0 and preempted_seen
    assert a.num_output_tokens == 40 and b.num_output_tokens == 40
    assert s.bm.num_used_blocks == 0


def test_prefix_cache_hit_skips_computation():
    s = make_sched(budget=512)
    shared = list(range(1000, 1064))
    s.add_request(Request("a", shared + [1, 2, 3], SamplingParams(max_tokens=1), 0, 1024))
    run_step(s)
    s.add_request(Request("b", shared + [4, 5, 6], SamplingParams(max_tokens=1), 0, 1024))
    so = s.schedule()
    assert so.new_reqs[0].num_computed_tokens == 64
    assert so.num_scheduled()["b"] == 3
    assert s.bm.hits == 64


def test_whole_prompt_cached_computes_only_its_last_token_without_writing_it():
    """A prompt whose every block is cached (a repeated prompt, the length a multiple of the
    block size) computes its last token again for the logits, and tells the worker not to write
    that token's K/V: the block it sits in is shared with the cache."""
    s = make_sched(budget=512)
    prompt = list(range(1000, 1032))  # two full blocks
    s.add_request(Request("a", list(prompt), SamplingParams(max_tokens=1), 0, 1024))
    first, _ = run_step(s)
    assert first.new_reqs[0].num_cached_kv_tokens == 0
    s.schedule()  # a finished (max_tokens=1): its blocks are freed and stay cached
    s.add_request(Request("b", list(prompt), SamplingParams(max_tokens=1), 0, 1024))
    so = s.schedule()
    n = so.new_reqs[0]
    assert (n.num_computed_tokens, n.num_scheduled_tokens, n.num_cached_kv_tokens) == (31, 1, 32)
    assert n.check() is None
    assert s.bm.hits == 31
    # both blocks are the cached ones, shared (no copy), and no new block for the last token
    assert s.requests["b"].block_ids == first.new_reqs[0].block_ids.tolist()


def test_n_samples_share_prompt_blocks_without_prefix_cache():
    s = make_sched(prefix=False, budget=512)
    p = SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1)
    reqs = [Request(f"x#{i}", list(range(50)), p, i, 1024, client_id="x", index=i) for i in range(3)]
    for r in reqs:
        r.siblings = reqs
        s.add_request(r)
    so = s.schedule()
    # sample 0 computes the prompt; the others share its full blocks in the same step (every
    # layer writes the step's K/V before it attends) and compute only the tail themselves
    assert so.num_scheduled() == {"x#0": 50, "x#1": 2, "x#2": 2}
    shared = reqs[0].block_ids[:3]
    assert reqs[1].block_ids[:3] == shared and reqs[2].block_ids[:3] == shared
    assert all(s.bm.ref_cnt[b] == 3 for b in shared)


def test_prompt_validation():
    s = make_sched(max_len=64)
    with pytest.raises(InvalidRequest, match="empty"):
        s.add_request(req("e", 0))
    with pytest.raises(InvalidRequest, match="max_model_len"):
        s.add_request(req("long", 64))
    s.add_request(req("ok", 10))
    with pytest.raises(InvalidRequest, match="already in use"):
        s.add_request(req("ok", 10))


def test_abort_frees_blocks():
    s = make_sched()
    s.add_request(req("a", 40))
    run_step(s)
    assert s.bm.num_used_blocks == 3
    s.finish_request("a", "abort")
    assert s.bm.num_used_blocks == 0
    assert s.schedule().finished_req_ids == ["a"]
