"""`--matmul-dtype`: whether a CPU worker's batched matmuls run on bf16 weight panels
(kernels/bf16.py), and from how many rows of a step on.

- ``float32``: never (the exact reference path).
- ``bfloat16``: from zeroserve.kernels.bf16.DEFAULT_MIN_ROWS rows on, measured or not (emulated, and slow,
  on a CPU without native bf16; for testing there).
- ``auto``: only on a CPU with bf16 in its instruction set (AVX-512 BF16 / AMX / aarch64 BF16,
  read from /proc/cpuinfo at run time), an fp32 model on one CPU worker (tensor-parallel shards
  would have to agree), and not under ZEROSERVE_CPU_BF16=0. Then a start-up probe times whole
  steps of this model, each in fp32 and with the panels: decode at batch 1, 4, 8, 16, 32 and one
  prefill chunk, through the model's real forward (the compiled decode step, attention, the
  LM head on the sampled rows). The panels are used from the smallest measured row count from
  which bf16 won every larger measured shape too (`choose_min_rows`); if it lost the largest
  one they are dropped. The decision and every timing are logged.

The probe writes into the KV cache's first blocks and zeroes them after: it runs before any
request, so nothing cached is lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.log import get_logger
from zeroserve.kernels.metadata import AttentionMetadata
from zeroserve.kernels import bf16, cpu_native

log = get_logger("worker.matmul_dtype")

MATMUL_DTYPES = ("auto", "float32", "bfloat16")
PROBE_DECODE_BATCHES = (1, 4, 8, 16, 32)
PROBE_PREFILL_TOKENS = 256
PROBE_CONTEXT = 128  # tokens already in the cache of each decoding request
# bf16 must beat fp32 by this factor at a shape to count as a win there (noise margin)
BF16_WIN = 0.95
NEVER = bf16.NEVER  # panels attached but unused


@dataclass(frozen=True)
class StepShape:
    name: str
    rows: int  # rows the linears see
    requests: int
    query_len: int
    context: int  # tokens in the cache of each request before this step


def probe_shapes(block_size: int, num_blocks: int) -> list[StepShape]:
    """The step shapes the probe times, trimmed to what the KV cache holds."""
    out = []
    for b in PROBE_DECODE_BATCHES:
        if b * -(-(PROBE_CONTEXT + 1) // block_size) <= num_blocks:
            out.append(StepShape(f"decode b{b}", b, b, 1, PROBE_CONTEXT))
    p = PROBE_PREFILL_TOKENS
    if -(-p // block_size) <= num_blocks:
        out.append(StepShape(f"prefill {p}", p, 1, p, 0))
    return out


def choose_min_rows(timings: dict[int, tuple[float, float]], win: float = BF16_WIN) -> int | None:
    """rows -> (fp32 seconds, bf16 seconds) of a step: the smallest row count from which bf16
    wins (bf16 <= win * fp32) at it and at every larger measured row count; None when it loses
    the largest (or nothing was measured)."""
    best = None
    for rows in sorted(timings, reverse=True):
        f32, b16 = timings[rows]
        if not b16 <= win * f32:
            break
        best = rows
    return best


def configure(runner) -> str:
    """Apply ``runner.args.matmul_dtype`` to ``runner.model``; returns "float32" or
    "bfloat16 from N rows" (what the worker logs and reports)."""
    name = str(getattr(runner.args, "matmul_dtype", "auto") or "auto").strip().lower()
    if name not in MATMUL_DTYPES:
        raise ModelLoadError(f"unsupported matmul_dtype {name!r}; use one of {MATMUL_DTYPES}")
    model = runner.model
    eligible = runner.device.type == "cpu" and runner.dtype == torch.float32
    if name == "float32" or not eligible:
        if name == "bfloat16":
            log.warning("matmul_dtype bfloat16 applies to fp32 models on CPU only; ignored",
                        device=str(runner.device), dtype=str(runner.dtype))
        return "float32"
    if name == "bfloat16":
        if _speculating(runner):
            log.warning("matmul_dtype bfloat16 with speculative decoding: a step's rows decide whether it runs "
                        "in bf16, and verifying drafts changes the rows, so greedy output can differ from "
                        "decoding without speculation (--matmul-dtype float32 keeps them equal)")
        nbytes = bf16.attach(model, bf16.DEFAULT_MIN_ROWS)
        log.info("matmul dtype bfloat16 (as asked)", min_rows=bf16.DEFAULT_MIN_ROWS, panel_mib=round(nbytes / 2**20, 1),
                 native_bf16=cpu_native.native_bf16())
        return f"bfloat16 from {bf16.DEFAULT_MIN_ROWS} rows"
    why = _auto_ineligible(runner)
    if why:
        log.info("matmul dtype auto: float32", reason=why)
        return "float32"
    nbytes = bf16.attach(model, NEVER)
    timings, table = measure(runner)
    if _packed(model):
        # A one-row step is memory-bound: packed weights (~0.6 bytes a weight for Q4_1) beat a bf16
        # panel's 2 bytes there, and the fp32 path runs it as one compiled call. A probe that says
        # otherwise measured contention (seen: `zeroserve up` starting its other processes during
        # the probe chose bf16 from 1 row, and batch-1 decode ran 5x slower), so it is not asked.
        timings.pop(1, None)
    rows = choose_min_rows(timings)
    fields = {k: round(v * 1e3, 2) for k, v in table.items()}
    if rows is None:
        bf16.detach(model)
        log.info("matmul dtype auto: float32 (bf16 steps were not faster)", cpu=cpu_native.cpu_model(), **fields)
        return "float32"
    bf16.set_min_rows(model, rows)
    log.info("matmul dtype auto: bfloat16", min_rows=rows, panel_mib=round(nbytes / 2**20, 1),
             cpu=cpu_native.cpu_model(), **fields)
    return f"bfloat16 from {rows} rows"


def _auto_ineligible(runner) -> str | None:
    if bf16.turned_off():
        return "ZEROSERVE_CPU_BF16=0"
    if not cpu_native.native_bf16():
        return "no native bf16 on this CPU (torch would emulate it: slower)"
    if _speculating(runner):
        # bf16 panels run from a row count; a verify step has more rows than the decode it stands
        # for, so the same token would be computed in bf16 with speculation and in fp32 without,
        # and greedy output would no longer equal non-speculative decoding's
        return "speculative decoding (its verify steps would switch rows between fp32 and bf16)"
    if getattr(runner, "tp_size", 1) != 1:
        return "tensor-parallel shard (its peers could decide otherwise)"
    if getattr(runner, "pp_size", 1) != 1:
        return "pipeline stage (its peers could decide otherwise; its model has no whole forward)"
    if not probe_shapes(runner.block_size, runner.num_blocks):
        return "KV cache too small to probe"
    return None


def measure(runner, budget_s: float = 1.5,
            min_reps: int = 2) -> tuple[dict[int, tuple[float, float]], dict[str, float]]:
    """Fastest seconds per step, fp32 vs bf16 panels, for each of `probe_shapes`: rows ->
    (fp32, bf16), and "<shape> <dtype>_ms"-style names -> seconds for the log. The model must
    have its panels attached; their row threshold is left at NEVER."""
    model = runner.model
    shapes = probe_shapes(runner.block_size, runner.num_blocks)
    inputs = [_step_inputs(s, runner.block_size, model.cfg.vocab_size) for s in shapes]
    times: dict[tuple[int, str], list[float]] = {(i, m): [] for i in range(len(shapes)) for m in ("fp32", "bf16")}
    try:
        with torch.inference_mode():
            deadline, rep = None, 0
            while True:
                for i, args in enumerate(inputs):
                    for mode in ("fp32", "bf16"):  # interleaved: a noisy host slows both alike
                        bf16.set_min_rows(model, NEVER if mode == "fp32" else 1)
                        t0 = time.perf_counter()
                        _run_step(model, runner.kv_caches, *args)
                        if rep:  # the first round warms oneDNN's kernel caches and the workspaces
                            times[i, mode].append(time.perf_counter() - t0)
                rep += 1
                deadline = deadline or time.perf_counter() + budget_s
                if rep > min_reps and time.perf_counter() > deadline:
                    break
    finally:
        bf16.set_min_rows(model, NEVER)
        for k, v in runner.kv_caches:
            k.zero_()
            v.zero_()
    # the fastest of each: other processes on the cores only ever add time, so the minimum is the
    # least disturbed estimate (medians swung 2x at a load of 8 on 2 cores)
    med = {key: min(v) for key, v in times.items()}
    timings = {s.rows: (med[i, "fp32"], med[i, "bf16"]) for i, s in enumerate(shapes)}
    table = {f"{s.name.replace(' ', '_')}_{m}_ms": med[i, m] for i, s in enumerate(shapes) for m in ("fp32", "bf16")}
    return timings, table


def _step_inputs(s: StepShape, bs: int, vocab: int):
    """A step of `s`: request r owns blocks [r * per, (r + 1) * per) of the cache."""
    g = torch.Generator().manual_seed(s.rows)
    per = -(-(s.context + s.query_len) // bs)
    t = s.requests * s.query_len
    ids = torch.randint(0, vocab, (t,), generator=g)
    pos = (torch.arange(s.query_len) + s.context).repeat(s.requests)
    table = torch.arange(s.requests * per, dtype=torch.int32).view(s.requests, per)
    rows = torch.arange(s.requests).repeat_interleave(s.query_len)
    slots = table[rows, pos // bs].long() * bs + pos % bs
    seq = torch.full((s.requests,), s.context + s.query_len, dtype=torch.int32)
    qsl = torch.arange(s.requests + 1, dtype=torch.int32) * s.query_len
    meta = AttentionMetadata(slot_mapping=slots, block_tables=table, seq_lens=seq, query_start_loc=qsl,
                             max_query_len=s.query_len, max_seq_len=s.context + s.query_len)
    last = qsl[1:].long() - 1
    return ids, pos, meta, last


def _run_step(model, kv_caches, ids, pos, meta, last) -> None:
    hidden = model(ids, pos, kv_caches, meta)
    model.compute_logits(hidden.index_select(0, last))


def _speculating(runner) -> bool:
    return str(getattr(runner.args, "speculative_method", "none") or "none") != "none"


def _packed(model) -> bool:
    """Whether some linear keeps quantized (packed) weights."""
    return any(getattr(m, "qweight", None) is not None for m in model.modules())
