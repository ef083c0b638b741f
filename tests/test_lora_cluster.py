"""LoRA adapters through a real cluster (scheduler, detokenizer, two worker groups) and the HTTP
gateway: each request's greedy tokens equal HF transformers + PEFT for its adapter, in a batch
that mixes adapters and the base model; `model` = an adapter's name picks it (vLLM's HTTP
convention); /v1/models lists adapters with their parent; /v1/load_lora_adapter and
/v1/unload_lora_adapter work behind the API key, and an adapter that does not fit is a 400
naming why; a request whose group dies finishes on the other group with its adapter.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.cluster import LocalCluster, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import TIE_MARGIN, cached_model_dir, greedy_margin, random_prompt, torch_single_thread  # noqa: F401
from tests.lora_ref import make_adapter, peft_greedy
from tests.test_gateway import start_gateway, wait_http
from zeroserve import AsyncClient, SamplingParams
from zeroserve.common.errors import InvalidRequest

pytestmark = pytest.mark.usefixtures("no_leftover_processes", "torch_single_thread")
API_KEY = "sk-lora-test"
N = 10


def _params(n: int = N) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = cached_model_dir("llama")
    root = tmp_path_factory.mktemp("loras")
    adapters = {"a1": make_adapter(root / "a1", base, rank=8, seed=1),
                "a2": make_adapter(root / "a2", base, rank=4, seed=2, targets=["q_proj", "v_proj", "down_proj"]),
                "a3": make_adapter(root / "a3", base, rank=16, alpha=4, seed=3, use_rslora=True),
                "wide": make_adapter(root / "wide", base, rank=32, seed=4, targets=["q_proj"])}
    lora = ["--max-loras", "2", "--max-lora-rank", "16"]
    c = LocalCluster(base, workers=2, num_kv_blocks=256,
                     scheduler_args=["--lora-modules", f"a1={adapters['a1']}", "--lora-modules",
                                     f"a2={adapters['a2']}", *lora],
                     worker_args=["--enable-lora", *lora])
    try:
        c.start()
        url = start_gateway(c, "gateway", "--api-key", API_KEY, "--model", str(base))
        c.wait_ready(timeout=180)
        wait_http(url, c, "gateway")
        yield c, url, base, adapters
    finally:
        c.stop()


def test_client_mixed_adapters_equal_peft(env):
    c, _, base, adapters = env
    jobs = [(random_prompt(6 + 2 * i, seed=100 + i), name) for i, name in enumerate([None, "a1", "a2", "a1", None,
                                                                                      "a2"])]

    async def run():
        async with AsyncClient(c.address, timeout_s=30.0) as ac:
            outs = await asyncio.gather(*(ac.generate(p, _params(), lora=name) for p, name in jobs))
            by_model = await ac.generate(jobs[1][0], SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True,
                                                                    model="a1"))
            with pytest.raises(InvalidRequest, match="'nope' is not served"):
                await ac.generate(jobs[0][0], _params(), lora="nope")
            return outs, by_model

    outs, by_model = asyncio.run(run())
    for (p, name), o in zip(jobs, outs):
        assert o.outputs[0].token_ids == peft_greedy(base, adapters[name] if name else None, p, N), name
    assert by_model.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_gateway_models_completions_and_runtime_adapters(env):
    c, url, base, adapters = env
    h = {"Authorization": f"Bearer {API_KEY}"}
    models = httpx.get(url + "/v1/models", headers=h, timeout=30).json()["data"]
    parent = next(m["id"] for m in models if m["parent"] is None)
    assert {(m["id"], m["parent"]) for m in models} >= {("a1", parent), ("a2", parent)}
    p = random_prompt(9, seed=120)
    body = {"model": "a1", "prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    text = httpx.post(url + "/v1/completions", json=body, headers=h, timeout=60).json()["choices"][0]["text"]
    with c.client(timeout_s=30.0) as cl:
        want = cl.generate(p, _params(), lora="a1").outputs[0]
        assert want.token_ids == peft_greedy(base, adapters["a1"], p, N)
        assert text == want.text

        # at run time: behind the API key, loaded, served by model name, refused when it does not fit, unloaded
        load = {"lora_name": "a3", "lora_path": str(adapters["a3"])}
        assert httpx.post(url + "/v1/load_lora_adapter", json=load, timeout=30).status_code == 401
        r = httpx.post(url + "/v1/load_lora_adapter", json=load, headers=h, timeout=30)
        assert r.status_code == 200, r.text
        assert "a3" in {m["id"] for m in httpx.get(url + "/v1/models", headers=h, timeout=30).json()["data"]}
        body["model"] = "a3"
        text3 = httpx.post(url + "/v1/completions", json=body, headers=h, timeout=60).json()["choices"][0]["text"]
        out3 = cl.generate(p, _params(), lora="a3").outputs[0]
        assert out3.token_ids == peft_greedy(base, adapters["a3"], p, N) and text3 == out3.text
        bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(adapters["wide"])},
                         headers=h, timeout=30)
        assert bad.status_code == 400 and "rank 32 is above --max-lora-rank 16" in bad.text
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=h,
                          timeout=30).status_code == 200
        gone = httpx.post(url + "/v1/completions", json=body, headers=h, timeout=30)
        assert gone.status_code == 404, gone.text
        with pytest.raises(InvalidRequest, match="'a3' is not loaded"):
            cl.unload_lora_adapter("a3")


def test_failover_keeps_the_adapter(env):
    """Two long adapter requests (one per group, the least loaded takes each); the first group's
    worker is killed once both stream: both finish, on the other group, with their adapter's tokens."""
    c, _, base, adapters = env
    from zeroserve import LLM

    ref_llm = LLM(str(base), lora_modules=[f"a1={adapters['a1']}", f"a2={adapters['a2']}"], num_kv_blocks=256)
    jobs, seed = [], 200
    while len(jobs) < 2:  # greedy runs of other batching must agree: no near-ties along the way
        p = random_prompt(12, seed=seed)
        name = ("a1", "a2")[len(jobs)]
        o = ref_llm.generate([p], SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True, logprobs=2),
                             lora=name)[0].outputs[0]
        if greedy_margin(o) >= TIE_MARGIN:
            jobs.append((p, name, o.token_ids))
        seed += 1

    async def run():
        got = [[], []]
        started = [asyncio.Event(), asyncio.Event()]

        async def one(i, ac):
            p, name, _ = jobs[i]
            async for d in ac.stream(p, SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True), lora=name):
                got[i] += d.token_ids
                started[i].set()

        async with AsyncClient(c.address, timeout_s=30.0) as ac:
            tasks = [asyncio.create_task(one(i, ac)) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            c.kill("g0-r0")
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return got

    got = asyncio.run(run())
    for (_, _, ref), toks in zip(jobs, got):
        assert toks == ref
    with c.client(timeout_s=10.0) as cl:  # at least one of them really moved
        requeued = [line for line in cl.metrics().splitlines() if line.startswith("zeroserve:requests_requeued_total")]
    assert requeued and float(requeued[0].split()[-1]) >= 1, requeued


def test_tp2_group_serves_adapters(tmp_path):
    """One tensor-parallel group (2 shards, A and B sharded like the base weights): adapter and
    base requests in one batch give HF + PEFT's tokens."""
    base = cached_model_dir("llama")
    adapters = {"t1": make_adapter(tmp_path / "t1", base, rank=8, seed=21),
                "t2": make_adapter(tmp_path / "t2", base, rank=4, seed=22, targets=["k_proj", "o_proj", "up_proj"])}
    c = LocalCluster(base, workers=1, tp=2, num_kv_blocks=128,
                     scheduler_args=[a for n, p in adapters.items() for a in ("--lora-modules", f"{n}={p}")],
                     worker_args=["--enable-lora", "--max-loras", "2"])
    jobs = [(random_prompt(7 + 3 * i, seed=300 + i), name) for i, name in enumerate(["t1", None, "t2", "t1"])]
    with c.running(groups=1):

        async def run():
            async with AsyncClient(c.address, timeout_s=30.0) as ac:
                return await asyncio.gather(*(ac.generate(p, _params(), lora=n) for p, n in jobs))

        outs = asyncio.run(run())
    for (p, name), o in zip(jobs, outs):
        assert o.outputs[0].token_ids == peft_greedy(base, adapters[name] if name else None, p, N), name
