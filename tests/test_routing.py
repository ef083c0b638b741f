"""Prefix-aware routing across worker groups (scheduler `_route`): a request goes to the group
whose prefix cache holds the longest prefix of its prompt, even when that group is busier.

One module-scoped cluster with groups g0 and g1. Which group served a request is read from the
scheduler's stats: the group whose `tokens` (tokens computed) grew while the other stayed idle.

1. prompt A (100 tokens: 6 full KV blocks) runs somewhere -> group GA; requests sharing A's
   first 96 tokens (other suffixes, sequential and concurrent) all go to GA and each one adds
   the shared blocks to GA's `prefix_cache_hit_tokens`;
2. while a long request keeps GA busy, prompt B (unrelated) goes to the idle group GB, and B's
   followers go to GB while A's followers still go to the busier GA.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import LocalCluster
from tests.helpers import cached_model_dir, random_prompt

BLOCK = 16
SHARED = 6 * BLOCK  # shared prefix: six full blocks


def _params(n: int = 4):
    from zeroserve import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(cached_model_dir("llama"), workers=2, num_kv_blocks=256).running(groups=2) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with cluster.client(timeout_s=30.0) as c:
        yield c


PREFIX_A = random_prompt(SHARED, 512, seed=11)
PREFIX_B = random_prompt(SHARED, 512, seed=22)
STATE: dict = {}


def _snap(cluster) -> dict[str, dict]:
    return {g["name"]: g for g in cluster.stats()["groups"]}


def _served_by(before: dict, after: dict) -> list[str]:
    return sorted(n for n in after if after[n]["tokens"] > before.get(n, {}).get("tokens", 0))


def _follower(prefix: list[int], seed: int) -> list[int]:
    return prefix + random_prompt(5 + seed % 17, 512, seed=1000 + seed)


def test_prefix_followers_go_to_the_same_group(cluster, client):
    s0 = _snap(cluster)
    assert sorted(s0) == ["g0", "g1"] and all(g["state"] == "ready" for g in s0.values())
    client.generate(PREFIX_A + [7, 8, 9, 10], _params())
    s1 = _snap(cluster)
    served = _served_by(s0, s1)
    assert len(served) == 1, (s0, s1)
    ga = STATE["ga"] = served[0]

    # sequential followers: each hits the six shared blocks on GA
    for k in range(3):
        before = _snap(cluster)
        client.generate(_follower(PREFIX_A, k), _params())
        after = _snap(cluster)
        assert _served_by(before, after) == [ga], f"follower {k} went elsewhere: {before} -> {after}"
        assert after[ga]["prefix_cache_hit_tokens"] - before[ga]["prefix_cache_hit_tokens"] >= SHARED

    # concurrent followers: all of them still go to GA (a prefix hit beats the idle other group)
    before = _snap(cluster)
    prompts = [_follower(PREFIX_A, 10 + k) for k in range(6)]
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: client.generate(p, _params()), prompts))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    after = _snap(cluster)
    assert _served_by(before, after) == [ga], (before, after)
    assert after[ga]["prefix_cache_hit_tokens"] - before[ga]["prefix_cache_hit_tokens"] >= len(prompts) * SHARED
    # the client sees the cached tokens too
    assert all(o.num_cached_tokens >= SHARED for o in outs), [o.num_cached_tokens for o in outs]


def test_two_prefixes_two_groups(cluster, client):
    """While GA is busy with a long request, an unrelated prompt goes to the idle group, and the
    followers of each prefix go to the group that holds it (GA although it is the busier one)."""
    ga = STATE.get("ga")
    if ga is None:
        pytest.skip("needs the previous test")
    from zeroserve import SamplingParams

    with cluster.client(timeout_s=30.0) as c2:
        long_run = c2.stream(_follower(PREFIX_A, 99), SamplingParams(max_tokens=1500, temperature=0.0,
                                                                     ignore_eos=True))
        first = next(iter(long_run))  # it runs (on GA: it shares A's prefix)
        assert first.num_cached_tokens >= SHARED
        try:
            snap = _snap(cluster)
            assert snap[ga]["running"] == 1, snap
            before = snap
            client.generate(PREFIX_B + [3, 4, 5], _params())
            after = _snap(cluster)
            gb = [n for n in _served_by(before, after) if n != ga]
            assert len(gb) == 1, f"B should have gone to the idle group: {before} -> {after}"
            gb = gb[0]

            for prefix, target, other in ((PREFIX_B, gb, ga), (PREFIX_A, ga, gb)):
                b_hits = _snap(cluster)[target]["prefix_cache_hit_tokens"]
                other_tokens_before = _snap(cluster)[other]["tokens"]
                client.generate(_follower(prefix, 50), _params())
                a = _snap(cluster)
                assert a[target]["prefix_cache_hit_tokens"] - b_hits >= SHARED, (target, a)
                if other != ga:  # GA is computing the long request: its token count moves anyway
                    assert a[other]["tokens"] == other_tokens_before, (other, a)
        finally:
            long_run.close()  # aborts it
    deadline = time.monotonic() + 15
    while any(g["running"] for g in _snap(cluster).values()):
        assert time.monotonic() < deadline, "the long request was not aborted"
        time.sleep(0.2)
