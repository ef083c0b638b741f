"""Our model code + safetensors loader vs Hugging Face transformers (fp32, CPU, torch ops).

The reference for every check is one full causal forward of HF's AutoModelForCausalLM (eager
attention) over the whole token sequence; our side runs the real serving path: a paged KV
cache (block size 16, block ids handed out in reverse, so no table is contiguous), prefill,
chunked prefill and single-token decode steps, and flat batches mixing requests.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.model_config import ModelConfig
from zeroserve.services.worker.dtype import resolve_dtype
from zeroserve.common.tokenizer import load_tokenizer
from zeroserve.kernels.dispatch import get_ops
from zeroserve.kernels import cpu_native
from zeroserve.services.worker.model import build_model, load_model
from zeroserve.services.worker.model.layers import rope_inv_freq
from tests.helpers import (  # noqa: F401 (torch_single_thread is a fixture)
    PagedKV,
    cached_model_dir,
    hf_logits,
    load_hf_model,
    load_our_model,
    make_model_dir,
    random_prompt,
    run_step,
    torch_single_thread,
)

ATOL = 2e-4  # fp32 logits have std ~8 here; observed max |diff| ~5e-5
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _greedy_decode(model, kv, rid, prompt, steps):
    """Prefill `prompt` then `steps` greedy decode steps; -> (tokens, logits rows for every position)."""
    rows = [run_step(model, kv, [(rid, prompt)], all_rows=True)]
    toks = list(prompt)
    for _ in range(steps):
        nxt = int(rows[-1][-1].argmax())
        toks.append(nxt)
        rows.append(run_step(model, kv, [(rid, [nxt])]))
    return toks, torch.cat(rows)


def _check_against_hf(model_dir, prompt_len=21, steps=6, seed=1):
    cfg, ours = load_our_model(model_dir)
    hf = load_hf_model(model_dir)
    kv = PagedKV(ours, num_blocks=16)
    prompt = random_prompt(prompt_len, cfg.vocab_size, seed=seed)
    toks, got = _greedy_decode(ours, kv, "r", prompt, steps)
    ref = hf_logits(hf, toks)
    assert got.dtype == torch.float32 and got.shape == (len(toks), cfg.vocab_size)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    # greedy tokens agree with HF's argmax at every decode step
    assert toks[prompt_len:] == ref[prompt_len - 1:-1].argmax(-1).tolist()
    return toks


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True),
                                       ("qwen3", False), ("qwen3", True)])
def test_prefill_and_decode_match_hf(arch, tied):
    d = cached_model_dir(arch, tie_word_embeddings=tied)
    toks = _check_against_hf(d, prompt_len=21, steps=6)  # crosses the 16-token block boundary
    assert len(set(toks[21:])) > 1  # the tiny model does not just repeat one token


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_bias_matches_hf(arch):
    """Llama/Qwen3 `attention_bias=true` puts a bias on q, k, v *and* o_proj."""
    d = cached_model_dir(arch, attention_bias=True)
    cfg = ModelConfig.from_dir(d)
    assert cfg.attention_bias and cfg.o_proj_bias
    _check_against_hf(d, prompt_len=9, steps=2)


def test_mistral_architecture_runs_llama_code():
    d = cached_model_dir("mistral")
    assert ModelConfig.from_dir(d).architecture == "MistralForCausalLM"
    _check_against_hf(d, prompt_len=9, steps=3)


def test_llama3_rope_scaling_matches_hf():
    d = cached_model_dir("llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)
    cfg = ModelConfig.from_dir(d)
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    # positions well past original_max_position_embeddings (32)
    _check_against_hf(d, prompt_len=70, steps=4)


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for head_dim, orig in ((16, 32), (64, 8192), (128, 8192)):
        rope = dict(LLAMA3_ROPE, original_max_position_embeddings=orig, rope_theta=500000.0)
        hf_cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                             rope_parameters=rope)
        ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
        got = rope_inv_freq(head_dim, 500000.0, dict(LLAMA3_ROPE, original_max_position_embeddings=orig))
        torch.testing.assert_close(got, ref.float(), atol=0, rtol=1e-6)


def test_mixed_flat_batch_matches_hf():
    """One forward holding: a decode token (A), a fresh prefill (B), a prefill chunk that
    continues earlier cached tokens (C, chunked prefill) -- each matches HF on its own."""
    d = cached_model_dir("qwen2")
    cfg, ours = load_our_model(d)
    hf = load_hf_model(d)
    kv = PagedKV(ours, num_blocks=24, order="random")
    pa, pb, pc = (random_prompt(n, cfg.vocab_size, seed=s) for n, s in ((18, 11), (13, 12), (30, 13)))
    la = run_step(ours, kv, [("A", pa), ("C", pc[:17])])  # first step: prefill A + first chunk of C
    tok_a = int(la[0].argmax())
    got = run_step(ours, kv, [("A", [tok_a]), ("B", pb), ("C", pc[17:])], all_rows=True)
    assert got.shape[0] == 1 + len(pb) + len(pc) - 17
    ref_a = hf_logits(hf, pa + [tok_a])
    ref_b = hf_logits(hf, pb)
    ref_c = hf_logits(hf, pc)
    torch.testing.assert_close(la[0], ref_a[len(pa) - 1], atol=ATOL, rtol=0)
    torch.testing.assert_close(la[1], ref_c[16], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[0], ref_a[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1:1 + len(pb)], ref_b, atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1 + len(pb):], ref_c[17:], atol=ATOL, rtol=0)


def test_decode_batch_of_many_requests():
    """Several decode streams advance together in one batch and each equals its solo run."""
    d = cached_model_dir("qwen3", tie_word_embeddings=True)
    cfg, ours = load_our_model(d)
    hf = load_hf_model(d)
    kv = PagedKV(ours, num_blocks=32)
    prompts = {f"r{i}": random_prompt(5 + 4 * i, cfg.vocab_size, seed=20 + i) for i in range(4)}
    logits = run_step(ours, kv, list(prompts.items()))
    toks = {r: list(p) for r, p in prompts.items()}
    for _ in range(5):
        nxt = logits.argmax(-1).tolist()
        for r, t in zip(toks, nxt):
            toks[r].append(t)
        logits = run_step(ours, kv, [(r, [t]) for r, t in zip(toks, nxt)])
    for r, t in toks.items():
        ref = hf_logits(hf, t)
        assert t[len(prompts[r]):] == ref[len(prompts[r]) - 1:-1].argmax(-1).tolist()


def test_sharded_checkpoint_loads_same_weights(tmp_path):
    single = cached_model_dir("llama", seed=3)
    sharded = make_model_dir(tmp_path / "sharded", "llama", seed=3, shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*-of-00003.safetensors"))) == 3
    _, a = load_our_model(single)
    _, b = load_our_model(sharded)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    _check_against_hf(sharded, prompt_len=10, steps=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_smoke(dtype):
    d = cached_model_dir("qwen2")
    cfg, ours = load_our_model(d, dtype=dtype)
    assert all(p.dtype == dtype for p in ours.parameters())
    kv = PagedKV(ours, num_blocks=8)
    assert kv.caches[0][0].dtype == dtype
    prompt = random_prompt(12, cfg.vocab_size, seed=5)
    toks, logits = _greedy_decode(ours, kv, "r", prompt, 4)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # close to fp32 in the large (bf16 rounding makes exact greedy agreement unlikely)
    _, ref_model = load_our_model(d)
    ref = run_step(ref_model, PagedKV(ref_model, 8), [("r", toks)], all_rows=True)
    err = (logits - ref).abs().max().item() / ref.abs().max().item()
    assert err < 0.1, err


def test_random_init_build_model_is_deterministic():
    cfg = ModelConfig.from_dir(cached_model_dir("qwen3"))
    ops = get_ops("torch", "cpu")
    a = build_model(cfg, "cpu", torch.float32, ops, init="random", seed=7)
    b = build_model(cfg, "cpu", torch.float32, ops, init="random", seed=7)
    c = build_model(cfg, "cpu", torch.float32, ops, init="random", seed=8)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["layers.0.self_attn.qkv_proj.weight"], pc["layers.0.self_attn.qkv_proj.weight"])
    assert torch.equal(pa["norm.weight"], torch.ones_like(pa["norm.weight"]))
    kv = PagedKV(a, 4)
    out = run_step(a, kv, [("r", [5, 6, 7])])
    assert out.shape == (1, cfg.vocab_size) and torch.isfinite(out).all()
    # build_model needs no weight files: a dir with only config.json is enough
    assert a.num_layers == cfg.num_layers and a.num_kv_heads == cfg.num_kv_heads and a.head_dim == cfg.head_dim


def test_config_only_dir_for_random_init(tmp_path):
    src = cached_model_dir("llama")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        ModelConfig.from_dir(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path, require_weights=False)
    build_model(cfg, "cpu", torch.float32, get_ops("torch", "cpu"))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(cfg, "cpu", torch.float32, get_ops("torch", "cpu"))


def test_fused_qkv_and_gate_up_are_single_matmuls():
    _, m = load_our_model(cached_model_dir("qwen2"))
    names = {n for n, _ in m.named_parameters()}
    assert "layers.0.self_attn.qkv_proj.weight" in names and "layers.0.self_attn.qkv_proj.bias" in names
    assert "layers.0.mlp.gate_up_proj.weight" in names
    assert not any(("q_proj" in n or "gate_proj" in n) for n in names)
    cfg = m.cfg
    assert m.layers[0].self_attn.qkv_proj.weight.shape == (
        (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)
    # tied: no separate lm_head parameter, logits use the embedding
    _, t = load_our_model(cached_model_dir("qwen3", tie_word_embeddings=True))
    assert "lm_head.weight" not in dict(t.named_parameters())
    assert t.lm_head.get_weight() is t.embed_tokens.weight


# --------------------------------------------------------------------------- config parsing
def _write_cfg(tmp_path, **changes):
    d = tmp_path / "m"
    shutil.copytree(cached_model_dir("llama"), d)
    data = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    (d / "config.json").write_text(json.dumps(data))
    return d


def test_config_fields():
    cfg = ModelConfig.from_dir(cached_model_dir("qwen2"))
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.family == "qwen2"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 2, 4, 2, 16)
    assert cfg.intermediate_size == 128 and cfg.vocab_size == 512
    assert cfg.attention_bias and not cfg.o_proj_bias and not cfg.qk_norm and not cfg.tie_word_embeddings
    assert cfg.sliding_window is None
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0
    assert cfg.name == cached_model_dir("qwen2").name and cfg.torch_dtype == "float32"
    q3 = ModelConfig.from_dir(cached_model_dir("qwen3"))
    assert q3.qk_norm and not q3.attention_bias and q3.tie_word_embeddings


def test_config_eos_merge_head_dim_and_legacy_rope(tmp_path):
    d = _write_cfg(tmp_path, eos_token_id=[2, 7], head_dim=None, rope_parameters=None,
                   rope_theta=5e5, rope_scaling={**{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}, "type": "llama3"})
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9], "bos_token_id": 1}))
    cfg = ModelConfig.from_dir(d)
    assert cfg.eos_token_ids == [2, 7, 9]
    assert cfg.head_dim == 64 // 4
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32
    (d / "generation_config.json").unlink()
    d2 = _write_cfg(tmp_path / "b", eos_token_id=5, rope_parameters=None, rope_scaling={"type": "default"})
    cfg2 = ModelConfig.from_dir(d2)
    assert cfg2.eos_token_ids == [5, 2] and cfg2.rope_scaling is None  # config.json + generation_config.json


@pytest.mark.parametrize("changes,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen3ForCausalLM"),
    ({"architectures": None}, r"missing key 'architectures'"),
    ({"hidden_size": None}, r"missing key 'hidden_size'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     r"unsupported rope scaling type 'yarn'.*default, llama3"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 4.0, "rope_theta": 1e4}},
     r"llama3 rope scaling is missing key\(s\)"),
    ({"num_key_value_heads": 3}, r"not a multiple of num_key_value_heads 3"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
])
def test_bad_config_errors(tmp_path, changes, match):
    d = _write_cfg(tmp_path, **changes)
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dir(d)


def test_missing_or_broken_config(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="missing config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


def _rewrite_weights(d, edit):
    f = d / "model.safetensors"
    with safe_open(str(f), framework="pt") as sf:
        tensors = {k: sf.get_tensor(k) for k in sf.keys()}  # noqa: SIM118 - safe_open is not iterable
    edit(tensors)
    save_file(tensors, str(f))


def test_missing_tensor_error(tmp_path):
    d = _write_cfg(tmp_path)
    _rewrite_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_our_model(d)


def test_shape_mismatch_error(tmp_path):
    d = _write_cfg(tmp_path)

    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)

    _rewrite_weights(d, edit)
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.self_attn.k_proj.weight' in 'model.safetensors' "
                                             r"has shape \[8, 64\], expected \[32, 64\]"):
        load_our_model(d)


def test_index_pointing_to_missing_file(tmp_path):
    d = make_model_dir(tmp_path / "s", "llama", shards=2)
    next(d.glob("model-00002-of-00002.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002.safetensors.*missing"):
        load_our_model(d)


def test_tensor_parallel_divisibility_error():
    cfg = ModelConfig.from_dir(cached_model_dir("llama"))
    with pytest.raises(ModelLoadError, match=r"num_key_value_heads \(2\) is not divisible by tensor_parallel_size \(4\)"):
        build_model(cfg, "cpu", torch.float32, get_ops("torch", "cpu"), tp_rank=0, tp_size=4)


@pytest.mark.parametrize("native", [True, False])
def test_resolve_dtype_is_a_rule_not_a_measurement(monkeypatch, native):
    """The same answer on a CPU with native bf16 and without: a CPU computes in fp32 (a bf16
    request there is the matmul regime, services/worker/numerics.py); an accelerator takes the
    checkpoint's dtype under auto."""
    monkeypatch.setattr(cpu_native, "native_bf16", lambda: native)
    cfg = ModelConfig.from_dir(cached_model_dir("llama"))
    for ckpt in ("bfloat16", "float32", "float16", cfg, None):
        assert resolve_dtype("auto", "cpu", ckpt) is torch.float32
    assert resolve_dtype("auto", "cuda", "bfloat16") is torch.bfloat16
    assert resolve_dtype("auto", "cuda", cfg) is torch.float32
    assert resolve_dtype("auto", "cuda") is torch.float32
    for names, cpu, gpu in ((("float32", "float", "fp32"), torch.float32, torch.float32),
                            (("bfloat16", "bf16", "torch.bfloat16"), torch.float32, torch.bfloat16),
                            (("float16", "half", "fp16", "FP16"), torch.float16, torch.float16)):
        for n in names:
            assert resolve_dtype(n, "cpu") is cpu and resolve_dtype(n, "cuda") is gpu, n
    with pytest.raises(ModelLoadError, match=r"unsupported dtype 'int8'.*bfloat16"):
        resolve_dtype("int8", "cpu")


def test_cpu_flags_are_read(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    monkeypatch.setattr(cpu_native, "CPUINFO", str(info))
    assert {"avx2", "avx512_bf16"} <= cpu_native.cpu_flags() and cpu_native.native_bf16()
    assert cpu_native.cpu_model() == "Test CPU 9000"
    info.write_text("model name\t: Old\nflags\t\t: fpu avx2\n")
    assert not cpu_native.native_bf16()


def test_load_tokenizer(tmp_path):
    tok = load_tokenizer(cached_model_dir("llama"))
    assert tok.is_fast and tok("hi").input_ids[0] == 1
    with pytest.raises(ModelLoadError, match="missing tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="broken tokenizer file"):
        load_tokenizer(tmp_path)


def test_num_params_matches_model():
    for arch in ("llama", "qwen2", "qwen3"):
        cfg, m = load_our_model(cached_model_dir(arch))
        assert cfg.num_params() == sum(p.numel() for p in m.parameters())


def test_triton_backend_matches_hf():
    """Same model through the Triton ops (interpreter on CPU; the GPU when ZEROSERVE_TEST_GPU=1):
    the layers' strided q/k/v views and fused buffers work with the kernels, not just the twins."""
    pytest.importorskip("triton")
    import os

    use_gpu = bool(os.environ.get("ZEROSERVE_TEST_GPU")) and torch.cuda.is_available()
    if not use_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on CPU (set by conftest) or a GPU")
    device = "cuda" if use_gpu else "cpu"
    d = cached_model_dir("qwen3", tie_word_embeddings=True)  # qk-norm: the most strided path
    cfg, ours = load_our_model(d, backend="triton", device=device)
    hf = load_hf_model(d)
    kv = PagedKV(ours, num_blocks=8, device=device)
    prompt = random_prompt(18, cfg.vocab_size, seed=9)  # 18 + 1 decode: crosses a block boundary
    toks, got = _greedy_decode(ours, kv, "r", prompt, 1)
    torch.testing.assert_close(got.cpu(), hf_logits(hf, toks), atol=ATOL if device == "cpu" else 2e-3, rtol=0)
