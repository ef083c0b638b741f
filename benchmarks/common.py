"""Shared helpers for the benchmarks: seeded workloads, the cached benchmark model, timing and
report printing.

    from benchmarks.common import (bench_model_dir, make_workload, Timer, set_threads,
                                   environment, print_table, json_line)

    model_dir = bench_model_dir()                    # ~30M-param Llama-shaped model, cached
    wl = make_workload(128, seed=0, vocab_size=token_id_limit(model_dir))
    params = wl.sampling_params()                    # greedy, ignore_eos, max_tokens per request
    with Timer() as t:
        outs = llm.generate(wl.prompts, params)
    print(wl.total_output_tokens / t.wall, "tok/s")

Everything here is deterministic given its arguments (workload = f(seed, sizes)), and the model
directory is a pure function of (arch, size, seed, dtype, overrides, tiny_model.py's source), so
every benchmark in a run, and every run on a machine, measures the same thing.

Run a benchmark as `python benchmarks/<name>.py` (or `python -m benchmarks.<name>` from the
repository root). A benchmark script never does `import common` for this module (a package of
that name elsewhere on sys.path would answer, and benchmarks/ on sys.path would make this file
shadow it); it imports `benchmarks.common` after putting the repository root (not benchmarks/)
first on sys.path, which also makes the working tree's `zeroserve` win over an installed copy:

    _ROOT = Path(__file__).resolve().parents[1]
    sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]
    from benchmarks.common import ...
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]


def ensure_repo_on_path() -> None:
    """Repository root first on sys.path (the working tree's `zeroserve`); benchmarks/ itself off
    it (its common.py would shadow any package named `common`)."""
    root, bench = REPO_ROOT.resolve(), (REPO_ROOT / "benchmarks").resolve()
    keep = []
    for p in sys.path:
        try:
            rp = Path(p or ".").resolve()
        except OSError:
            rp = None
        if rp not in (root, bench):
            keep.append(p)
    sys.path[:] = [str(root)] + keep


ensure_repo_on_path()

# --------------------------------------------------------------------------------------- model

# The benchmark model (used when zeroserve.services.tiny_model has no "bench" size): ~30M parameters,
# Llama-shaped (GQA 8q/4kv heads, SwiGLU), vocab 8192.
BENCH_OVERRIDES: dict[str, Any] = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    intermediate_size=1408, vocab_size=8192, max_position_embeddings=4096,
)


def cache_root() -> Path:
    """Where benchmark models live: $ZEROSERVE_BENCH_CACHE, else ~/.cache/zeroserve/bench-models."""
    env = os.environ.get("ZEROSERVE_BENCH_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("ZEROSERVE_CACHE", Path.home() / ".cache" / "zeroserve")) / "bench-models"


def _generator_digest() -> str:
    """Hash of the code and corpus that generate the model, so a changed generator makes a new dir."""
    h = hashlib.sha1()
    for p in (REPO_ROOT / "services" / "tiny_model.py", REPO_ROOT / "services" / "tiny_corpus.txt"):
        if p.exists():
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def bench_model_dir(arch: str = "llama", size: str = "bench", seed: int = 0, dtype: str = "float32",
                    cache_dir: str | os.PathLike | None = None, **overrides: Any) -> Path:
    """A random-weight HF model directory built by zeroserve.services.tiny_model, created once and cached.

    `dtype` is the checkpoint dtype written to config.json (float32 by default, so "auto" is
    fp32 for both zeroserve and transformers). If tiny_model has no `size` (an older tree), the
    "default" size is used with BENCH_OVERRIDES. Safe against concurrent creators (build in a
    private temp dir, then rename)."""
    from zeroserve.services import tiny_model

    cfg_overrides = dict(overrides)
    use_size = size
    if size not in getattr(tiny_model, "SIZES", {}):
        if size != "bench":
            raise ValueError(f"unknown model size {size!r}")
        use_size = "default"
        cfg_overrides = {**BENCH_OVERRIDES, **cfg_overrides}
    cfg_overrides["torch_dtype"] = dtype
    key = json.dumps([arch, size, seed, cfg_overrides, _generator_digest()], sort_keys=True, default=str)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    path = root / f"{arch}-{size}-s{seed}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{path.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tiny_model.make_tiny_model(tmp, arch=arch, seed=seed, size=use_size, **cfg_overrides)
    try:
        tmp.rename(path)
    except OSError:  # another process finished first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def model_summary(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Shape facts from config.json (and the parameter count) for reports."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, L, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nq
    inter = cfg["intermediate_size"]
    per_layer = h * (nq + 2 * nkv) * d + nq * d * h + 3 * h * inter + 2 * h
    params = v * h * (1 if cfg.get("tie_word_embeddings") else 2) + L * per_layer + h
    return {"arch": (cfg.get("architectures") or ["?"])[0], "hidden": h, "layers": L, "heads": nq,
            "kv_heads": nkv, "head_dim": d, "intermediate": inter, "vocab": v, "params": params}


def token_id_limit(model_dir: str | os.PathLike) -> int:
    """Prompt token ids are drawn below this: the tokenizer's vocab (so every id decodes), capped
    by the model's vocab_size."""
    model_dir = Path(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tok = model_dir / "tokenizer.json"
    if tok.is_file():
        from tokenizers import Tokenizer

        vocab = min(vocab, Tokenizer.from_file(str(tok)).get_vocab_size())
    return int(vocab)


# ------------------------------------------------------------------------------------ workload

FIRST_REGULAR_ID = 3  # ids 0..2 are <pad>, <s>, </s> in the tiny models


@dataclass
class Workload:
    """Requests as token-id prompts plus the number of tokens each asks for (greedy, no EOS stop)."""

    prompts: list[list[int]]
    output_lens: list[int]
    seed: int = 0
    spec: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def total_output_tokens(self) -> int:
        """What the throughput figures count: the tokens the requests asked for (sum of max_tokens)."""
        return sum(self.output_lens)

    def sampling_params(self, **extra: Any) -> list:
        """One greedy SamplingParams per request: max_tokens = its output length, ignore_eos."""
        from zeroserve import SamplingParams

        return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **extra) for n in self.output_lens]

    def subset(self, indices: Iterable[int]) -> "Workload":
        idx = list(indices)
        return Workload([self.prompts[i] for i in idx], [self.output_lens[i] for i in idx], self.seed,
                        {**self.spec, "subset": idx})

    def describe(self) -> str:
        pl = [len(p) for p in self.prompts]
        ol = self.output_lens
        return (f"{len(self)} requests (seed {self.seed}): prompts {min(pl)}-{max(pl)} tokens "
                f"(total {sum(pl)}), outputs {min(ol)}-{max(ol)} tokens (total {sum(ol)})")


def make_workload(num_requests: int = 128, seed: int = 0, min_prompt: int = 16, max_prompt: int = 512,
                  min_output: int = 16, max_output: int = 256, vocab_size: int = 4096) -> Workload:
    """Seeded requests: prompt length ~ U[min_prompt, max_prompt], output length ~ U[min_output,
    max_output], token ids ~ U[3, vocab_size). Independent of the torch/numpy RNG state."""
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    if not 1 <= min_prompt <= max_prompt:
        raise ValueError(f"need 1 <= min_prompt ({min_prompt}) <= max_prompt ({max_prompt})")
    if not 1 <= min_output <= max_output:
        raise ValueError(f"need 1 <= min_output ({min_output}) <= max_output ({max_output})")
    if vocab_size <= FIRST_REGULAR_ID:
        raise ValueError(f"vocab_size must be > {FIRST_REGULAR_ID}")
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_requests):
        n = rng.randint(min_prompt, max_prompt)
        prompts.append([rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(n)])
        outs.append(rng.randint(min_output, max_output))
    spec = dict(num_requests=num_requests, min_prompt=min_prompt, max_prompt=max_prompt,
                min_output=min_output, max_output=max_output, vocab_size=vocab_size)
    return Workload(prompts, outs, seed, spec)


# -------------------------------------------------------------------------------------- timing

def system_busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (all cores; Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
    busy = sum(vals[:8]) - vals[3] - (vals[4] if len(vals) > 4 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


class Timer:
    """Wall and process-CPU time of a block: `with Timer() as t: ...; t.wall, t.cpu`.

    On a shared machine the CPU time (all threads of this process) is the steadier figure;
    cpu / wall near the thread count means the threads were busy, far below means waiting.
    `t.others_cpu` is the CPU time every other process on the machine used meanwhile (Linux;
    None elsewhere): more than a few percent of wall x cores means the figures are disturbed.
    Child processes count as "others" (for cluster benchmarks that is their own work)."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.others_cpu: float | None = None

    def __enter__(self) -> "Timer":
        self._s = system_busy_seconds()
        self._w = time.perf_counter()
        self._c = time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._w
        self.cpu = time.process_time() - self._c
        end = system_busy_seconds()
        if self._s is not None and end is not None:
            self.others_cpu = max(0.0, end - self._s - self.cpu)

    def others_share(self) -> float | None:
        """others_cpu as a fraction of the machine's capacity over the block (0..1)."""
        if self.others_cpu is None or self.wall <= 0:
            return None
        return self.others_cpu / (self.wall * (os.cpu_count() or 1))


def apply_omp_wait_policy(mode: str = "auto") -> str:
    """Choose OpenMP's wait policy; call before torch is imported (libgomp reads it once).

    With the cores shared with other processes, torch's default spinning OpenMP threads slow
    down small (decode-sized) ops 5-8x on a 2-core box (measured: a [16,512]x[512,2816] linear
    went from 1.2 ms to 8.6 ms; the whole engine from 77 to 21 tok/s). "passive"/"active" set
    OMP_WAIT_POLICY; "auto" sets PASSIVE only when the 1-min load average is above half the core
    count at the start and the user has not set it; "env" leaves the environment alone. Returns
    what is in effect, for the report."""
    if mode not in ("auto", "passive", "active", "env"):
        raise ValueError(f"omp wait policy must be auto, passive, active or env, got {mode!r}")
    current = os.environ.get("OMP_WAIT_POLICY")
    if "torch" in sys.modules or mode == "env":
        return current or "default"
    if mode in ("passive", "active"):
        os.environ["OMP_WAIT_POLICY"] = mode.upper()
    elif current is None:
        try:
            busy = os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1)
        except OSError:
            busy = False
        if busy:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
            return "PASSIVE (auto: machine busy)"
    return os.environ.get("OMP_WAIT_POLICY") or "default"


def set_threads(n: int | None) -> int:
    """torch intra-op threads for this process (None or 0 = all cores); returns the count used."""
    import torch

    n = n or (os.cpu_count() or 1)
    torch.set_num_threads(n)
    return torch.get_num_threads()


def environment() -> dict[str, Any]:
    """Facts worth printing next to a number: versions, cores, threads, load."""
    import platform

    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
    }
    try:
        from zeroserve.kernels.cpu_native import cpu_model, native_bf16

        info["cpu"], info["native_bf16"] = cpu_model(), native_bf16()
    except Exception:  # noqa: BLE001 - an older tree: no CPU facts
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001 - optional
        pass
    try:
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info


def loadavg() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def contention_warning(info: dict[str, Any]) -> str | None:
    """A line to print when other processes compete for the cores (numbers then swing a lot)."""
    load, cores = info.get("loadavg_1m"), info.get("cpu_count") or 1
    if load is not None and load > 0.5 * cores:
        return (f"WARNING: 1-min load average {load} on {cores} cores before the run: other processes "
                "are using the CPUs; wall-clock figures will be noisy (compare the cpu-s columns too, "
                "or use --threads 1)")
    return None


# ------------------------------------------------------------------------------------- reports

def fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0 or abs(v) >= 100:
            return f"{v:,.1f}"
        return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, file=None) -> None:
    """A plain aligned text table (first column left-aligned, the rest right-aligned)."""
    if not rows:
        return
    cols = list(columns or rows[0].keys())
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

    def line(vals):
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))

    out = file or sys.stdout
    print(line(cols), file=out)
    print(line(["-" * w for w in widths]), file=out)
    for row in cells:
        print(line(row), file=out)


def json_line(record: dict[str, Any], file=None) -> None:
    """One machine-readable line, prefixed so it is easy to grep out of a log: `BENCH_JSON {...}`."""
    print("BENCH_JSON " + json.dumps(record, sort_keys=True, default=str), file=file or sys.stdout, flush=True)


def log(msg: str) -> None:
    """Progress lines go to stderr so stdout stays the report."""
    print(msg, file=sys.stderr, flush=True)


def memory_bandwidth(mb: int = 512) -> tuple[float, float]:
    """(read GB/s from a sum, copy GB/s counting read + write bytes), best of 5: the roofline
    the decode benchmarks print their figures beside."""
    import torch

    a = torch.ones(mb * 2**20 // 4)
    b = torch.empty_like(a)
    best_sum = best_copy = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best_sum = min(best_sum, time.perf_counter() - t)
        t = time.perf_counter()
        b.copy_(a)
        best_copy = min(best_copy, time.perf_counter() - t)
    return a.numel() * 4 / best_sum / 1e9, 2 * a.numel() * 4 / best_copy / 1e9


def free_port() -> int:
    """A free TCP port on the loopback interface (a torch.distributed or ZeroMQ rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, world: int, *args, timeout_s: float = 1800.0) -> list:
    """Run `fn(rank, world, port, *args, queue)` in `world` spawned processes (one rendezvous
    port for all); each puts one result on the queue. Returns the results in rank order (each
    result a dict with a "rank" key)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted((q.get(timeout=timeout_s) for _ in procs), key=lambda x: x["rank"])
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
