"""Codec micro-benchmark: protocol v2 (zeroserve.common.codec, msgspec) against v1 (common/protocol.py from git).

Encode + decode round trips of the messages that cross the wire every scheduling step with 256
running requests:

* ``decode_step``: a ``Step`` whose ``CachedRequests`` holds 256 req ids, one new block every 16th
* ``step_result``: the shard's ``StepResult`` with 256 sampled token ids
* ``outputs``: the ``Outputs`` the client gets, 256 ``Output`` items of one token + a text delta
* ``prefill_step``: a ``Step`` with 256 ``NewRequest`` of 128-token prompts (8 blocks, sampling params)

v1 is ``git show <rev>:common/protocol.py`` written to a temporary directory and imported as
``protocol_v1`` (default rev: the last commit that has the file). v1 and v2 repeats are
interleaved (the order alternates) so a noisy machine hurts both alike, and timed in process
CPU time by default (``--clock wall`` for perf_counter), with the garbage collector off while
a sample runs (as timeit does). A v1 round trip leaves
``NewRequest.params`` a plain dict; v2 decodes it into a validated ``SamplingParams``, which the
v1 worker then did with ``decode_params``: the ``prefill_step+params`` row adds that to v1.

    .venv/bin/python benchmarks/codec.py                  # table
    .venv/bin/python benchmarks/codec.py --json           # plus one BENCH_JSON line
    .venv/bin/python benchmarks/codec.py --baseline-rev HEAD~3 --repeats 31 --min-time 0.02
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

import numpy as np  # noqa: E402

from benchmarks.common import json_line, log, print_table  # noqa: E402

N_REQ = 256
PROMPT_LEN = 128
BLOCK_SIZE = 16


# --------------------------------------------------------------------------------------------
# v1 from git
# --------------------------------------------------------------------------------------------


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True)


def baseline_source(rev: str | None) -> tuple[str, str]:
    """(revision, source of common/protocol.py v1). Without ``rev``: HEAD if it has the file,
    else the last commit before it was removed."""
    candidates = [rev] if rev else ["HEAD"]
    if not rev:
        last = _git("rev-list", "-1", "HEAD", "--", "common/protocol.py").stdout.strip()
        if last:
            candidates += [last, f"{last}^"]
    for r in candidates:
        p = _git("show", f"{r}:common/protocol.py")
        if p.returncode == 0:
            if "PROTOCOL_VERSION = 1" not in p.stdout:
                raise SystemExit(f"{r}:common/protocol.py is not protocol v1")
            sha = _git("rev-parse", "--short", r).stdout.strip() or r
            return sha, p.stdout
    raise SystemExit(f"no common/protocol.py at {', '.join(candidates)} (pass --baseline-rev)")


def load_v1(source: str, tmp: Path) -> Any:
    """Write v1 to ``tmp/protocol_v1.py`` and import it under that name (it imports only msgpack,
    numpy and zeroserve.common.errors; the repository root is first on sys.path)."""
    path = tmp / "protocol_v1.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("protocol_v1", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["protocol_v1"] = mod
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------------------------
# workloads: the same content in both versions
# --------------------------------------------------------------------------------------------


def workload_inputs(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    ids = [f"req-{i:06d}-{rng.integers(1 << 30):08x}" for i in range(N_REQ)]
    computed = rng.integers(PROMPT_LEN, 2048, size=N_REQ).astype(np.int32)
    blocks = [[int(rng.integers(0, 1 << 16))] if i % 16 == 0 else [] for i in range(N_REQ)]
    sampled = rng.integers(0, 32000, size=N_REQ).astype(np.int32)
    prompts = [rng.integers(0, 32000, size=PROMPT_LEN).astype(np.int32) for _ in range(N_REQ)]
    new_blocks = [np.arange(i * (PROMPT_LEN // BLOCK_SIZE), (i + 1) * (PROMPT_LEN // BLOCK_SIZE), dtype=np.int32)
                  for i in range(N_REQ)]
    words = ["the", " cat", " sat", " on", " a", " mat", ",", " é", "✓", "\n"]
    texts = [words[int(rng.integers(len(words)))] for _ in range(N_REQ)]
    return dict(ids=ids, computed=computed, blocks=blocks, sampled=sampled, prompts=prompts, new_blocks=new_blocks,
                texts=texts)


def params_for(i: int):
    from zeroserve.common.sampling_params import SamplingParams

    return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=256, seed=i)


def v2_messages(w: dict[str, Any]) -> dict[str, Any]:
    from zeroserve.common import messages as M

    cached = M.CachedRequests.build(w["ids"], w["computed"], np.ones(N_REQ, np.int32), w["blocks"])
    new = [M.NewRequest(req_id=f"new-{i}", token_ids=w["prompts"][i], num_prompt_tokens=PROMPT_LEN,
                        params=params_for(i), seed=i, block_ids=w["new_blocks"][i], num_scheduled_tokens=PROMPT_LEN)
           for i in range(N_REQ)]
    return {
        "decode_step": M.Step(seq=1000, group="g0", cached=cached),
        "step_result": M.StepResult(seq=1000, worker_id="w0", req_ids=w["ids"], sampled_token_ids=w["sampled"],
                                    num_tokens=N_REQ, step_time_s=0.0125),
        "outputs": M.Outputs(items=[M.Output(request_id=w["ids"][i], token_ids=w["sampled"][i:i + 1],
                                             text=w["texts"][i]) for i in range(N_REQ)]),
        "prefill_step": M.Step(seq=1, group="g0", new_reqs=new),
    }


def v1_messages(P: Any, w: dict[str, Any]) -> dict[str, Any]:
    cached = P.CachedRequests.build(w["ids"], w["computed"], np.ones(N_REQ, np.int32), w["blocks"])
    new = [P.NewRequest(req_id=f"new-{i}", token_ids=w["prompts"][i], num_prompt_tokens=PROMPT_LEN,
                        params=P.encode_params(params_for(i)), seed=i, block_ids=w["new_blocks"][i],
                        num_scheduled_tokens=PROMPT_LEN)
           for i in range(N_REQ)]
    return {
        "decode_step": P.Step(seq=1000, group="g0", cached_reqs=cached),
        "step_result": P.StepResult(seq=1000, worker_id="w0", req_ids=w["ids"], sampled_token_ids=w["sampled"],
                                    step_time_s=0.0125),
        "outputs": P.Outputs(items=[P.Output(request_id=w["ids"][i], token_ids=w["sampled"][i:i + 1],
                                             text=w["texts"][i]) for i in range(N_REQ)]),
        "prefill_step": P.Step(seq=1, group="g0", new_reqs=new),
    }


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = time.process_time


def _calibrate(fn: Callable[[], Any], min_time: float) -> int:
    """Calls per timed sample so one sample takes about ``min_time`` seconds."""
    n = 1
    while True:
        t0 = _clock()
        for _ in range(n):
            fn()
        dt = _clock() - t0
        if dt >= min_time / 4 or n >= 1 << 20:
            return max(1, int(n * min_time / max(dt, 1e-9)))
        n *= 4


def _sample(fn: Callable[[], Any], number: int) -> float:
    """Seconds per call; the garbage collector is off while timing (as in timeit)."""
    gc.collect()
    gc.disable()
    try:
        t0 = _clock()
        for _ in range(number):
            fn()
        return (_clock() - t0) / number
    finally:
        gc.enable()


def bench(cases: dict[str, dict[str, Callable[[], Any]]], repeats: int, min_time: float) -> dict[str, dict[str, list]]:
    """cases[name][impl] = fn -> samples[name][impl] = seconds per call, one per repeat; the
    impls of a case alternate their order repeat by repeat."""
    out: dict[str, dict[str, list]] = {}
    for name, impls in cases.items():
        numbers = {k: _calibrate(fn, min_time) for k, fn in impls.items()}
        out[name] = {k: [] for k in impls}
        order = list(impls)
        for r in range(repeats):
            for k in (order if r % 2 == 0 else order[::-1]):
                out[name][k].append(_sample(impls[k], numbers[k]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-rev", default=None,
                    help="git revision to read protocol v1 from (default: HEAD, or the last commit that has it)")
    ap.add_argument("--repeats", type=int, default=15, help="timed samples per message and version")
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds per timed sample")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: process CPU time (default; a busy shared machine barely moves it), wall: perf_counter")
    ap.add_argument("--json", action="store_true", help="also print one BENCH_JSON line")
    args = ap.parse_args(argv)
    global _clock
    _clock = CLOCKS[args.clock]

    from zeroserve.common import codec as C
    from zeroserve.common.sampling_params import SamplingParams

    rev, source = baseline_source(args.baseline_rev)
    with tempfile.TemporaryDirectory(prefix="zeroserve-codec-bench-") as tmp:
        P = load_v1(source, Path(tmp))
    log(f"v1: common/protocol.py at {rev} (PROTOCOL_VERSION {P.PROTOCOL_VERSION}); "
        f"v2: zeroserve.common.codec (PROTOCOL_VERSION {C.PROTOCOL_VERSION})")

    w = workload_inputs()
    m2, m1 = v2_messages(w), v1_messages(P, w)

    # both sides round-trip what they sent, and v1 / v2 carry the same content
    for name in m2:
        a, b = C.decode(C.encode(m2[name])), P.decode(P.encode(m1[name]))
        assert type(a).__name__ == type(b).__name__ == type(m2[name]).__name__, name
    assert C.decode(C.encode(m2["decode_step"])).cached.req_ids == w["ids"]
    assert P.decode(P.encode(m1["decode_step"])).cached_reqs.req_ids == w["ids"]
    assert [o.text for o in C.decode(C.encode(m2["outputs"])).items] == w["texts"]

    def rt2(m):
        return lambda: C.decode(C.encode(m))

    def rt1(m):
        return lambda: P.decode(P.encode(m))

    def rt1_params(m):
        def f():
            step = P.decode(P.encode(m))
            for n in step.new_reqs:
                SamplingParams.from_dict(n.params)
            return step
        return f

    cases: dict[str, dict[str, Callable[[], Any]]] = {name: {"v1": rt1(m1[name]), "v2": rt2(m2[name])} for name in m2}
    cases["prefill_step+params"] = {"v1": rt1_params(m1["prefill_step"]), "v2": rt2(m2["prefill_step"])}
    # encode and decode on their own, for the table's split columns
    for name in m2:
        f1, f2 = P.encode(m1[name]), C.encode(m2[name])
        cases[f"{name}:encode"] = {"v1": (lambda m=m1[name]: P.encode(m)), "v2": (lambda m=m2[name]: C.encode(m))}
        cases[f"{name}:decode"] = {"v1": (lambda f=f1: P.decode(f)), "v2": (lambda f=f2: C.decode(f))}

    t0 = time.perf_counter()
    samples = bench(cases, args.repeats, args.min_time)
    log(f"timed {sum(len(s) for c in samples.values() for s in c.values())} samples in {time.perf_counter() - t0:.1f} s")

    def us(xs: list, how: Callable) -> float:
        return how(xs) * 1e6

    rows, record = [], {"baseline_rev": rev, "n_requests": N_REQ, "prompt_len": PROMPT_LEN, "repeats": args.repeats,
                        "min_time_s": args.min_time, "clock": args.clock, "messages": {}}
    for name in [*m2, "prefill_step+params"]:
        s = samples[name]
        base = name.split("+")[0]
        b1 = sum(memoryview(f).nbytes for f in P.encode(m1[base]))
        b2 = sum(memoryview(f).nbytes for f in C.encode(m2[base]))
        r = {
            "message": name,
            "v1 best us": us(s["v1"], min), "v1 median us": us(s["v1"], statistics.median),
            "v2 best us": us(s["v2"], min), "v2 median us": us(s["v2"], statistics.median),
            "speedup (median)": statistics.median(s["v1"]) / statistics.median(s["v2"]),
            "speedup (best)": min(s["v1"]) / min(s["v2"]),
        }
        if name in m2:
            enc, dec = samples[f"{name}:encode"], samples[f"{name}:decode"]
            r.update({"v1 enc/dec us": f"{us(enc['v1'], statistics.median):.1f}/{us(dec['v1'], statistics.median):.1f}",
                      "v2 enc/dec us": f"{us(enc['v2'], statistics.median):.1f}/{us(dec['v2'], statistics.median):.1f}",
                      "v1 bytes": b1, "v2 bytes": b2})
            record["messages"][name] = {
                **{k: round(v, 2) for k, v in r.items() if isinstance(v, float)},
                "v1_encode_us": round(us(enc["v1"], statistics.median), 2),
                "v1_decode_us": round(us(dec["v1"], statistics.median), 2),
                "v2_encode_us": round(us(enc["v2"], statistics.median), 2),
                "v2_decode_us": round(us(dec["v2"], statistics.median), 2),
                "v1_bytes": b1, "v2_bytes": b2,
            }
        else:
            record["messages"][name] = {k: round(v, 2) for k, v in r.items() if isinstance(v, float)}
        rows.append(r)
    print(f"codec round trip (encode + decode), {N_REQ} requests; v1 = common/protocol.py@{rev}, v2 = zeroserve.common.codec; "
          f"{args.repeats} interleaved samples of >= {args.min_time * 1e3:.0f} ms {args.clock} time each; "
          "speedup = v1 time / v2 time (> 1: v2 faster)")
    print_table(rows)
    if args.json:
        json_line({"benchmark": "codec", **record})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
