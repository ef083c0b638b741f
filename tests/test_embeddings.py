"""Embeddings: prefill-only cluster requests whose answer is the pooled final hidden state,
checked against HF transformers' hidden states pooled the same way (fp32 tolerance), through
`LLM.embed` (in process), `Client` / `AsyncClient.embed` and `/v1/embeddings` with the `openai`
SDK, on one module cluster (the tiny random-weight llama, a small prefill budget so long prompts
are pooled over several chunks) with a gateway.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest
import torch

from tests.cluster import no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir, load_hf_model, torch_single_thread  # noqa: F401 (fixture)
from tests.test_gateway import cluster_with_gateway, sdk, wait_idle

pytestmark = pytest.mark.usefixtures("no_leftover_processes", "torch_single_thread")

CHUNK = 16  # --max-num-batched-tokens: a 40-token prompt is pooled over three steps
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 5, [3, 4, 5], [100, 7, 250, 33, 2, 9]]
TOL = 2e-5


@pytest.fixture(scope="module")
def hf():
    return load_hf_model(cached_model_dir("llama"))


def reference(hf, ids: list[int], pooling: str, normalize: bool = True) -> np.ndarray:
    """HF's last hidden state (after the final norm) pooled, L2-normalised as OpenAI's."""
    with torch.no_grad():
        h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double()
    v = h[-1] if pooling == "last" else h.mean(0)
    return (v / v.norm() if normalize else v).numpy()


@pytest.fixture(scope="module")
def env():
    with cluster_with_gateway(["--max-num-batched-tokens", str(CHUNK)], num_kv_blocks=64) as (c, url):
        yield c, sdk(url)


def test_llm_embed_equals_hf_pooled_states(hf):
    from zeroserve import LLM

    llm = LLM(str(cached_model_dir("llama")), num_kv_blocks=64, max_num_batched_tokens=CHUNK)
    for pooling in ("last", "mean"):
        for p, o in zip(PROMPTS, llm.embed(PROMPTS, pooling=pooling, normalize=False)):
            np.testing.assert_allclose(o.embedding, reference(hf, p, pooling, normalize=False), atol=TOL)
            assert o.prompt_token_ids == p
    (o,) = llm.embed(PROMPTS[0], pooling="mean")
    assert abs(np.linalg.norm(o.embedding) - 1) < 1e-5
    np.testing.assert_allclose(o.embedding, reference(hf, PROMPTS[0], "mean"), atol=TOL)
    assert llm.generate(PROMPTS[1])[0].outputs[0].token_ids  # the engine still generates after them


def test_the_cluster_pools_like_hf_and_keeps_no_kv(env, hf):
    c, _ = env
    with c.client(timeout_s=30.0) as client:
        for pooling in ("last", "mean"):
            for p, o in zip(PROMPTS, client.embed(PROMPTS, pooling=pooling)):
                np.testing.assert_allclose(o.embedding, reference(hf, p, pooling), atol=TOL)
        default = client.embed(PROMPTS[0])[0].embedding  # the tiny model has no sentence-transformers config
        np.testing.assert_allclose(default, reference(hf, PROMPTS[0], "last"), atol=TOL)
        assert client.generate(PROMPTS[1], {"max_tokens": 3}).outputs[0].token_ids
    s = wait_idle(c)  # the embeddings' blocks went back after their prefill
    assert s["groups"][0]["kv_blocks_used"] == 0

    async def concurrent():
        from zeroserve import AsyncClient

        async with AsyncClient(c.address, timeout_s=30.0) as ac:
            return await asyncio.gather(ac.embed(PROMPTS, pooling="mean"),
                                        ac.generate(PROMPTS[2], {"max_tokens": 8, "ignore_eos": True}))

    embs, gen = asyncio.run(concurrent())  # embeddings batch beside a generation
    assert len(gen.outputs[0].token_ids) == 8
    for p, o in zip(PROMPTS, embs):
        np.testing.assert_allclose(o.embedding, reference(hf, p, "mean"), atol=TOL)


def test_openai_sdk_floats_base64_and_dimensions(env, hf):
    _, oai = env
    model = oai.models.list().data[0].id
    floats = oai.embeddings.create(model=model, input=PROMPTS, encoding_format="float")
    assert floats.object == "list" and floats.model == model and [d.index for d in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens == sum(map(len, PROMPTS)) == floats.usage.total_tokens
    for p, d in zip(PROMPTS, floats.data):
        np.testing.assert_allclose(d.embedding, reference(hf, p, "last"), atol=TOL)
    # the SDK's default asks for base64 and decodes it itself; the raw body is float32 little-endian
    sdk_default = oai.embeddings.create(model=model, input=PROMPTS)
    assert [d.embedding for d in sdk_default.data] == [d.embedding for d in floats.data]
    raw = oai.post("/embeddings", cast_to=object, body={"model": model, "input": PROMPTS,
                                                        "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(raw["data"][1]["embedding"]), "<f4")
    np.testing.assert_array_equal(vec, np.asarray(floats.data[1].embedding, np.float32))
    # text: the scheduler's tokenization, as a chat prompt's; mean pooling by our extension
    text = oai.embeddings.create(model=model, input=["hello world", "hello"], encoding_format="float",
                                 extra_body={"pooling": "mean"})
    assert text.usage.prompt_tokens >= 3 and len(text.data) == 2
    assert abs(np.linalg.norm(text.data[0].embedding) - 1) < 1e-5
    # dimensions: the first k components, normalised again (OpenAI's truncation)
    short = oai.embeddings.create(model=model, input=PROMPTS[0], dimensions=8, encoding_format="float")
    ref = reference(hf, PROMPTS[0], "last", normalize=False)[:8]
    np.testing.assert_allclose(short.data[0].embedding, ref / np.linalg.norm(ref), atol=TOL)


def test_bad_embedding_requests_are_400s_naming_the_field(env):
    _, oai = env
    model = oai.models.list().data[0].id
    bad = [({"input": []}, "input"), ({"input": [""]}, r"input\[0\]"), ({"input": "x", "dimensions": 100000},
                                                                       "dimensions"),
           ({"input": "x", "dimensions": 0}, "dimensions"), ({"input": "x", "encoding_format": "int8"},
                                                             "encoding_format"),
           ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
           ({"input": "x", "pooling": "max"}, "pooling"), ({"input": [[1, 2, 10 ** 9]]}, "prompt token ids")]
    for body, field in bad:
        with pytest.raises(openai.BadRequestError, match=field):
            oai.post("/embeddings", cast_to=object, body={"model": model, **body})
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="nope", input="x")


def test_pooling_per_model_and_the_vector_finish(tmp_path):
    from zeroserve.common.embeddings import finish_embedding, model_pooling
    from zeroserve.common.errors import InvalidRequest

    assert model_pooling(tmp_path) == "last"  # decoder-only embedding models pool the last token
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    assert model_pooling(tmp_path) == "mean" and model_pooling(tmp_path, "last") == "last"
    with pytest.raises(InvalidRequest, match="pooling"):
        model_pooling(tmp_path, "max")
    v = finish_embedding([3.0, 4.0, 12.0], dimensions=2)
    np.testing.assert_allclose(v, [0.6, 0.8])
    np.testing.assert_array_equal(finish_embedding([3.0, 4.0], normalize=False), [3.0, 4.0])
    assert finish_embedding([0.0, 0.0]).tolist() == [0.0, 0.0]  # nothing to normalise
    for bad in (0, 4, True, 2.5):
        with pytest.raises(InvalidRequest, match="dimensions"):
            finish_embedding([1.0, 2.0, 3.0], dimensions=bad)


def test_the_worker_pooler_sums_chunks_and_restarts_a_resent_request():
    """Mean pooling over prefill chunks; a request the scheduler preempted comes back as new and
    recomputes from position 0, so its sum starts again (services/worker/pooling.py)."""
    from zeroserve.common.messages import NewRequest, Step, StepResult
    from zeroserve.services.worker.pooling import Pooler

    pl = Pooler()
    new = NewRequest(req_id="a", token_ids=np.arange(6, dtype=np.int32), num_prompt_tokens=6, pooling="mean")
    h = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    none = np.zeros(0, np.int64)

    def step(rows, sample):
        out = StepResult(seq=1, req_ids=["a"], sampled_token_ids=np.asarray([-1], np.int32))
        left = pl.pool(out, ["a"], rows, np.asarray([0, rows.shape[0]]), np.asarray(sample, np.int64))
        return out, left

    pl.apply(Step(seq=1, new_reqs=[new]))
    out, _ = step(h[:4], none)
    assert out.embed_req_ids == [] and out.embeddings is None
    pl.apply(Step(seq=2, finished_req_ids=["a"]))  # preempted ...
    pl.apply(Step(seq=3, new_reqs=[new]))  # ... and sent again from the start
    step(h[:3], none)
    out, left = step(h[3:], [0])
    assert left.tolist() == [] and out.embed_req_ids == ["a"]  # it samples nothing
    np.testing.assert_allclose(out.embeddings[0], h.mean(0).numpy())
