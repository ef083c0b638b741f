"""The model's sampling defaults (generation_config.json, a GGUF's general.sampling.*) for the
fields a request leaves unset, as vLLM applies them: parsing, the merge, each path's notion of
"unset" (LLM, Client, the gateway's bodies), the wire field, and a real cluster + gateway."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from zeroserve.common import messages as P
from zeroserve.common.codec import ProtocolError, decode, encode
from zeroserve.common.errors import InvalidRequest, ModelLoadError
from zeroserve.common.model_config import ModelConfig, resolve_sampling_defaults
from zeroserve.common.sampling_params import (
    MODEL_DEFAULT_FIELDS,
    SamplingParams,
    check_defaults,
    defaults_from_generation_config,
    defaults_from_gguf,
    unset_fields,
    with_model_defaults,
)
from zeroserve.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from tests.cluster import no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import make_model_dir, torch_single_thread  # noqa: F401 (fixture)
from tests.scheduler_sim import CLIENT_ID, MODEL, make_cluster
from zeroserve import LLM
from zeroserve._request import _check_params, _model_defaults

GEN = {"temperature": 0.0, "max_new_tokens": 5, "top_k": 50, "top_p": 0.9, "do_sample": True, "bos_token_id": 1}
PROMPT = "hello world, this is"


# --------------------------------------------------------------------------- parsing and the merge
def test_generation_config_fields_become_defaults():
    d = defaults_from_generation_config(GEN)
    # max_new_tokens is our max_tokens; top_k 50 is transformers' own default, not the model's
    assert d == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
    assert defaults_from_generation_config({"top_k": 20, "repetition_penalty": 1.05, "min_p": 0.1}) == {
        "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.1}
    assert defaults_from_generation_config({"eos_token_id": 2, "temperature": None}) == {}
    assert check_defaults(d, "x") == d
    with pytest.raises(ModelLoadError, match=r"gen\.json: .*top_p must be in \(0, 1\].*--generation-config none"):
        check_defaults(defaults_from_generation_config({"top_p": 7}), "gen.json")
    with pytest.raises(ModelLoadError, match="temperature must be a finite number"):
        check_defaults(defaults_from_generation_config({"temperature": "hot"}), "x")


def test_gguf_sampling_metadata_become_defaults():
    meta = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": 0.95,
            "general.sampling.penalty_repeat": 1.1, "general.sampling.mirostat": 0, "general.name": "x"}
    assert defaults_from_gguf(meta) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1}
    with pytest.raises(ModelLoadError, match="m.gguf"):
        check_defaults(defaults_from_gguf({"general.sampling.top_k": -3}), "m.gguf")


def test_only_unset_fields_take_the_models_value():
    defaults = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 8}
    sp = SamplingParams(temperature=1.0, max_tokens=32)
    assert with_model_defaults(sp, [], defaults) is sp
    assert with_model_defaults(sp, ["top_k"], defaults) is sp  # the model does not set it
    out = with_model_defaults(sp, ["top_p", "max_tokens"], defaults)
    assert (out.temperature, out.top_p, out.max_tokens) == (1.0, 0.9, 8) and sp.top_p == 1.0
    # the caller's min_tokens outranks the model's max_tokens
    assert with_model_defaults(SamplingParams(min_tokens=12, max_tokens=None), ["max_tokens"], defaults).max_tokens == 12


def test_what_counts_as_unset_on_each_path():
    assert unset_fields(None) == MODEL_DEFAULT_FIELDS
    assert unset_fields({"temperature": 0, "max_tokens": 3}) == ("top_p", "top_k", "min_p", "repetition_penalty")
    assert unset_fields(SamplingParams()) == ()  # an object runs as given (vLLM)
    assert _model_defaults(SamplingParams(), True) == list(MODEL_DEFAULT_FIELDS)
    assert _model_defaults(None, False) == []
    assert _model_defaults(None, ["top_p", "top_p"]) == ["top_p"]
    with pytest.raises(InvalidRequest, match="model_defaults must be"):
        _model_defaults(None, ["seed"])
    # a dict's min_tokens over the placeholder max_tokens (16) is no error: max_tokens is unset
    assert _check_params({"min_tokens": 32}).max_tokens == 32
    # the gateway's bodies: what the JSON leaves out
    c = CompletionRequest(prompt="x", temperature=0.5)
    # completions keep OpenAI's max_tokens 16 when the body leaves it out; null takes the model's (vLLM)
    assert c.model_defaults() == ["top_p", "top_k", "min_p", "repetition_penalty"]
    assert c.sampling_params().max_tokens == 16
    assert CompletionRequest(prompt="x", max_tokens=None).model_defaults()[-1] == "max_tokens"
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4, top_k=3)
    assert chat.model_defaults() == ["temperature", "top_p", "min_p", "repetition_penalty"]


def test_the_wire_field_is_checked_on_decode():
    m = P.Submit(request_id="a", prompt="x", model_defaults=["temperature", "max_tokens"])
    assert decode(encode(m)).model_defaults == ["temperature", "max_tokens"]
    assert decode(encode(P.Submit(request_id="a", prompt="x"))).model_defaults == []
    bad = P.Submit(request_id="a", prompt="x", model_defaults=["temperature"])
    bad.model_defaults = ["seed"]
    with pytest.raises(ProtocolError, match=r"Submit\.model_defaults\[0\]"):
        decode(encode(bad))


# --------------------------------------------------------------------------- model directories
def test_model_dirs_and_the_generation_config_knob(tmp_path):
    d = make_model_dir(tmp_path / "m", "llama")
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, **GEN}))
    cfg = ModelConfig.from_dir(d)
    assert cfg.sampling_defaults == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
    assert resolve_sampling_defaults(cfg, "auto") == cfg.sampling_defaults
    assert resolve_sampling_defaults(cfg, "none") == resolve_sampling_defaults(cfg, "vllm") == {}
    with pytest.raises(ModelLoadError, match="must be auto, none or a file"):
        resolve_sampling_defaults(cfg, " ")
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 7}))
    assert resolve_sampling_defaults(cfg, str(other)) == {"top_k": 7}  # a directory holding one
    assert resolve_sampling_defaults(cfg, str(other / "generation_config.json")) == {"top_k": 7}
    with pytest.raises(ModelLoadError, match="no such file"):
        resolve_sampling_defaults(cfg, str(tmp_path / "missing.json"))
    # a bad value fails where the defaults are used, not the model's load (workers never read them)
    (d / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    cfg = ModelConfig.from_dir(d)
    with pytest.raises(ModelLoadError, match="generation_config.json.*top_p.*--generation-config none"):
        resolve_sampling_defaults(cfg, "auto")
    assert resolve_sampling_defaults(cfg, "none") == {}


def test_llm_without_params_uses_the_models_defaults(tmp_path, torch_single_thread):  # noqa: F811
    d = make_model_dir(tmp_path / "m", "llama")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **GEN}))
    llm = LLM(str(d), num_kv_blocks=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.0, 0.9, 5)
    out = llm.generate(PROMPT)[0].outputs[0]
    ref = llm.generate(PROMPT, SamplingParams(temperature=0.0, top_p=0.9, max_tokens=5))[0].outputs[0]
    assert out.token_ids == ref.token_ids and len(out.token_ids) <= 5
    given = llm.generate(PROMPT, SamplingParams(max_tokens=9, ignore_eos=True, seed=3))[0].outputs[0]
    assert len(given.token_ids) == 9  # a SamplingParams runs as given
    plain = LLM(str(d), num_kv_blocks=64, generation_config="none").get_default_sampling_params()
    assert plain == SamplingParams()


def test_the_scheduler_fills_only_what_a_submit_leaves_unset():
    c = make_cluster()
    c.models[MODEL].sampling_defaults = {"temperature": 0.0, "max_tokens": 5}
    ids = np.asarray([5, 6, 7], np.int32)
    c.on_submit(CLIENT_ID, P.Submit(request_id="a", prompt_token_ids=ids, params=SamplingParams(max_tokens=9),
                                    model_defaults=["temperature", "top_p"]), 100.0)
    c.on_submit(CLIENT_ID, P.Submit(request_id="b", prompt_token_ids=ids), 100.0)
    live = {x.request_id: x.params for x in c.live.values()}
    assert (live["a"].temperature, live["a"].max_tokens) == (0.0, 9)
    assert live["b"] == SamplingParams()  # nothing named: as sent


# --------------------------------------------------------------------------- a real cluster + gateway
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.test_gateway import cluster_with_gateway

    gen = tmp_path_factory.mktemp("gen") / "generation_config.json"
    gen.write_text(json.dumps(GEN))
    with cluster_with_gateway(["--generation-config", str(gen)]) as served:
        yield served


@pytest.mark.usefixtures("no_leftover_processes")
def test_cluster_and_gateway_apply_the_generation_config(served):
    c, url = served
    greedy5 = SamplingParams(temperature=0.0, top_p=0.9, max_tokens=5, ignore_eos=True)
    with c.client(timeout_s=60) as client:
        ref = client.generate(PROMPT, greedy5).outputs[0].token_ids
        by_default = client.generate(PROMPT, {"ignore_eos": True}).outputs[0].token_ids
        streamed = [t for d in client.stream(PROMPT, {"ignore_eos": True}) for t in d.token_ids]
        capped = client.generate(PROMPT, {"ignore_eos": True, "max_tokens": 3}).outputs[0].token_ids
        given = client.generate(PROMPT, SamplingParams(max_tokens=7, ignore_eos=True, seed=1)).outputs[0].token_ids
        forced = client.generate(PROMPT, SamplingParams(max_tokens=7, ignore_eos=True), model_defaults=True)
    assert len(ref) == 5 and by_default == ref and streamed == ref
    assert capped == ref[:3]
    assert len(given) == 7  # a SamplingParams object runs as given
    assert forced.outputs[0].token_ids == ref  # model_defaults=True: the model's over the object's

    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    model = oai.models.list().data[0].id
    r = oai.completions.create(model=model, prompt=PROMPT, logprobs=0, extra_body={
        "ignore_eos": True, "return_tokens_as_token_ids": True, "max_tokens": None})
    assert r.usage.completion_tokens == 5  # max_tokens null: the model's max_new_tokens
    assert [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens] == ref
    r = oai.completions.create(model=model, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16  # left out: OpenAI's 16, as vLLM; the model's temperature still
    assert r.choices[0].text == oai.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                                       top_p=0.9, extra_body={"ignore_eos": True}).choices[0].text
    chat_free = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert "max_tokens" in chat_free.model_defaults()  # chat has no default limit of its own
