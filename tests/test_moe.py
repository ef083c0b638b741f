"""Mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE) against HF transformers in fp32.

Each family's tiny model (services/tiny_model.py: 8 experts, top-2, 2 layers, written as
transformers' save_pretrained names them) is compared with HF: logits of a prefill and decode
steps on the paged cache, then greedy generations through `zeroserve.LLM` (several prompts in
one continuous batch). Also: experts packed by --quantization int8/int4, the compiled decode step
staying off for MoE, work done only for the experts a batch routes to, and the config errors.
"""

from __future__ import annotations

import json

import pytest
import torch

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.model_config import ModelConfig
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
from tests.hf_reference import explain_mismatch, hf_greedy

ARCHS = ("mixtral", "qwen3moe", "olmoe")
ATOL = 2e-4

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _greedy(model, kv, prompt, steps):
    rows = [run_step(model, kv, [("r", prompt)], all_rows=True)]
    toks = list(prompt)
    for _ in range(steps):
        toks.append(int(rows[-1][-1].argmax()))
        rows.append(run_step(model, kv, [("r", [toks[-1]])]))
    return toks, torch.cat(rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match_hf(arch):
    d = cached_model_dir(arch)
    cfg, ours = load_our_model(d)
    assert cfg.is_moe and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    prompt = random_prompt(21, cfg.vocab_size, seed=1)
    toks, got = _greedy(ours, PagedKV(ours, num_blocks=16), prompt, 6)
    ref = hf_logits(load_hf_model(d), toks)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert toks[21:] == ref[20:-1].argmax(-1).tolist()


def test_family_switches_read_from_config():
    mix = ModelConfig.from_dir(cached_model_dir("mixtral"))
    qwen = ModelConfig.from_dir(cached_model_dir("qwen3moe"))
    olmoe = ModelConfig.from_dir(cached_model_dir("olmoe"))
    assert (mix.norm_topk_prob, mix.moe_intermediate_size, mix.dense_layers) == (True, 128, [])
    assert (qwen.norm_topk_prob, qwen.moe_intermediate_size, qwen.dense_layers, qwen.qk_norm) == (True, 64, [1], True)
    assert (olmoe.norm_topk_prob, olmoe.qk_norm_full, olmoe.qk_norm) == (False, True, False)
    _, model = load_our_model(cached_model_dir("qwen3moe"))
    assert type(model.layers[0].mlp).__name__ == "SparseMoeBlock" and type(model.layers[1].mlp).__name__ == "MLP"
    moe = model.layers[0].mlp
    w13, w2 = moe._float_stacks()  # the experts' parameters are views of one stack: no copy
    assert w13.shape == (8, 2 * 64, 64) and w2.shape == (8, 64, 64)
    assert w13.data_ptr() == moe.experts[0].gate_up_proj.weight.data_ptr()
    assert torch.equal(w13[5], moe.experts[5].gate_up_proj.weight) and torch.equal(w2[7], moe.experts[7].down_proj.weight)


@pytest.mark.parametrize("arch", ARCHS)
def test_llm_batched_greedy_matches_hf(arch):
    from zeroserve import LLM, SamplingParams

    prompts = [random_prompt(n, 512, seed=300 + i) for i, n in enumerate((3, 17, 40))]
    llm = LLM(str(cached_model_dir(arch)), num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10))
    for p, out in zip(prompts, outs):
        ref = hf_greedy(arch, p, 10)
        got = list(out.outputs[0].token_ids)
        assert got == ref, explain_mismatch(arch, p, got, ref)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_experts_stay_packed(quant):
    d = cached_model_dir("mixtral")
    _, ref = load_our_model(d)
    _, q = load_our_model(d, quantization=quant)
    # nothing holds the float experts once packed (the block keeps no stack of its own)
    assert all(q.layers[0].mlp._stacks is None and "weight" not in ex.gate_up_proj._parameters
               for ex in q.layers[0].mlp.experts)
    n_experts = sum(len(layer.mlp.experts) for layer in q.layers)
    # qkv, o per layer + gate_up, down per expert + the LM head (int8); the embedding stays float
    assert q.quant_summary() == {quant: 2 * len(q.layers) + 2 * n_experts + (quant == "int8"), "float": 1,
                                 **({"int8": 1} if quant == "int4" else {})}
    assert all(layer.mlp.gate.weight.dtype == torch.float32 for layer in q.layers)  # the router stays float
    assert q.weight_bytes() < 0.5 * ref.weight_bytes()
    # the packed model computes what the float model with the dequantized weights computes
    with torch.no_grad():
        for name, mod in q.quantizable().items():
            dict(ref.named_parameters())[name].copy_(mod.float_weight())
    prompt = random_prompt(19, 512, seed=4)
    got = run_step(q, PagedKV(q, num_blocks=8), [("r", prompt)], all_rows=True)
    want = run_step(ref, PagedKV(ref, num_blocks=8), [("r", prompt)], all_rows=True)
    assert q.layers[0].mlp._stacks is None  # the float stacks were dropped for the packed copies
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_compiled_decode_step_excludes_moe():
    from zeroserve.services.worker.model.cpu_step import CpuDecodeStep

    _, model = load_our_model(cached_model_dir("mixtral"), backend="cpu", quantization="int8")
    assert CpuDecodeStep.build(model) is None
    _, dense = load_our_model(cached_model_dir("llama"), backend="cpu", quantization="int8")
    from zeroserve.kernels import cpu_native
    if cpu_native.step_lib() is not None:  # a dense packed model does get it: the check is specific
        assert CpuDecodeStep.build(dense) is not None


def test_work_only_for_routed_experts(monkeypatch):
    """A decode step runs top_k experts per layer and token, whatever the expert count: the
    expert matmuls are counted (the stacks' per-expert slices w13[e] the twin multiplies)."""
    import zeroserve.kernels.moe as M

    used = []
    real_groups, real_single = M.expert_groups, M.single_token_routes

    def groups(ids, num_local, start=0):
        out = real_groups(ids, num_local, start)
        used.append((ids.shape[0], len(out)))
        return out

    def single(ids, weights, num_local, start=0):
        out = real_single(ids, weights, num_local, start)
        used.append((1, len(out)))
        return out

    monkeypatch.setattr(M, "expert_groups", groups)
    monkeypatch.setattr(M, "single_token_routes", single)
    _, model = load_our_model(cached_model_dir("olmoe", num_experts=32))
    kv = PagedKV(model, num_blocks=8)
    run_step(model, kv, [("r", random_prompt(5, 512, seed=2))])
    assert all(n <= min(5 * 2, 32) for _, n in used) and len(used) == 2
    used.clear()
    run_step(model, kv, [("r", [7])])
    assert used == [(1, 2)] * 2  # 2 layers, 2 of 32 experts each
    used.clear()
    kv2 = PagedKV(model, num_blocks=8)
    run_step(model, kv2, [("a", [5, 6]), ("b", [9])])  # 3 tokens: at most 6 experts per layer
    assert len(used) == 2 and all(t == 3 and n <= 6 for t, n in used)


def test_num_params_matches_model():
    for arch in ARCHS:
        cfg, model = load_our_model(cached_model_dir(arch))
        n = sum(p.numel() for p in model.parameters())
        assert cfg.num_params() == n, arch


def _edit_config(d, **changes):
    p = d / "config.json"
    data = json.loads(p.read_text())
    data.update(changes)
    p.write_text(json.dumps(data))


def test_config_errors(tmp_path):
    d = make_model_dir(tmp_path / "m", "mixtral")
    _edit_config(d, num_experts_per_tok=9)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 9 exceeds num_local_experts 8"):
        ModelConfig.from_dir(d)
    _edit_config(d, num_experts_per_tok=2, num_local_experts=0)
    with pytest.raises(ModelLoadError, match="'num_local_experts' must be a positive integer"):
        ModelConfig.from_dir(d)


def test_expert_parallel_needs_divisible_experts():
    from zeroserve.kernels.dispatch import get_ops
    from zeroserve.services.worker.model import build_model

    cfg = ModelConfig.from_dir(cached_model_dir("mixtral", num_local_experts=5))
    with pytest.raises(ModelLoadError, match=r"num_experts \(5\) is not divisible by tensor_parallel_size \(2\)"):
        build_model(cfg, "cpu", torch.float32, get_ops("torch"), tp_rank=0, tp_size=2, expert_parallel=True)


def _fuse_experts(d, arch):
    """Rewrite a per-expert checkpoint with transformers 5's module names: experts fused into
    3-D `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I], routers under `mlp`."""
    from safetensors.torch import load_file, save_file

    from zeroserve.services.worker.model.moe import hf_expert_names, moe_prefix

    cfg = ModelConfig.from_dir(d)
    w = load_file(str(d / "model.safetensors"))
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        prefix = moe_prefix(cfg, f"model.layers.{i}")
        names = [hf_expert_names(cfg, prefix, e) for e in range(cfg.num_experts)]
        gate_up = torch.stack([torch.cat([w.pop(g), w.pop(u)]) for g, u, _ in names])
        down = torch.stack([w.pop(dn) for _, _, dn in names])
        w[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gate_up
        w[f"model.layers.{i}.mlp.experts.down_proj"] = down
        w[f"model.layers.{i}.mlp.gate.weight"] = w.pop(f"{prefix}.gate.weight")
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("arch", ["mixtral", "qwen3moe"])
def test_fused_expert_checkpoint_matches_hf(tmp_path, arch):
    d = make_model_dir(tmp_path / "m", arch)
    _, per_expert = load_our_model(d)
    _fuse_experts(d, arch)
    _, fused = load_our_model(d)
    assert fused.layers[0].mlp.fused_checkpoint
    for (name, a), (_, b) in zip(per_expert.named_parameters(), fused.named_parameters()):
        assert torch.equal(a, b), name
    prompt = random_prompt(9, 512, seed=8)
    got = run_step(fused, PagedKV(fused, num_blocks=4), [("r", prompt)], all_rows=True)
    torch.testing.assert_close(got, hf_logits(load_hf_model(d), prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe"])
def test_triton_backend_moe_matches_hf(arch):
    """The MoE block through the Triton grouped GEMM (interpreter on CPU; the GPU when
    ZEROSERVE_TEST_GPU=1), inside the whole model, against HF."""
    pytest.importorskip("triton")
    import os

    use_gpu = bool(os.environ.get("ZEROSERVE_TEST_GPU")) and torch.cuda.is_available()
    if not use_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on CPU (set by conftest) or a GPU")
    device = "cuda" if use_gpu else "cpu"
    d = cached_model_dir(arch)
    cfg, ours = load_our_model(d, backend="triton", device=device)
    kv = PagedKV(ours, num_blocks=8, device=device)
    prompt = random_prompt(18, cfg.vocab_size, seed=9)
    toks, got = _greedy(ours, kv, prompt, 1)
    torch.testing.assert_close(got.cpu(), hf_logits(load_hf_model(d), toks), atol=ATOL if device == "cpu" else 2e-3,
                               rtol=0)


def test_make_tiny_model_cli_moe_archs(tmp_path, capsys):
    from zeroserve.services.tiny_model import main

    for arch in ARCHS:
        assert main([str(tmp_path / arch), "--arch", arch, "--size", "tiny"]) == 0
        cfg = ModelConfig.from_dir(tmp_path / arch)
        assert cfg.is_moe and cfg.family == arch
    assert "wrote tiny olmoe model" in capsys.readouterr().out
