"""The cluster, end to end: scheduler, detokenizer and worker processes on loopback ports.

One module-scoped cluster (one worker group "g0") serves every test here; the last test starts
a second group "g1" while requests run. The tiny llama model (random weights, fp32) is cheap to
run in HF transformers, which is the reference for every greedy output.

    1. 64 concurrent streams (prompts of 1..200 token ids, 4..24 new tokens) == HF greedy
    2. streamed deltas joined == the final text == Client.generate (tokens and text)
    3. leaving a stream early (Abort) frees the request's KV blocks
    4. stop strings cut the text where they should (with and without the stop string)
    5. a worker group started mid-run joins and takes requests
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import LocalCluster, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir, torch_single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("no_leftover_processes", "torch_single_thread")

ARCH = "llama"
VOCAB = 512
N_STREAMS = 64
KV_BLOCKS = 512


# ------------------------------------------------------------------------------ references


def hf_greedy(prompt: list[int], n: int, ignore_eos: bool) -> list[int]:
    """HF transformers fp32 greedy, one prompt at a time, cached per process.

    ``ignore_eos`` (vLLM: EOS is an ordinary token) compares with HF generate(eos_token_id=[]);
    ``min_tokens=max_tokens`` (EOS banned) with HF generate(min_new_tokens=n)."""
    from tests.hf_reference import hf_greedy as _hf

    return _hf(ARCH, prompt, n, "ignore" if ignore_eos else "min_new")


def greedy_params(n: int, ignore_eos: bool = True, **kw):
    from zeroserve import SamplingParams

    if ignore_eos:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, **kw)


@dataclass
class Streamed:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    deltas: int = 0
    finish_reason: str | None = None
    stop_reason: object = None
    after_finish: int = 0  # deltas seen after the one that carried finish_reason (must be 0)
    prompt_token_ids: list[int] | None = None


async def _consume(client, prompt, params) -> Streamed:
    s = Streamed()
    async for d in client.stream(prompt, params):
        if s.finish_reason is not None:
            s.after_finish += 1
        if s.deltas == 0:
            s.prompt_token_ids = d.prompt_token_ids
        s.deltas += 1
        s.tokens += d.token_ids
        s.text += d.text
        if d.finish_reason is not None:
            s.finish_reason, s.stop_reason = d.finish_reason, d.stop_reason
    return s


def run_streams(address: str, jobs: list[tuple], timeout_s: float = 240.0) -> list[Streamed]:
    """Run every (prompt, params) job as a stream, all at once on one AsyncClient."""
    from zeroserve import AsyncClient

    async def main():
        async with AsyncClient(address, timeout_s=30.0) as c:
            return await asyncio.wait_for(asyncio.gather(*(_consume(c, p, sp) for p, sp in jobs)), timeout_s)

    return asyncio.run(main())


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_model_dir(ARCH)


@pytest.fixture(scope="module")
def cluster(model_dir):
    c = LocalCluster(model_dir, workers=1, num_kv_blocks=KV_BLOCKS)
    try:
        c.start()  # returns at once; the processes start while the caller does other work
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def ready(cluster):
    """The cluster once it serves (start-up takes 20-60 s on a busy 2-core box)."""
    cluster.wait_ready(timeout=240)
    return cluster


@pytest.fixture(scope="module")
def workload(cluster):
    """64 mixed requests and their HF greedy references (computed while the cluster starts).

    Prompts are token-id lists of 1..200 tokens; a few share a 48-token prefix (prefix cache
    hits inside one batch); even requests use ignore_eos, odd ones min_tokens=max_tokens."""
    rng = random.Random(20240611)
    shared = [rng.randrange(3, VOCAB) for _ in range(48)]
    prompts, ns = [], []
    for i in range(N_STREAMS):
        if i < 3:
            length = (1, 2, 200)[i]
        else:
            length = rng.randint(1, 200)
        p = [rng.randrange(3, VOCAB) for _ in range(length)]
        if i % 8 == 5:
            p = shared + p[:150]
        prompts.append(p)
        ns.append(rng.randint(4, 24))
    refs = [hf_greedy(p, n, ignore_eos=(i % 2 == 0)) for i, (p, n) in enumerate(zip(prompts, ns))]
    return prompts, ns, refs


@pytest.fixture(scope="module")
def streamed(workload, ready):
    """The 64 concurrent streams, run once for the tests that check them (the HF references
    are computed first, while the cluster's processes start)."""
    prompts, ns, _ = workload
    jobs = [(p, greedy_params(n, ignore_eos=(i % 2 == 0))) for i, (p, n) in enumerate(zip(prompts, ns))]
    t0 = time.monotonic()
    results = run_streams(ready.address, jobs)
    return results, time.monotonic() - t0


def _stats(cluster, client=None) -> dict:
    return client.stats() if client is not None else cluster.stats()


def _group(stats: dict, name: str) -> dict | None:
    return next((g for g in stats["groups"] if g["name"] == name), None)


def wait_idle(client, timeout: float = 60.0) -> dict:
    """Poll stats until no request is live and no KV block is in use in any group."""
    deadline = time.monotonic() + timeout
    s = client.stats()
    while time.monotonic() < deadline:
        s = client.stats()
        if s["requests"] == 0 and all(g.get("kv_blocks_used", 0) == 0 and g.get("running", 0) == 0
                                      and g.get("waiting", 0) == 0 for g in s["groups"]):
            return s
        time.sleep(0.1)
    raise AssertionError(f"the cluster did not go idle in {timeout}s: {s}")


# ------------------------------------------------------------------------------ 1. greedy == HF


@pytest.mark.timeout(420)
def test_64_concurrent_streams_match_hf_greedy(streamed, workload, ready):
    from tests.hf_reference import explain_mismatch

    results, elapsed = streamed
    prompts, ns, refs = workload
    bad = []
    for i, (r, p, n, ref) in enumerate(zip(results, prompts, ns, refs)):
        assert r.finish_reason == "length", f"request {i}: finish_reason {r.finish_reason!r}"
        assert r.after_finish == 0, f"request {i}: {r.after_finish} deltas after the final one"
        assert r.prompt_token_ids == p, f"request {i}: the first delta carries other prompt ids"
        assert len(r.tokens) == n, f"request {i}: {len(r.tokens)} tokens, asked for {n}"
        if r.tokens != ref:
            bad.append(f"request {i}: " + explain_mismatch(ARCH, p, r.tokens, ref))
    assert not bad, f"{len(bad)} of {N_STREAMS} greedy outputs differ from HF:\n" + "\n".join(bad[:5])
    s = ready.stats()
    g0 = _group(s, "g0")
    assert g0["steps"] > 0 and s["tokens_total"] >= sum(ns)
    print(f"64 streams in {elapsed:.1f}s; stats: steps={g0['steps']} preemptions={g0['num_preemptions']}")


# ------------------------------------------------------------------------------ 2. deltas == text


@pytest.mark.timeout(300)
def test_stream_deltas_join_to_the_final_text_and_equal_generate(streamed, workload, ready):
    from zeroserve.common.tokenizer import load_tokenizer

    results, _ = streamed
    prompts, ns, _ = workload
    tok = load_tokenizer(ready.model)
    # a few of the 64 streams again, with the blocking generate API (same greedy request)
    picked = [0, 1, 2, 5, 13, 21]
    text_prompts = ["The cluster says", "hello world, how are you today?", "a b c d e f g"]
    with ready.client(timeout_s=30.0, request_timeout_s=120.0) as c:
        for i in picked:
            sp = greedy_params(ns[i], ignore_eos=(i % 2 == 0))
            out = c.generate(prompts[i], sp)
            o = out.outputs[0]
            assert o.token_ids == results[i].tokens, f"request {i}: generate tokens != streamed tokens"
            assert o.text == results[i].text, f"request {i}: generate text != joined deltas"
            assert o.finish_reason == results[i].finish_reason == "length"
            assert out.prompt_token_ids == prompts[i]
            if i % 8 == 5:  # its prompt ran before: its full blocks are found in the prefix cache
                assert out.num_cached_tokens >= 48, f"request {i}: {out.num_cached_tokens} cached tokens"
        for prompt in text_prompts:
            sp = greedy_params(16)
            deltas = list(c.stream(prompt, sp))
            out = c.generate(prompt, sp)
            o = out.outputs[0]
            toks = [t for d in deltas for t in d.token_ids]
            text = "".join(d.text for d in deltas)
            assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
            assert deltas[-1].finish_reason == "length"
            assert toks == o.token_ids and len(toks) == 16
            assert text == o.text, f"{prompt!r}: joined deltas {text!r} != generate text {o.text!r}"
            # the whole text is what a full decode of the output shows (byte-level BPE, ASCII prompt)
            assert text == tok.decode(toks, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            assert deltas[0].prompt_token_ids == tok.encode(prompt) == out.prompt_token_ids
            assert toks == hf_greedy(out.prompt_token_ids, 16, ignore_eos=True)


# ------------------------------------------------------------------------------ 3. abort frees blocks


@pytest.mark.timeout(300)
def test_leaving_a_stream_aborts_and_frees_its_blocks(ready):
    from zeroserve import AsyncClient

    rng = random.Random(7)
    prompt = [rng.randrange(3, VOCAB) for _ in range(100)]  # 7 blocks of prompt + growing decode
    with ready.client(timeout_s=30.0) as c:
        idle = wait_idle(c)
        assert _group(idle, "g0")["kv_blocks_used"] == 0
        tokens_before = idle["tokens_total"]

        # blocking client: break out of the iterator, close() sends Abort
        got = []
        with c.stream(prompt, greedy_params(1500)) as s:
            for d in s:
                got.append(d)
                if sum(len(x.token_ids) for x in got) >= 3:
                    break
            busy = c.stats()
            assert busy["requests"] == 1 and _group(busy, "g0")["kv_blocks_used"] > 0
        assert all(d.finish_reason is None for d in got)
        after = wait_idle(c, timeout=30)
        produced = after["tokens_total"] - tokens_before
        assert produced < 1000, f"the aborted request kept running ({produced} tokens)"

    # async client: leave `async for` with break, then aclose()
    async def leave_early(address):
        async with AsyncClient(address, timeout_s=30.0) as ac:
            stream = ac.stream(prompt[:50], greedy_params(1500))
            n = 0
            async for d in stream:
                n += len(d.token_ids)
                if n >= 2:
                    break
            live = (await ac.stats())["requests"]
            await stream.aclose()
            return live

    assert asyncio.run(leave_early(ready.address)) == 1
    with ready.client(timeout_s=30.0) as c:
        s = wait_idle(c, timeout=30)
        g0 = _group(s, "g0")
        assert g0["kv_blocks_free"] == g0["kv_blocks_total"] == KV_BLOCKS
        # the worker dropped the request too (its heartbeat stats; a second to refresh)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            w = _group(c.stats(), "g0")["workers"][0]
            if w.get("w_running", 0) == 0:
                break
            time.sleep(0.3)
        assert w.get("w_running", 0) == 0, f"the worker still holds requests: {w}"


# ------------------------------------------------------------------------------ 4. stop strings


def _pick_stop(text: str) -> tuple[str, int] | None:
    """A 2-3 character substring from the middle of `text` whose first occurrence is where we
    took it from, printable ASCII only (no U+FFFD halves of a multi-byte character)."""
    n = len(text)
    for width in (3, 2):
        for k in list(range(n // 3, 2 * n // 3)) + list(range(2, n // 3)):
            s = text[k:k + width]
            if len(s) == width and s.isascii() and s.isprintable() and text.find(s) == k:
                return s, k
    return None


@pytest.mark.timeout(300)
def test_stop_strings_end_the_text(ready):
    from zeroserve import SamplingParams

    prompts = ["Once upon a time", "The cluster says", "hello world", "zeroserve serves tokens", "abc"]
    with ready.client(timeout_s=30.0, request_timeout_s=120.0) as c:
        found = None
        for prompt in prompts:
            base = c.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)).outputs[0]
            pick = _pick_stop(base.text)
            if pick is not None:
                found = prompt, base, *pick
                break
        assert found is not None, "no greedy output with a printable substring to stop at"
        prompt, base, stop, k = found

        for include in (False, True):
            sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop, "\x00never\x00"],
                                include_stop_str_in_output=include)
            o = c.generate(prompt, sp).outputs[0]
            want = base.text[:k + len(stop)] if include else base.text[:k]
            assert o.text == want, f"stop={stop!r} include={include}: {o.text!r} != {want!r} (full {base.text!r})"
            assert o.finish_reason == "stop" and o.stop_reason == stop
            assert len(o.token_ids) < len(base.token_ids)
            assert o.token_ids == base.token_ids[:len(o.token_ids)], "stopped output is not a prefix of the full one"
            # streamed: the same text, the final delta says why
            deltas = list(c.stream(prompt, sp))
            assert "".join(d.text for d in deltas) == want
            assert [t for d in deltas for t in d.token_ids] == o.token_ids
            assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
            assert all(d.finish_reason is None for d in deltas[:-1])
        wait_idle(c, timeout=30)  # a stop-string finish frees the blocks too


# ------------------------------------------------------------------------------ 5. a late worker group


@pytest.mark.timeout(420)
def test_second_worker_group_started_mid_run_takes_requests(ready, cluster):
    """Runs last in the module: it adds group g1 to the shared cluster."""
    rng = random.Random(99)
    background_prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    results: list[tuple[list[int], list[int], str | None]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def background():
        try:
            with ready.client(timeout_s=30.0, request_timeout_s=120.0) as c:
                i = 0
                while not stop.is_set():
                    p = background_prompts[i % len(background_prompts)]
                    i += 1
                    deltas = list(c.stream(p, greedy_params(12)))
                    results.append((p, [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason))
        except BaseException as e:  # noqa: BLE001 (reported by the test thread)
            errors.append(e)

    t = threading.Thread(target=background, name="background-requests", daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        cluster.start_group("g1")  # main thread: PDEATHSIG is per forking thread
        s = cluster.wait_ready(groups=2, timeout=240)
        names = sorted(g["name"] for g in s["groups"] if g["state"] == "ready")
        assert names == ["g0", "g1"]
        before = _group(s, "g1")["steps"]

        # fresh prompts (no prefix cache hit anywhere), all at once: least-loaded routing
        # must give the idle new group some of them
        fresh = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 60))] for _ in range(8)]
        outs = run_streams(ready.address, [(p, greedy_params(10)) for p in fresh], timeout_s=180)
    finally:
        stop.set()
        t.join(timeout=120)
    assert not t.is_alive(), "the background requests did not finish"
    assert not errors, f"background requests failed: {errors[0]!r}"
    assert len(results) >= 2, "too few background requests ran while g1 joined"

    for p, o in zip(fresh, outs):
        assert o.finish_reason == "length" and o.tokens == hf_greedy(p, 10, ignore_eos=True)
    for p, toks, reason in results:
        assert reason == "length" and toks == hf_greedy(p, 12, ignore_eos=True)

    with ready.client(timeout_s=30.0) as c:
        deadline = time.monotonic() + 15
        while True:
            s = c.stats()
            g1 = _group(s, "g1")
            w = g1["workers"][0]
            if (g1["steps"] > before and w.get("w_steps", 0) > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    assert g1["state"] == "ready" and w["worker_id"] == "g1-r0"
    assert w["pid"] == cluster.children["g1-r0"].proc.pid
    assert g1["steps"] > before, f"g1 took no step after it joined: {g1}"
    assert w.get("w_steps", 0) > 0, f"g1's worker reports no step: {w}"
    assert _group(s, "g0")["state"] == "ready"
