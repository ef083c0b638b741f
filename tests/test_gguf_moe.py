"""MoE GGUF files (written by the gguf package as llama.cpp lays them out: experts stacked in
3-D `ffn_{gate,up,down}_exps`, the router `ffn_gate_inp` in F32; Mixtral as arch "llama" with
`llama.expert_count`, Qwen3-MoE as "qwen3moe", OLMoE as "olmoe").

F32 files give HF's logits; Q8_0 / Q4_0 files keep every expert packed and give the logits of
the same file loaded with every weight dequantized (quantization="none")."""

from __future__ import annotations

import pytest
import torch

from zeroserve.common.model_config import ModelConfig
from tests.gguf_export import export_hf_dir
from tests.helpers import (  # noqa: F401 (torch_single_thread is a fixture)
    PagedKV,
    cached_model_dir,
    hf_logits,
    load_hf_model,
    load_our_model,
    random_prompt,
    run_step,
    torch_single_thread,
)

pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("torch_single_thread")

ARCHS = ("mixtral", "qwen3moe", "olmoe")
PROMPT = random_prompt(19, 512, seed=3)


def _logits(model):
    return run_step(model, PagedKV(model, num_blocks=8), [("r", PROMPT)], all_rows=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_moe_gguf_matches_hf(tmp_path, arch):
    d = cached_model_dir(arch)
    g = export_hf_dir(d, tmp_path / f"{arch}.gguf")
    cfg = ModelConfig.from_dir(g)
    hf_cfg = ModelConfig.from_dir(d)
    for f in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "dense_layers", "qk_norm", "qk_norm_full"):
        assert getattr(cfg, f) == getattr(hf_cfg, f), f
    _, model = load_our_model(g)
    torch.testing.assert_close(_logits(model), hf_logits(load_hf_model(d), PROMPT), atol=2e-4, rtol=0)


@pytest.mark.parametrize("arch,qtype", [("mixtral", "Q8_0"), ("qwen3moe", "Q4_0"), ("olmoe", "Q8_0"),
                                        ("olmoe", "Q4_0")])
def test_quantized_moe_gguf_stays_packed_and_matches_dequantized(tmp_path, arch, qtype):
    g = export_hf_dir(cached_model_dir(arch), tmp_path / f"{arch}-{qtype}.gguf", qtype=qtype)
    _, packed = load_our_model(g)
    _, floats = load_our_model(g, quantization="none")
    moe = packed.layers[0].mlp
    assert all(ex.gate_up_proj.qweight.format == ex.down_proj.qweight.format == qtype.lower() for ex in moe.experts)
    assert moe.gate.weight.dtype == torch.float32  # the F32 router read as floats
    assert packed.quant_summary() == {qtype.lower(): len(packed.quantizable())}
    assert packed.weight_bytes() < 0.4 * floats.weight_bytes()
    got, want = _logits(packed), _logits(floats)
    assert moe._stacks is None
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_llm_serves_a_quantized_moe_gguf(tmp_path):
    from zeroserve import LLM, SamplingParams

    d = cached_model_dir("qwen3moe")
    g = export_hf_dir(d, tmp_path / "q.gguf", qtype="Q8_0")
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
    packed = LLM(str(g), num_kv_blocks=32).generate([PROMPT], params)[0].outputs[0].token_ids
    floats = LLM(str(g), num_kv_blocks=32, quantization="none").generate([PROMPT], params)[0].outputs[0].token_ids
    assert list(packed) == list(floats) and len(packed) == 8


def test_legacy_per_expert_mixtral_gguf(tmp_path):
    """Mixtral GGUFs from before llama.cpp stacked the experts: blk.N.ffn_gate.E.weight etc."""
    import gguf
    import numpy as np

    from tests.gguf_export import write_gguf

    d = cached_model_dir("mixtral")
    g = export_hf_dir(d, tmp_path / "stacked.gguf", qtype="Q8_0")
    reader = gguf.GGUFReader(str(g))
    tensors = {}
    for t in reader.tensors:
        data = np.asarray(t.data)
        if "_exps." in t.name:  # split the stack [E, rows, bytes] into per-expert 2-D tensors
            for e in range(data.shape[0]):
                tensors[t.name.replace("_exps.weight", f".{e}.weight")] = (data[e], t.tensor_type.name)
        else:
            tensors[t.name] = (data, t.tensor_type.name)
    cfg = ModelConfig.from_dir(d)
    hp = {"block_count": cfg.num_layers, "embedding_length": cfg.hidden_size,
          "feed_forward_length": cfg.intermediate_size, "head_count": cfg.num_heads, "head_count_kv": cfg.num_kv_heads,
          "head_dim": cfg.head_dim, "extra": {"llama.expert_count": 8, "llama.expert_used_count": 2}}
    legacy = write_gguf(tmp_path / "legacy.gguf", "llama", hp, tensors)
    _, a = load_our_model(g)
    _, b = load_our_model(legacy)
    assert b.layers[0].mlp.experts[3].down_proj.qweight.format == "q8_0"
    assert torch.equal(_logits(a), _logits(b))
