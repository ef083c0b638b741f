"""The benchmark plots in docs/benchmarks.md, from the results kept in benchmarks/results/*.json.

    .venv/bin/python benchmarks/plots.py                  # all plots -> docs/img/bench-*.png
    .venv/bin/python benchmarks/plots.py --results DIR --out DIR
    .venv/bin/python benchmarks/plots.py --import run.log --machine "8-core EPYC, idle" \
        --command "benchmarks/peers.py --concurrency 1,8,32 --json"   # keep a new run

A result file is the record a benchmark prints (`BENCH_JSON {...}` from peers.py, scaleout.py;
the `--json FILE` of serve.py) plus a `provenance` object: date, machine, command, commit, and
`transcribed: true` where the figures were copied from an older README rather than saved by the
benchmark itself. `--import` writes such a file from a benchmark's output. Plots (latest record
of each kind by provenance date, file name breaking ties; older peers runs as history):

- bench-peers-throughput.png: output tok/s by concurrency, zeroserve vs vLLM vs llama.cpp;
- bench-peers-batch1.png: ms per output token at batch 1, every peers run (the spread is the
  shared machine's, so one run alone says little);
- bench-ttft-gateway.png: TTFT outside the cluster through the gateway and through AsyncClient,
  the gateway's share split at its handler; per-request CDFs where a record keeps the samples;
- bench-scaling.png: throughput by worker groups, relative to one group.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "img"
ENGINE_COLORS = {"zeroserve": "#1f77b4", "vllm": "#ff7f0e", "llamacpp": "#2ca02c"}


class ResultError(ValueError):
    """A results file that cannot be read as a benchmark record (the message names the file)."""


def load(results: Path) -> list[dict]:
    out = []
    for p in sorted(results.glob("*.json")):
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ResultError(f"{p}: not JSON ({e})") from None
        if not isinstance(rec, dict):
            raise ResultError(f"{p}: expected a JSON object")
        prov = rec.get("provenance")
        if not isinstance(prov, dict) or not all(prov.get(k) for k in ("date", "machine", "command")):
            raise ResultError(f"{p}: needs provenance with date, machine and command")
        rec.setdefault("benchmark", "serve" if "results" in rec and "args" in rec else None)
        rec["_file"] = p.name
        out.append(rec)
    return out


def _latest(recs: list[dict], kind: str) -> list[dict]:
    """Records of one benchmark, oldest first."""
    return sorted((r for r in recs if r.get("benchmark") == kind), key=lambda r: (r["provenance"]["date"], r["_file"]))


def _color(engine: str) -> str:
    return next((c for k, c in ENGINE_COLORS.items() if engine.startswith(k)), "#7f7f7f")


def _caption(fig, rec: dict) -> None:
    p = rec["provenance"]
    fig.text(0.01, 0.01, f"latest: {p['date'][:10]}, {p['machine']}" + (" (transcribed)" if p.get("transcribed") else "")
             + "\n* = transcribed from an older README; each run's machine: benchmarks/results/", fontsize=7,
             color="#555555")


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version stamp: reruns differ only in data
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _run_label(rec: dict) -> str:
    p = rec["provenance"]
    return f"{p['date'][:10]}\n{p.get('commit') or rec['_file'].rsplit('-', 1)[-1][:-5]}" + ("*" if p.get("transcribed") else "")


def plot_peers_throughput(recs: list[dict], out: Path) -> Path | None:
    runs = _latest(recs, "peers")
    if not runs:
        return None
    import matplotlib.pyplot as plt

    rec = runs[-1]
    engines = [n for n, e in rec["engines"].items() if e.get("ok") and e.get("tok_s")]
    levels = sorted({int(k) for n in engines for k in rec["engines"][n]["tok_s"]})
    fig, (ax, hist) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 1.3]})
    width = 0.8 / max(1, len(engines))
    for i, n in enumerate(engines):
        ys = [rec["engines"][n]["tok_s"].get(str(c)) for c in levels]
        xs = [j + i * width for j, y in enumerate(ys) if y is not None]
        bars = ax.bar(xs, [y for y in ys if y is not None], width, label=n, color=_color(n))
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(levels))], [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s (higher is better)")
    ax.set_title(f"Latest run: {_run_label(rec).replace(chr(10), ' ')}", fontsize=10)
    ax.legend(fontsize=8)
    top = str(max(levels))  # the history: the highest level every run measured
    for n in sorted({n for r in runs for n in r["engines"]}):
        hist.plot(range(len(runs)), [r["engines"].get(n, {}).get("tok_s", {}).get(top) for r in runs], "o-",
                  label=n, color=_color(n))
    hist.set_xticks(range(len(runs)), [_run_label(r) for r in runs], fontsize=7)
    hist.set_ylim(bottom=0)
    hist.set_title(f"Every run at {top} concurrent (the spread is the shared machine's)", fontsize=10)
    fig.suptitle(f"Throughput on {rec.get('model', 'the model')}: zeroserve vs vLLM vs llama.cpp")
    _caption(fig, rec)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, out / "bench-peers-throughput.png")


def plot_peers_batch1(recs: list[dict], out: Path) -> Path | None:
    runs = _latest(recs, "peers")
    if not runs:
        return None
    import matplotlib.pyplot as plt

    engines = sorted({n for r in runs for n, e in r["engines"].items() if e.get("batch1_ms_per_token")})
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [_run_label(r) for r in runs]
    for n in engines:
        ys = [r["engines"].get(n, {}).get("batch1_ms_per_token") for r in runs]
        ax.plot(range(len(runs)), ys, "o-", label=n, color=_color(n))
    ax.set_xticks(range(len(runs)), labels, fontsize=7)
    ax.set_ylabel("ms per output token at batch 1 (lower is better)")
    ax.set_ylim(bottom=0)
    ax.set_title("Batch-1 latency, every peers run (one after another per run)")
    ax.legend(fontsize=8)
    _caption(fig, runs[-1])
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, out / "bench-peers-batch1.png")


def plot_ttft_gateway(recs: list[dict], out: Path) -> Path | None:
    runs = _latest(recs, "serve")
    if not runs:
        return None
    import matplotlib.pyplot as plt

    samples = [r for r in runs if any(isinstance(m.get("ttft_outside_samples_ms"), list) for m in r["results"])]
    if samples:  # per-request samples: the whole distribution
        rec = samples[-1]
        fig, ax = plt.subplots(figsize=(7, 4))
        for m in rec["results"]:
            xs = sorted(m.get("ttft_outside_samples_ms") or [])
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=m["mode"])
        ax.set_xlabel("TTFT outside the cluster (ms)")
        ax.set_ylabel("fraction of requests")
        ax.legend(fontsize=8)
        ax.set_title("TTFT through the gateway (http) and AsyncClient (direct)")
        _caption(fig, rec)
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        return _save(fig, out / "bench-ttft-gateway.png")
    # medians (and p99 where kept) per run: before the gateway's handler, in it, and the direct path
    fig, ax = plt.subplots(figsize=(7.5, 4))
    labels, y, seen = [], 0, set()

    def once(label: str) -> str | None:  # one legend entry per kind of bar
        return None if label in seen or seen.add(label) else label
    for rec in runs:
        by = {m["mode"]: m for m in rec["results"]}
        h, d = by.get("http", {}), by.get("direct", {})
        nice = (rec.get("args") or {}).get("gateway_nice") or 0
        name = f"{rec.get('model') or (rec.get('args') or {}).get('launch')} {rec['provenance']['date'][:10]}"
        name += (f" nice {nice}" if nice else "") + ("*" if rec["provenance"].get("transcribed") else "")
        pre, hand = h.get("median_ttft_pre_handler_ms"), h.get("median_ttft_handler_ms")
        if pre is not None and hand is not None:
            ax.barh(y, pre, color="#d62728", label=once("http: before the gateway's handler"))
            ax.barh(y, hand, left=pre, color="#ff9896", label=once("http: in the handler"))
        elif h.get("median_ttft_outside_ms") is not None:
            ax.barh(y, h["median_ttft_outside_ms"], color="#d62728", label=once("http"))
        if h.get("p99_ttft_outside_ms") is not None:
            ax.plot(h["p99_ttft_outside_ms"], y, "k|", markersize=14, label=once("p99"))
        if d.get("median_ttft_outside_ms") is not None:
            ax.barh(y + 0.4, d["median_ttft_outside_ms"], height=0.35, color="#1f77b4",
                    label=once("direct (AsyncClient)"))
        labels.append((y + 0.2, name))
        y += 1.2
    ax.set_yticks([p for p, _ in labels], [n for _, n in labels], fontsize=8)
    ax.set_xlabel("median TTFT outside the cluster (ms; lower is better)")
    ax.set_title("What the client path adds to time-to-first-token")
    ax.set_xlim(0, ax.get_xlim()[1] * 1.5)  # room for the legend beside the bars
    ax.legend(fontsize=7, loc="lower right")
    _caption(fig, runs[-1])
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, out / "bench-ttft-gateway.png")


def plot_scaling(recs: list[dict], out: Path) -> Path | None:
    runs = _latest(recs, "scaleout")
    if not runs:
        return None
    import matplotlib.pyplot as plt

    rec = runs[-1]
    # scaleout.py's record: phases of 1 and 2 groups; a record may carry more as {"groups": {n: tok_s}}
    groups = {int(k): v for k, v in (rec.get("groups") or {}).items()}
    rel = {n: v / groups[1] for n, v in groups.items()} if 1 in groups else {1: 1.0, 2: rec["ratio"]}
    ns = sorted(rel)
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar([str(n) for n in ns], [rel[n] for n in ns], color="#1f77b4", label="measured")
    ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax.plot([str(n) for n in ns], ns, "k--", linewidth=1, label="linear")
    ax.set_xlabel("worker groups")
    ax.set_ylabel("throughput relative to one group")
    ax.set_title("Scaling by worker groups" + (" (groups share the cores)" if rec.get("contention_limited") else ""))
    ax.legend(fontsize=8)
    _caption(fig, rec)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, out / "bench-scaling.png")


PLOTS = (plot_peers_throughput, plot_peers_batch1, plot_ttft_gateway, plot_scaling)


def make_all(results: Path = RESULTS, out: Path = OUT) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    recs = load(results)
    out.mkdir(parents=True, exist_ok=True)
    return [p for f in PLOTS if (p := f(recs, out)) is not None]


def import_record(src: Path, results: Path, machine: str, command: str) -> Path:
    """A benchmark's output (a log with a BENCH_JSON line, or serve.py's --json file) as a results file."""
    text = src.read_text(encoding="utf-8")
    lines = [ln[len("BENCH_JSON "):] for ln in text.splitlines() if ln.startswith("BENCH_JSON ")]
    try:
        rec = json.loads(lines[-1] if lines else text)
    except json.JSONDecodeError as e:
        raise ResultError(f"{src}: no BENCH_JSON line and not a JSON file ({e})") from None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    today = date.today().isoformat()
    rec["provenance"] = {"transcribed": False, "source": str(src.name), "date": today, "machine": machine,
                         "commit": commit, "command": command}
    kind = rec.get("benchmark") or ("serve" if "results" in rec else "result")
    dst = results / f"{kind}-{today}-{commit or 'local'}.json"
    dst.write_text(json.dumps(rec, indent=1, default=str) + "\n", encoding="utf-8")
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of result files (default %(default)s)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder the PNGs go to (default %(default)s)")
    ap.add_argument("--import", dest="import_", type=Path, metavar="FILE",
                    help="keep a benchmark's output (BENCH_JSON log or serve.py --json file) as a results file")
    ap.add_argument("--machine", help="with --import: the machine it ran on (cores, CPU, load)")
    ap.add_argument("--command", help="with --import: the exact command that produced it")
    args = ap.parse_args(argv)
    try:
        if args.import_:
            if not (args.machine and args.command):
                ap.error("--import needs --machine and --command (a figure without them cannot be compared)")
            print(import_record(args.import_, args.results, args.machine, args.command))
        for p in make_all(args.results, args.out):
            print(p)
    except ResultError as e:
        print(f"plots.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
