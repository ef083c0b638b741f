"""Compute dtype of a worker: the user's choice, or one chosen for the checkpoint and the machine.

"auto" on an accelerator is the checkpoint's own dtype. On a CPU it is float32 (exact: greedy
output equals HF in fp32), except for a bf16 checkpoint on a CPU with bf16 in its instruction
set (AVX-512 BF16 / AMX, aarch64 BF16) where a bf16 linear of the model's shape measured faster
than fp32 at start-up, for decode and not slower for prefill (one worker process; tensor-parallel
shards stay fp32). The probe times the linears only: in bf16 the per-layer small ops run as
torch ops rather than the compiled fp32 ones (kernels/cpu_ops.py), which a small model feels.

Without native bf16, torch widens every bf16 value to fp32 inside the matmul:
`benchmarks/cpu_dtype.py` on the AVX2 dev box measured bf16 1.6-2.8x faster than fp32 for a
decode-sized linear (half the bytes to stream) but 2.1-4.6x slower for a 64-token one, so there
no probe is run and fp32 is the answer (`--dtype bfloat16` remains, for a batch-1 workload).
"""

from __future__ import annotations

import time

import torch

from zeroserve.common.errors import ModelLoadError
from zeroserve.common.log import get_logger
from zeroserve.common.model_config import ModelConfig
from zeroserve.kernels import cpu_native

log = get_logger("worker.dtype")

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}

# the probe's linear: the model's MLP shape, capped so the probe stays a fraction of a second
PROBE_MAX_DIM = 4096
PROBE_WORKING_SET = 256 << 20  # fp32 bytes of weight copies the probe cycles through: past big LLCs
PROBE_TOKENS = (1, 64)  # a decode step's batch of one, a prefill chunk
# bf16 must win decode (where it halves the bytes read) by this much, and not lose prefill by more
BF16_DECODE_GAIN = 0.9
BF16_PREFILL_SLACK = 1.1


def resolve_dtype(
    dtype: str | torch.dtype,
    device: torch.device | str,
    config: ModelConfig | str | None = None,
    quantization: str | None = None,
    probe: bool = True,
) -> torch.dtype:
    """Turn a user dtype name into a torch dtype ("auto": see the module's docstring; a
    quantized model computes in fp32 on a CPU, where its kernels do). `probe=False` (a
    tensor-parallel shard: its peers could time differently, and shards in different dtypes
    cannot all-reduce; the group to agree over forms only later) keeps a CPU's "auto" at fp32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ModelLoadError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if not isinstance(dtype, str):
        raise ModelLoadError(f"dtype must be a string, got {dtype!r}")
    name = dtype.strip().lower().replace("torch.", "")
    if name == "auto":
        cfg_dtype = config.torch_dtype if isinstance(config, ModelConfig) else config
        cfg_dtype = (cfg_dtype or "float32").lower().replace("torch.", "")
        if torch.device(device).type == "cpu":
            if _DTYPE_NAMES.get(cfg_dtype) is not torch.bfloat16 or quantization in ("int8", "int4") or not probe:
                return torch.float32
            return cpu_bf16_or_fp32(config if isinstance(config, ModelConfig) else None)
        return _DTYPE_NAMES.get(cfg_dtype, torch.float32)
    if name not in _DTYPE_NAMES:
        raise ModelLoadError(
            f"unsupported dtype {dtype!r}; use 'auto', 'float32' (float, fp32), 'bfloat16' (bf16) "
            "or 'float16' (half, fp16)"
        )
    return _DTYPE_NAMES[name]


KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_kv_dtype(name: str | None, compute_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype`: "auto" (or None) = the compute dtype; float32 or bfloat16 (half an fp32
    cache's bytes: keys and values rounded to bf16 when written, widened to fp32 when read)."""
    key = (name or "auto").strip().lower().replace("torch.", "")
    key = {"fp32": "float32", "float": "float32", "bf16": "bfloat16"}.get(key, key)
    if key == "auto":
        return compute_dtype
    if key not in KV_CACHE_DTYPES:
        raise ModelLoadError(f"unsupported kv_cache_dtype {name!r}; use 'auto', 'float32' or 'bfloat16'")
    return KV_CACHE_DTYPES[key]


def cpu_bf16_or_fp32(cfg: ModelConfig | None) -> torch.dtype:
    """bf16 where this CPU has it natively and a linear of the model's shape is measurably faster
    in it; fp32 otherwise. The figures are logged: the choice can be checked, and overridden with
    --dtype."""
    if not cpu_native.native_bf16():
        return torch.float32
    rows = min(cfg.intermediate_size if cfg else PROBE_MAX_DIM, PROBE_MAX_DIM)
    cols = min(cfg.hidden_size if cfg else PROBE_MAX_DIM, PROBE_MAX_DIM)
    t = probe_linear(rows, cols)
    fast = (t[torch.bfloat16, 1] <= BF16_DECODE_GAIN * t[torch.float32, 1]
            and t[torch.bfloat16, PROBE_TOKENS[-1]] <= BF16_PREFILL_SLACK * t[torch.float32, PROBE_TOKENS[-1]])
    chosen = torch.bfloat16 if fast else torch.float32
    log.info("dtype auto on a CPU with native bf16", chosen=str(chosen).removeprefix("torch."),
             shape=f"{rows}x{cols}", **{f"{str(d).removeprefix('torch.')}_t{n}_ms": round(s * 1e3, 3)
                                        for (d, n), s in t.items()})
    return chosen


def probe_linear(rows: int, cols: int, tokens: tuple[int, ...] = PROBE_TOKENS,
                 dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
                 budget_s: float = 0.15) -> dict[tuple[torch.dtype, int], float]:
    """Median seconds of `F.linear(x[n, cols], w[rows, cols])` per (dtype, n): a few calls each
    after one warm-up, the keys measured in turn so a noisy host shifts all alike. The weight
    is copied until the copies pass PROBE_WORKING_SET bytes and the calls cycle through them:
    decode streams a whole model's weights from memory, not one linear's from the cache."""
    g = torch.Generator().manual_seed(0)
    w32 = torch.randn(rows, cols, generator=g)
    copies = max(1, -(-PROBE_WORKING_SET // w32.nbytes))
    ws = {d: [w32.to(d, copy=True) for _ in range(copies)] for d in dtypes}
    xs = {(d, n): torch.randn(n, cols, generator=g).to(d) for d in dtypes for n in tokens}
    times: dict[tuple[torch.dtype, int], list[float]] = {k: [] for k in xs}
    for (d, _), x in xs.items():  # warm-up: oneDNN picks and caches its kernel on the first call
        torch.nn.functional.linear(x, ws[d][0])
    deadline, i = time.perf_counter() + budget_s, 0
    while True:
        i += 1
        for k, x in xs.items():
            w = ws[k[0]][i % copies]
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times[k].append(time.perf_counter() - t0)
        if i >= 3 and time.perf_counter() > deadline:
            break
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}
