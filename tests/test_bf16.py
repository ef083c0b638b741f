"""The numeric modes (services/worker/numerics.py: float32, bfloat16), `--dtype` / `--matmul-dtype`
(services/worker/dtype.py) and `--kv-cache-dtype`.

Checked on any CPU (the bf16 regime runs on every machine: natively where the CPU has AVX-512
BF16, else as the same rounded values through the fp32 kernel): the decision is a rule on the
arguments that never looks at timings or the CPU's bf16; every linear goes through the kernel in
the mode's arithmetic at any row count; a request gives the same tokens and the same logprob
bits alone, inside a batch of 16 and after a preemption, greedy and seeded, in both modes.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from zeroserve.common.errors import ModelLoadError
from zeroserve.kernels import cpu_native, quant, torch_ops
from zeroserve.services.worker import numerics
from zeroserve.services.worker.dtype import resolve_kv_dtype
from zeroserve.services.worker.model.layers import ColumnParallelLinear, TPInfo, VocabParallelEmbedding
from tests.helpers import random_prompt
from tests.hf_reference import model_dir
from tests.test_quant_model import REAL, needs_real
from zeroserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
needs_kernels = pytest.mark.skipif(cpu_native.quant_lib() is None, reason="compiled kernels unavailable")


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# --------------------------------------------------------------------------- the decision
@pytest.mark.parametrize("native", [True, False])
def test_matmul_choice_is_a_rule_on_the_arguments(monkeypatch, native):
    """A rule on the arguments, the kernel build's bf16 and the checkpoint's dtype: nothing is
    timed (the CPU's flags are not read here either: `native` is the build's, passed in)."""
    monkeypatch.setattr(cpu_native, "native_bf16", lambda: not native)  # never consulted

    def c(m, d, ckpt="bfloat16"):
        return numerics.matmul_choice(m, d, native_bf16=native, checkpoint_dtype=ckpt)

    # auto: bf16 only where the build multiplies bf16 natively and the checkpoint is not fp32
    for ckpt in ("bfloat16", "float16"):
        assert c("auto", "auto", ckpt)[0] == ("bfloat16" if native else "float32")
    assert c("auto", "auto", "float32")[0] == "float32" and "exact" in c("auto", "auto", "float32")[1]
    assert c(None, "float32")[0] == "float32"  # --dtype float32 is float32 on every CPU
    for d in ("bfloat16", "bf16", torch.bfloat16):
        assert c("auto", d, "float32")[0] == "bfloat16"
    assert c("float32", "fp32")[0] == "float32" and c("bfloat16", "bf16")[0] == "bfloat16"
    for matmul, dtype in (("bfloat16", "float32"), ("float32", "bfloat16")):  # --dtype float32 means float32
        with pytest.raises(ModelLoadError, match="contradict"):
            c(matmul, dtype)
    assert c("bfloat16", "float16")[0] == "bfloat16"  # a GPU dtype: the CPU path never sees it
    assert c("bfloat16", "auto") == ("bfloat16", "--matmul-dtype bfloat16")
    assert c("float32", "auto")[0] == "float32"


@needs_kernels
def test_auto_follows_the_build_and_the_checkpoint(tmp_path):
    """End to end through the runner: an fp32 checkpoint computes fp32 under auto on every CPU;
    the same weights declared bf16 compute in the bf16 regime exactly where this build has
    VDPBF16PS; `--dtype float32` is fp32 there too."""
    import json
    import shutil

    lib = cpu_native.quant_lib()
    assert _llm("auto").engine.runner.numeric_mode.startswith("float32/")  # the tiny models are saved in fp32
    bf16_dir = tmp_path / "bf16-checkpoint"
    shutil.copytree(model_dir("llama"), bf16_dir)
    cfg = json.loads((bf16_dir / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "bfloat16"
    (bf16_dir / "config.json").write_text(json.dumps(cfg))
    runner = LLM(str(bf16_dir), num_kv_blocks=64).engine.runner
    assert runner.numeric_mode.startswith("bfloat16/" if lib.bf16_native else "float32/"), runner.numeric_mode
    assert LLM(str(bf16_dir), num_kv_blocks=64, dtype="float32").engine.runner.numeric_mode.startswith("float32/")


def test_mode_names_tell_every_arithmetic_apart():
    lib = types.SimpleNamespace(isa="avx512", bf16_native=True)
    emu = types.SimpleNamespace(isa="avx512", bf16_native=False)
    names = {numerics.mode_name("float32", lib, torch.float32, None),
             numerics.mode_name("float32", types.SimpleNamespace(isa="avx2", bf16_native=False), torch.float32, None),
             numerics.mode_name("bfloat16", lib, torch.float32, None),
             numerics.mode_name("bfloat16", emu, torch.float32, None),
             numerics.mode_name("bfloat16", lib, torch.bfloat16, None),
             numerics.mode_name("bfloat16", lib, torch.float32, "int4"),
             numerics.mode_name("float32", None, torch.float32, None),
             numerics.mode_name("float32", lib, torch.float32, None, on_torch=2),
             numerics.mode_name("float32", lib, torch.float32, None, attention="torch")}
    assert len(names) == 9
    assert numerics.mode_name("float32", lib, torch.float32, None) == "float32/cpu-avx512/kv-float32/weights-auto"
    # fp32 does not depend on the bf16 path
    assert numerics.mode_name("float32", emu, torch.float32, None) == numerics.mode_name("float32", lib, torch.float32,
                                                                                      None)


# --------------------------------------------------------------------------- the layers
@needs_kernels
@pytest.mark.parametrize("bf16", [False, True])
def test_every_linear_runs_on_the_kernel_at_any_row_count(bf16):
    lin = ColumnParallelLinear(256, [96], TPInfo(), bias=True, device="cpu", dtype=torch.float32)
    emb = VocabParallelEmbedding(64, 256, TPInfo(), device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    for p in (lin.weight, lin.bias, emb.weight):
        p.data.copy_(torch.randn(p.shape, generator=g))
    model = torch.nn.ModuleList([lin, emb])
    assert numerics.apply(model, bf16) == 0
    assert lin.kernel_weight.data.data_ptr() == lin.weight.data_ptr()  # a view, not a copy
    x = torch.randn(70, 256, generator=g)
    y = lin(x)
    w = quant.QuantizedWeight.from_float(lin.weight)
    assert torch.equal(y, w.linear_bf16(x, lin.bias) if bf16 else w.linear(x, lin.bias))
    for rows in (slice(0, 1), slice(5, 8), slice(3, 19), slice(40, 70)):  # batch-invariant rows
        assert torch.equal(lin(x[rows]), y[rows]), rows
    twin = w.linear_bf16_twin(x, lin.bias) if bf16 else torch.nn.functional.linear(x, lin.weight, lin.bias)
    assert torch.allclose(y, twin, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_bf16_dtype_holds_the_linears_in_bf16_with_the_same_bits():
    """--dtype bfloat16 keeps the float linears' weights in bf16 (half the bytes): the regime
    rounds them to bf16 anyway, so the result equals --matmul-dtype bfloat16's bit for bit."""
    lins = [ColumnParallelLinear(128, [64], TPInfo(), bias=False, device="cpu", dtype=torch.float32) for _ in range(2)]
    emb = VocabParallelEmbedding(64, 128, TPInfo(), device="cpu", dtype=torch.float32)
    for m in (*lins, emb):
        m.weight.data.copy_(torch.randn(m.weight.shape, generator=torch.Generator().manual_seed(2)))
    numerics.apply(torch.nn.ModuleList([lins[0]]), bf16=True)
    numerics.apply(torch.nn.ModuleList([lins[1], emb]), bf16=True, hold_bf16=True)
    assert lins[1].qweight.format == "bf16" and "weight" not in lins[1]._parameters
    assert emb.qweight is None and emb.weight.dtype == torch.float32  # lookups stay exact
    x = torch.randn(9, 128)
    assert torch.equal(lins[0](x), lins[1](x))


def test_without_kernels_the_linears_stay_on_torch_and_the_mode_says_so():
    lin = ColumnParallelLinear(96, [32], TPInfo(), bias=False, device="cpu", dtype=torch.float32)
    assert numerics.apply(torch.nn.ModuleList([lin]), False, kernels=False) == 1 and lin.kernel_weight is None
    odd = ColumnParallelLinear(40, [32], TPInfo(), bias=False, device="cpu", dtype=torch.float32)  # K % 32 != 0
    assert numerics.apply(torch.nn.ModuleList([odd]), False) == 1



# --------------------------------------------------------------------------- engines
def _llm(matmul_dtype: str, arch: str = "llama", **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 1024)
    return LLM(str(model_dir(arch)), matmul_dtype=matmul_dtype, **kw)


def _runner(matmul_dtype: str, **kw):
    llm = _llm(matmul_dtype, **kw)
    return llm, llm.engine.runner


@needs_kernels
def test_runner_reports_its_mode():
    _, r = _runner("auto")
    assert r.matmul_dtype == "float32" and r.numeric_mode.startswith("float32/cpu-")
    _, r = _runner("bfloat16")
    assert r.matmul_dtype == "bfloat16" and r.numeric_mode.startswith("bfloat16/cpu-")
    assert r.numeric_mode.split("/")[1].endswith("-vdpbf16ps" if cpu_native.quant_lib().bf16_native else "-emulated")
    held, r = _runner("auto", dtype="bfloat16")
    assert r.dtype is torch.float32 and r.matmul_dtype == "bfloat16"
    assert r.model.layers[0].mlp.gate_up_proj.qweight.format == "bf16"  # the linears held in bf16
    rounded, r2 = _runner("bfloat16")
    assert r.numeric_mode == r2.numeric_mode and r.param_bytes() < r2.param_bytes()
    # one mode, one arithmetic: the same tokens and logprob bits
    assert _result(held.generate(TARGET, _params(True))[0]) == _result(rounded.generate(TARGET, _params(True))[0])


def test_kv_cache_dtype():
    assert resolve_kv_dtype("auto", torch.float32) is torch.float32
    assert resolve_kv_dtype(None, torch.bfloat16) is torch.bfloat16
    assert resolve_kv_dtype("bf16", torch.float32) is torch.bfloat16
    with pytest.raises(ModelLoadError, match="kv_cache_dtype"):
        resolve_kv_dtype("int8", torch.float32)
    _, r32 = _runner("float32", num_kv_blocks=8)
    _, r16 = _runner("float32", num_kv_blocks=8, kv_cache_dtype="bfloat16")
    assert r16.kv_caches[0][0].dtype is torch.bfloat16
    assert r16.kv_bytes_per_block() * 2 == r32.kv_bytes_per_block()


def test_bf16_kv_cache_reads_as_its_rounded_fp32_values():
    g = torch.Generator().manual_seed(3)
    nb, bs, hk, d, hq = 8, 16, 2, 64, 6
    caches = {dt: (torch.zeros(nb, bs, hk, d, dtype=dt), torch.zeros(nb, bs, hk, d, dtype=dt))
              for dt in (torch.float32, torch.bfloat16)}
    t = 40
    k, v = torch.randn(t, hk, d, generator=g), torch.randn(t, hk, d, generator=g)
    slots = torch.arange(t, dtype=torch.int64)
    torch_ops.write_kv(k, v, *caches[torch.bfloat16], slots)
    torch_ops.write_kv(k.bfloat16().float(), v.bfloat16().float(), *caches[torch.float32], slots)
    assert torch.equal(caches[torch.bfloat16][0].float(), caches[torch.float32][0])
    from zeroserve.kernels.metadata import AttentionMetadata

    meta = AttentionMetadata(slot_mapping=slots, block_tables=torch.arange(3, dtype=torch.int32).view(1, 3),
                             seq_lens=torch.tensor([t], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, t], dtype=torch.int32), max_query_len=t, max_seq_len=t)
    q = torch.randn(t, hq, d, generator=g)
    out = {dt: torch_ops.paged_attention(q, *c, meta, d ** -0.5) for dt, c in caches.items()}
    assert torch.allclose(out[torch.bfloat16], out[torch.float32], atol=1e-6)



V = 512
TARGET = random_prompt(30, V, seed=605)


def _params(seeded: bool, n: int = 16) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=n, ignore_eos=True, logprobs=0)
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


def _others(n: int, max_len: int = 60):
    import random

    rng = random.Random(7)
    prompts = [random_prompt(rng.randint(1, max_len), V, seed=700 + i) for i in range(n)]
    params = [SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=rng.randint(0, 99), max_tokens=rng.randint(16, 40),
                             ignore_eos=True) for _ in range(n)]
    return prompts, params


def _result(out):
    c = out.outputs[0]
    return c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


@needs_kernels
@pytest.mark.parametrize("mode", ["float32", "bfloat16"])
@pytest.mark.parametrize("seeded", [False, True])
def test_alone_in_a_batch_of_16_and_preempted_give_the_same_bits(mode, seeded):
    """Tokens and the sampled tokens' logprobs (the logits' bits, not only their argmax)."""
    ref = _result(_llm(mode).generate(TARGET, _params(seeded))[0])
    assert len(ref[0]) == 16
    others, params = _others(15)
    outs = _llm(mode).generate(others[:7] + [TARGET] + others[7:], params[:7] + [_params(seeded)] + params[7:])
    assert _result(outs[7]) == ref
    # 12 blocks for 16 requests: preemption by recompute, the target (admitted last) among them
    llm = _llm(mode, num_kv_blocks=12, enable_prefix_caching=False)
    sched, victims = llm.engine.scheduler, []
    real = sched._preempt
    sched._preempt = lambda req, out: (victims.append(req.req_id), real(req, out))[1]
    outs = llm.generate(others + [TARGET], params + [_params(seeded)])
    assert sched.num_preemptions > 0 and outs[-1].request_id + "#0" in victims, victims
    assert _result(outs[-1]) == ref


@needs_kernels
@pytest.mark.parametrize("mode", ["float32", "bfloat16"])
def test_the_thread_count_does_not_change_a_bit(mode):
    """The kernels split output rows (and attention heads) over threads, never a row's sum."""
    llm = _llm(mode)
    ref = _result(llm.generate(TARGET, _params(True))[0])
    torch.set_num_threads(2)  # the autouse fixture sets 1 back
    assert _result(llm.generate(TARGET, _params(True))[0]) == ref


@needs_kernels
@pytest.mark.parametrize("mode", ["float32", "bfloat16"])
def test_moe_alone_and_in_a_batch_of_16_give_the_same_bits(mode):
    """MoE: the router and the experts on the kernel too (a token's rows no longer depend on how
    many other tokens chose its experts)."""
    ref = _result(_llm(mode, "qwen3moe").generate(TARGET, _params(True))[0])
    others, params = _others(15)
    outs = _llm(mode, "qwen3moe").generate(others[:7] + [TARGET] + others[7:],
                                          params[:7] + [_params(True)] + params[7:])
    assert _result(outs[7]) == ref


def test_tiny_model_bf16_end_to_end_close_to_fp32():
    """Greedy on the tiny llama: the bf16 mode + bf16 KV produce a full answer; its agreement
    with fp32 is printed (not required identical: random tiny weights have near ties)."""
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(10)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    ref = [o.outputs[0].token_ids for o in _llm("float32").generate(reqs, sp)]
    got = [o.outputs[0].token_ids for o in _llm("bfloat16", kv_cache_dtype="bfloat16").generate(reqs, sp)]
    assert all(len(g) == 12 for g in got)
    same = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y))
    print(f"tiny llama bf16 vs fp32 greedy tokens equal: {same}/{12 * len(prompts)}")
    assert same >= 12 * len(prompts) // 2


@needs_real
def test_smollm2_bf16_greedy_agreement_reported():
    from tests.test_quant_model import N_TOKENS, PROMPTS

    sp = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    out = {}
    for md in ("float32", "bfloat16"):
        llm = LLM(str(REAL), matmul_dtype=md)
        out[md] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
        del llm
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(out["float32"], out["bfloat16"])]
    print(f"SmolLM2 Q4_1 bf16 mode vs fp32: identical greedy prefix per prompt {prefix} of {N_TOKENS}")
    assert sum(prefix) >= len(PROMPTS) * N_TOKENS // 4


@needs_kernels
@pytest.mark.timeout(900)
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the AVX2 target is x86's")
def test_the_avx2_build_is_exact_and_batch_invariant_too():
    """The other CPU path on this machine: ZEROSERVE_CPU_ARCH=x86-64-v3 builds the kernels for
    AVX2 (no AVX-512, no native bf16: bf16 emulated through the fp32 kernel), as on a CPU
    without AVX-512. There, the invariance tests above pass and fp32 equals HF under
    preemption: a newer CPU is not what makes the arithmetic exact."""
    env = dict(os.environ, ZEROSERVE_CPU_ARCH="x86-64-v3")
    probe = ("from zeroserve.kernels import cpu_native as c; l = c.quant_lib(); "
             "print(l.isa, l.bf16_native, c.native_bf16())")
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["avx2", "False", "False"], out.stdout + out.stderr
    tests = ["tests/test_bf16.py::test_alone_in_a_batch_of_16_and_preempted_give_the_same_bits",
             "tests/test_bf16.py::test_the_thread_count_does_not_change_a_bit",
             "tests/test_bf16.py::test_moe_alone_and_in_a_batch_of_16_give_the_same_bits",
             "tests/test_engine.py::test_preemption_matches_hf"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
