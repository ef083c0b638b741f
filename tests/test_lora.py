"""LoRA adapters in process (LLM): greedy output of each adapter equals HF transformers + PEFT on
the same base and adapter (fp32), alone and in batches that mix adapters and the base model; the
adapter is checked against the model with an error naming what does not fit; slots are reused
least recently used first; the prefix cache never shares blocks across adapters."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import cached_model_dir, random_prompt, torch_single_thread  # noqa: F401
from tests.lora_ref import make_adapter, peft_greedy
from zeroserve import LLM, SamplingParams
from zeroserve.common.errors import InvalidRequest

pytestmark = pytest.mark.usefixtures("torch_single_thread")
N = 10


@pytest.fixture(scope="module")
def base():
    return cached_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {
        "a1": make_adapter(root / "a1", base, rank=8, alpha=16, seed=1),
        "a2": make_adapter(root / "a2", base, rank=4, alpha=8, seed=2, targets=["q_proj", "v_proj", "down_proj"]),
        "a3": make_adapter(root / "a3", base, rank=16, alpha=4, seed=3, use_rslora=True),
        "a4": make_adapter(root / "a4", base, rank=2, alpha=2, seed=4, targets=["o_proj", "gate_proj", "up_proj"]),
    }


def _params():
    return SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_mixed_batch_equals_peft(base, adapters, backend):
    """Four adapters and the base model, several requests each, in one engine: every request's
    greedy tokens equal HF + PEFT's for its own adapter."""
    llm = LLM(str(base), lora_modules=[f"{k}={v}" for k, v in adapters.items()], attention_backend=backend,
              max_loras=4, num_kv_blocks=256)
    names = [None, "a1", "a2", "a3", "a4"] * 2
    prompts = [random_prompt(5 + 3 * i, seed=i) for i in range(len(names))]
    outs = llm.generate(prompts, _params(), lora=names)
    for p, name, o in zip(prompts, names, outs):
        ref = peft_greedy(base, adapters[name] if name else None, p, N)
        assert o.outputs[0].token_ids == ref, (name, p)
    # the deltas matter: each adapter's output differs from the base model's somewhere
    base_out = {tuple(p): o.outputs[0].token_ids for p, n, o in zip(prompts, names, outs) if n is None}
    for name in ("a1", "a2", "a3", "a4"):
        alone = llm.generate(prompts[:1], _params(), lora=name)[0].outputs[0].token_ids
        assert alone == peft_greedy(base, adapters[name], prompts[0], N)
        assert alone != base_out[tuple(prompts[0])], name


def test_alone_equals_in_batch_and_model_name_picks_adapter(base, adapters):
    """A request alone equals itself in a mixed batch; params.model = the adapter's name (vLLM's
    HTTP convention) is the same as lora = name."""
    llm = LLM(str(base), lora_modules=[f"a1={adapters['a1']}", f"a3={adapters['a3']}"], max_loras=2,
              num_kv_blocks=256)
    p = random_prompt(12, seed=40)
    alone = llm.generate([p], _params(), lora="a3")[0].outputs[0].token_ids
    mixed = llm.generate([random_prompt(7, seed=41), p, random_prompt(9, seed=42)], _params(),
                         lora=["a1", "a3", None])
    assert mixed[1].outputs[0].token_ids == alone == peft_greedy(base, adapters["a3"], p, N)
    by_model = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, model="a3"))
    assert by_model[0].outputs[0].token_ids == alone


def test_lru_slots_and_runtime_load(base, adapters):
    """One slot, three adapters loaded at run time: each request gets its own adapter's output as
    the slot is reloaded (least recently used out), and an unloaded adapter is refused."""
    llm = LLM(str(base), enable_lora=True, max_loras=1, num_kv_blocks=256)
    for name in ("a1", "a2", "a4"):
        llm.load_lora_adapter(name, str(adapters[name]))
    p = random_prompt(10, seed=50)
    for name in ("a1", "a2", "a1", "a4"):
        got = llm.generate([p], _params(), lora=name)[0].outputs[0].token_ids
        assert got == peft_greedy(base, adapters[name], p, N), name
        assert llm.engine.runner.lora.resident() == [name]  # the one slot holds the last one used
    # two adapters in one batch with one slot: the policy runs them one after the other
    both = llm.generate([p, p], _params(), lora=["a2", "a4"])
    assert [o.outputs[0].token_ids for o in both] == [peft_greedy(base, adapters[n], p, N) for n in ("a2", "a4")]
    llm.unload_lora_adapter("a2")
    with pytest.raises(InvalidRequest, match="'a2' is not served"):
        llm.generate([p], _params(), lora="a2")


def test_prefix_cache_keeps_adapters_apart(base, adapters):
    """The same long prompt under the base model, then an adapter: the adapter's request gets no
    cached blocks from the base model's (its K/V differ) and still equals PEFT's output."""
    llm = LLM(str(base), lora_modules=[f"a1={adapters['a1']}"], num_kv_blocks=256)
    p = random_prompt(70, seed=60)
    first = llm.generate([p], _params())[0]
    again = llm.generate([p], _params())[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    with_a1 = llm.generate([p], _params(), lora="a1")[0]
    assert with_a1.num_cached_tokens == 0
    assert with_a1.outputs[0].token_ids == peft_greedy(base, adapters["a1"], p, N)
    assert llm.generate([p], _params(), lora="a1")[0].num_cached_tokens > 0  # its own blocks are reused


def test_adapter_that_does_not_fit_is_named(base, adapters, tmp_path):
    """Rank above --max-lora-rank, a shape of another model, an unsupported target: each refused
    with a message naming it."""
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    with pytest.raises(InvalidRequest, match="rank 16 is above --max-lora-rank 8"):
        llm.load_lora_adapter("big", str(adapters["a3"]))
    other = make_adapter(tmp_path / "other", base, rank=4, seed=7, targets=["q_proj"])
    w = load_file(other / "adapter_model.safetensors")  # as if made for a model with a wider q_proj
    key = next(k for k in w if k.endswith("q_proj.lora_B.weight"))
    w[key] = torch.zeros(w[key].shape[0] + 8, 4)
    save_file(w, other / "adapter_model.safetensors")
    with pytest.raises(InvalidRequest, match=r"layer \d+ q_proj: lora_A .* do not fit the base model"):
        llm.load_lora_adapter("other", str(other))
    cfg = json.loads((other / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "lm_head"]
    (other / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidRequest, match=r"target_modules \['lm_head'\] are not supported"):
        llm.load_lora_adapter("other", str(other))
    with pytest.raises(InvalidRequest, match="no adapter_config.json"):
        llm.load_lora_adapter("missing", str(tmp_path / "nowhere"))


def test_speculative_decoding_with_lora_is_refused(base):
    with pytest.raises(InvalidRequest, match="speculative decoding is not supported with LoRA"):
        LLM(str(base), enable_lora=True, speculative_method="ngram")


def test_packed_gguf_base(base, adapters, tmp_path):
    """A Q8_0 GGUF base (packed weights, the compiled kernels) with adapters: each adapter's output
    equals the same adapter on that GGUF dequantized to fp32 (whose float path equals PEFT's,
    above), and the base rows of a mixed batch equal the base model alone (they leave the compiled
    decode step for the layer-by-layer path, whose hidden states are the same bits)."""
    from tests.gguf_export import export_hf_dir

    gguf = export_hf_dir(base, tmp_path / "llama-q8_0.gguf", "Q8_0")
    mods = [f"{k}={adapters[k]}" for k in ("a1", "a3")]
    packed = LLM(str(gguf), lora_modules=mods, num_kv_blocks=256)
    assert packed.engine.runner.model.quant_summary().get("q8_0", 0) > 0
    floats = LLM(str(gguf), lora_modules=mods, quantization="none", num_kv_blocks=256)
    prompts = [random_prompt(6 + 4 * i, seed=70 + i) for i in range(6)]
    names = ["a1", None, "a3", "a1", None, "a3"]
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, _params(), lora=names)]
    want = [o.outputs[0].token_ids for o in floats.generate(prompts, _params(), lora=names)]
    assert got == want
    base_alone = [o.outputs[0].token_ids for o in packed.generate([prompts[1], prompts[4]], _params())]
    assert base_alone == [got[1], got[4]]
    assert got[0] != packed.generate([prompts[0]], _params())[0].outputs[0].token_ids  # the delta applies


def test_gguf_adapter_on_gguf_base(base, adapters, tmp_path):
    """llama.cpp's adapter GGUF (B's q/k rows permuted as its converter does for llama) on a GGUF
    base: the same tokens as the PEFT adapter it was made from, which equal HF + PEFT's."""
    from tests.gguf_export import export_hf_dir
    from tests.lora_ref import peft_to_gguf

    cfg = json.loads((base / "config.json").read_text())
    gguf_base = export_hf_dir(base, tmp_path / "llama-f32.gguf", "F32")
    a1 = peft_to_gguf(adapters["a1"], tmp_path / "a1.gguf", "llama", cfg["num_attention_heads"],
                      cfg["num_key_value_heads"], "F16")
    llm = LLM(str(gguf_base), lora_modules=[f"g1={a1}", f"p1={adapters['a1']}"], num_kv_blocks=256)
    prompts = [random_prompt(8 + 5 * i, seed=80 + i) for i in range(3)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _params(), lora="g1")]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, _params(), lora="p1")]
    assert got == want  # F16 A and B: the same greedy tokens as the fp32 PEFT file
    assert got[0] == peft_greedy(base, adapters["a1"], prompts[0], N)
    with pytest.raises(InvalidRequest, match="not a LoRA adapter GGUF"):
        llm.load_lora_adapter("base-as-adapter", str(gguf_base))


def test_no_adapters_without_enable_lora(base, adapters):
    llm = LLM(str(base), num_kv_blocks=64)
    with pytest.raises(InvalidRequest, match="serves no LoRA adapters"):
        llm.load_lora_adapter("a1", str(adapters["a1"]))
    with pytest.raises(InvalidRequest, match="'a1' is not served"):
        llm.generate([[5, 6, 7]], _params(), lora="a1")


def test_bf16_mode(base, adapters):
    """The bf16 numeric mode (every base linear in the bf16 regime; the adapter deltas stay on the
    fp32 per-row kernel, csrc/lora.c): each adapter's first token equals the fp32 run's where
    fp32's top two are far apart, each request's tokens are the same alone as in the mixed batch
    (batch-invariant), and the adapters still change the output."""
    mods = [f"{k}={adapters[k]}" for k in ("a1", "a3")]
    prompts = [random_prompt(10 + i, seed=90 + i) for i in range(6)]
    names = ["a1", "a3", None] * 2
    fp32 = LLM(str(base), lora_modules=mods, num_kv_blocks=128).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=2), lora=names)
    bf = LLM(str(base), lora_modules=mods, dtype="bfloat16", num_kv_blocks=128)
    assert bf.engine.runner.numeric_mode.startswith("bfloat16/")
    assert bf.engine.runner.lora.linears[(0, "q_proj")].at.dtype == torch.float32
    got = bf.generate(prompts, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True), lora=names)
    for p, name, g in zip(prompts, names, got):
        alone = bf.generate([p], SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True), lora=name)
        assert alone[0].outputs[0].token_ids == g.outputs[0].token_ids, name
    clear = 0
    for f, g in zip(fp32, got):
        top = sorted((lp.logprob for lp in f.outputs[0].logprobs[0].values()), reverse=True)
        if top[0] - top[1] > 0.5:
            assert g.outputs[0].token_ids[0] == f.outputs[0].token_ids[0]
            clear += 1
    assert clear >= 2
    base_out = bf.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in base_out] != [o.outputs[0].token_ids for o in got[:2]]


def test_slots_are_pinned_while_requests_hold_them(base, adapters):
    """A slot held by a live request is never evicted; with every slot held, another adapter is
    refused naming --max-loras; a request sent again in full (resync) does not leak its pin."""
    from zeroserve.common.messages import NewRequest, Step

    llm = LLM(str(base), enable_lora=True, max_loras=1, num_kv_blocks=64)
    runner, lora = llm.engine.runner, llm.engine.runner.lora

    def new(rid, name):
        return NewRequest(req_id=rid, token_ids=[5, 6, 7], num_prompt_tokens=3, block_ids=[0],
                          params=SamplingParams(lora=name), lora_path=str(adapters[name]), num_scheduled_tokens=3)

    runner.apply_state(Step(seq=1, new_reqs=[new("r1", "a1")]))
    assert lora.pins == [1]
    runner.apply_state(Step(seq=2, new_reqs=[new("r1", "a1")]))  # the same request again: still one pin
    assert lora.pins == [1]
    with pytest.raises(InvalidRequest, match=r"all 1 adapter slots \(--max-loras\) are held"):
        runner.apply_state(Step(seq=3, new_reqs=[new("r2", "a2")]))
    assert "r2" not in runner.reqs and lora.resident() == ["a1"]
    runner.apply_state(Step(seq=4, finished_req_ids=["r1"], new_reqs=[new("r2", "a2")]))
    assert lora.pins == [1] and lora.resident() == ["a2"]
