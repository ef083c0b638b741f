"""bf16 weight panels (kernels/bf16.py), `--matmul-dtype` (services/worker/matmul_probe.py) and
`--kv-cache-dtype` (services/worker/dtype.py).

Numerics are checked on any CPU (torch emulates bf16 where the CPU lacks it): the panel GEMM
against its fp32 spelling, a packed weight's panel against its exact values, a bf16 KV cache
against an fp32 cache holding the same rounded values. The auto decision is tested with
injected timings and CPU flags. On the real SmolLM2 the greedy agreement with fp32 is reported.
"""

from __future__ import annotations

import types

import pytest
import torch

from zeroserve.common.errors import ModelLoadError
from zeroserve.kernels import bf16, cpu_native
from zeroserve.kernels import torch_ops
from zeroserve.kernels.quant import quantize_int4
from zeroserve.services.worker import matmul_probe
from zeroserve.services.worker.dtype import resolve_kv_dtype
from zeroserve.services.worker.model.layers import ColumnParallelLinear, TPInfo
from tests.hf_reference import model_dir
from tests.test_quant_model import REAL, needs_real
from zeroserve import LLM, SamplingParams


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# --------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("rows", [1, 7, 8, 33, 300])
def test_panel_linear_matches_fp32_spelling(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g)
    w = torch.randn(320, 576, generator=g).to(torch.bfloat16)
    bias = torch.randn(320, generator=g)
    ref = bf16.linear_twin(x, w, bias)
    # the ulp of the rounded sum, before the fp32 bias moves it (a bias that cancels part of the
    # sum would shrink an ulp taken from ref below the rounding step)
    ulp = bf16.linear_twin(x, w).abs().clamp_min(1e-3) * 2.0 ** -7
    for panel in (bf16.pack(w), w):  # oneDNN's prepacked layout, and the plain fallback
        y = bf16.linear(x, panel, bias)
        assert y.dtype == torch.float32 and y.shape == (rows, 320)
        # both round an fp32 sum to bf16; only the summation order differs: at most one bf16
        # ulp of the output apart
        assert ((y - ref).abs() <= ulp + 1e-4).all()
    exact = torch.nn.functional.linear(x, w.float(), bias)
    assert torch.allclose(y, exact, rtol=0, atol=float(exact.abs().max()) * 2e-2)  # bf16 x rounding


def test_layer_uses_panel_from_min_rows_and_exact_path_below():
    lin = ColumnParallelLinear(256, [128], TPInfo(), bias=False, device="cpu", dtype=torch.float32)
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    qw = quantize_int4(w, 32)
    lin.set_quantized(qw)
    model = torch.nn.Sequential(lin)
    assert bf16.attach(model, 8) == 128 * 256 * 2
    assert torch.equal(bf16.dense(lin.bf16_weight), qw.dequantize().to(torch.bfloat16))  # the exact values, rounded
    x = torch.randn(bf16.PANEL_MIN_ROWS, 256, generator=torch.Generator().manual_seed(2))
    assert torch.equal(lin(x[:7]), qw.linear(x[:7]))  # below min_rows: the packed path untouched
    # decode-sized steps: the bf16 regime on the packed bytes; from PANEL_MIN_ROWS: the panel
    assert torch.equal(lin(x[:16]), qw.linear_bf16(x[:16]))
    assert torch.equal(lin(x), bf16.linear(x, lin.bf16_weight))
    assert bf16.min_rows(model) == 8
    bf16.detach(model)
    assert bf16.min_rows(model) is None and torch.equal(lin(x), qw.linear(x))
    with pytest.raises(ValueError):
        bf16.attach(model, 0)


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


# --------------------------------------------------------------------------- decisions
def test_choose_min_rows():
    c = matmul_probe.choose_min_rows
    assert c({}) is None
    assert c({1: (1.0, 2.0), 8: (1.0, 0.5), 256: (10.0, 5.0)}) == 8
    assert c({1: (1.0, 0.5), 8: (1.0, 0.5), 256: (10.0, 5.0)}) == 1
    assert c({1: (1.0, 0.5), 8: (1.0, 1.2), 256: (10.0, 5.0)}) == 256  # a loss at 8 rules out 1 too
    assert c({1: (1.0, 0.5), 256: (10.0, 11.0)}) is None  # losing the prefill chunk: never
    assert c({8: (1.0, 0.97)}) is None  # within the noise margin is no win
    assert c({8: (1.0, 0.97)}, win=1.0) == 8


def test_probe_shapes_fit_the_cache():
    full = matmul_probe.probe_shapes(16, 10_000)
    assert [s.rows for s in full] == [1, 4, 8, 16, 32, 256]
    assert [s.rows for s in matmul_probe.probe_shapes(16, 160)] == [1, 4, 8, 16, 256]  # 9 blocks per request
    assert [s.rows for s in matmul_probe.probe_shapes(16, 20)] == [1, 256]
    assert matmul_probe.probe_shapes(16, 1) == []


def _runner(matmul_dtype: str, **kw):
    llm = LLM(str(model_dir("llama")), matmul_dtype=matmul_dtype, **kw)
    return llm, llm.engine.runner


def test_matmul_dtype_explicit_and_bad():
    _, r = _runner("float32")
    assert r.matmul_dtype == "float32" and bf16.min_rows(r.model) is None
    _, r = _runner("bfloat16")
    assert r.matmul_dtype == f"bfloat16 from {bf16.DEFAULT_MIN_ROWS} rows"
    assert bf16.min_rows(r.model) == bf16.DEFAULT_MIN_ROWS
    r.args.matmul_dtype = "int8"
    with pytest.raises(ModelLoadError, match="matmul_dtype"):
        matmul_probe.configure(r)


def test_auto_stays_fp32_when_switched_off_or_no_native_bf16(monkeypatch):
    monkeypatch.setenv("ZEROSERVE_CPU_BF16", "0")
    _, r = _runner("auto")
    assert r.matmul_dtype == "float32" and bf16.min_rows(r.model) is None
    monkeypatch.setenv("ZEROSERVE_CPU_BF16", "1")
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: {"avx2", "fma"})
    r.args.matmul_dtype = "auto"
    assert matmul_probe.configure(r) == "float32" and bf16.min_rows(r.model) is None


def test_auto_stays_fp32_with_speculative_decoding(monkeypatch):
    """A verify step has more rows than the decode it stands for: with bf16 from a row count the
    same token would be computed in bf16 with speculation and in fp32 without, and greedy output
    would differ (benchmarks/spec_decode.py saw it on SmolLM2). So auto keeps fp32 there."""
    monkeypatch.setenv("ZEROSERVE_CPU_BF16", "1")
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(matmul_probe, "measure", lambda runner: ({1: (1.0, 2.0), 8: (1.0, 0.5), 256: (9.0, 3.0)},
                                                                 {"x_ms": 1.0}))
    _, r = _runner("float32")
    r.args.matmul_dtype, r.args.speculative_method = "auto", "ngram"
    assert matmul_probe.configure(r) == "float32" and bf16.min_rows(r.model) is None
    r.args.speculative_method = "none"  # the same runner without speculation takes the measured bf16
    assert matmul_probe.configure(r) == "bfloat16 from 8 rows"


@pytest.mark.parametrize("timings,want", [({1: (1.0, 2.0), 8: (1.0, 0.5), 256: (9.0, 3.0)}, 8),
                                          ({1: (1.0, 2.0), 256: (9.0, 9.5)}, None)])
def test_auto_applies_the_measured_decision(monkeypatch, timings, want):
    monkeypatch.setenv("ZEROSERVE_CPU_BF16", "1")
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(matmul_probe, "measure", lambda runner: (timings, {"x_ms": 1.0}))
    _, r = _runner("float32")
    r.args.matmul_dtype = "auto"
    got = matmul_probe.configure(r)
    assert bf16.min_rows(r.model) == want
    assert got == ("float32" if want is None else f"bfloat16 from {want} rows")


def test_auto_never_takes_one_row_for_packed_weights(monkeypatch):
    """A probe slowed by contention once chose bf16 from 1 row on SmolLM2 Q4_1 (batch-1 decode
    then ran 5x slower): for packed weights one row is not a candidate."""
    monkeypatch.setenv("ZEROSERVE_CPU_BF16", "1")
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(matmul_probe, "measure", lambda runner: ({1: (1.0, 0.5), 8: (1.0, 0.5), 256: (9.0, 3.0)},
                                                                 {"x_ms": 1.0}))
    _, r = _runner("float32")
    r.args.matmul_dtype = "auto"
    assert matmul_probe.configure(r) == "bfloat16 from 1 rows"  # fp32 weights: one row may win
    monkeypatch.setattr(matmul_probe, "_packed", lambda model: True)
    assert matmul_probe.configure(r) == "bfloat16 from 8 rows"


def test_measure_times_every_shape_and_leaves_the_cache_clean():
    _, r = _runner("bfloat16", num_kv_blocks=160)
    timings, table = matmul_probe.measure(r, budget_s=0.0, min_reps=1)
    assert sorted(timings) == [1, 4, 8, 16, 256]  # b32 needs 32 * 9 blocks: trimmed
    assert all(a > 0 and b > 0 for a, b in timings.values()) and "prefill_256_bf16_ms" in table
    assert all(not k.any() and not v.any() for k, v in r.kv_caches)
    assert bf16.min_rows(r.model) == matmul_probe.NEVER


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


def test_tiny_model_bf16_end_to_end_close_to_fp32():
    """Greedy on the tiny llama: bf16 panels + bf16 KV produce a full answer; its agreement with
    fp32 is printed (not required identical: random tiny weights have near ties)."""
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(10)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    ref = [o.outputs[0].token_ids for o in _runner("float32")[0].generate(reqs, sp)]
    llm, _ = _runner("bfloat16", kv_cache_dtype="bfloat16")
    got = [o.outputs[0].token_ids for o in llm.generate(reqs, sp)]
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
        bf16.set_min_rows(llm.engine.runner.model, 1)  # every step on the panels (the harshest case)
        out[md] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
        del llm
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(out["float32"], out["bfloat16"])]
    print(f"SmolLM2 Q4_1 bf16 panels vs fp32: identical greedy prefix per prompt {prefix} of {N_TOKENS}")
    assert sum(prefix) >= len(PROMPTS) * N_TOKENS // 4


def test_compiled_decode_step_takes_bf16_batches_below_the_panels():
    """The compiled decode step (cpu_step.py) runs decode batches in the bf16 regime itself (on
    the packed bytes) up to the rows from which the layers' float GEMMs / panels take over."""
    llm = LLM(str(model_dir("llama")), quantization="int4", matmul_dtype="float32", num_kv_blocks=160)
    r = llm.engine.runner
    step = r.model._cpu_step()
    if step is None:
        pytest.skip("compiled decode step unavailable here")

    def applies(batch):
        ids, pos, meta, _ = matmul_probe._step_inputs(matmul_probe.StepShape("d", batch, batch, 1, 16), r.block_size,
                                                      r.model.cfg.vocab_size)
        return step.applies(meta, r.model.embed_tokens(ids), r.kv_caches)

    assert applies(4) and applies(8)
    bf16.attach(r.model, 8)
    assert applies(4) and applies(8) and applies(bf16.PANEL_MIN_ROWS - 1)
    assert not applies(bf16.PANEL_MIN_ROWS)
    bf16.detach(r.model)
    assert applies(8)
