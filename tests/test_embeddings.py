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
