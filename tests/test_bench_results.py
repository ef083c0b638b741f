"""benchmarks/plots.py makes its PNGs from the kept results; bad result files get a clear error."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# loaded by path: putting benchmarks/ on sys.path would let its common.py shadow the common package
_spec = importlib.util.spec_from_file_location("bench_plots", ROOT / "benchmarks" / "plots.py")
plots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plots)

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


def test_plots_command_makes_every_plot(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/plots.py", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    names = {"bench-peers-throughput.png", "bench-peers-batch1.png", "bench-ttft-gateway.png", "bench-scaling.png"}
    assert {p.name for p in tmp_path.iterdir()} == names
    for n in names:
        assert (tmp_path / n).read_bytes()[:8] == PNG


def test_every_kept_result_says_where_it_came_from():
    recs = plots.load(RESULTS)
    assert {r["benchmark"] for r in recs} >= {"peers", "serve", "scaleout"}
    for r in recs:
        p = r["provenance"]
        assert p["date"][:4].isdigit() and p["machine"] and p["command"], r["_file"]
        if p.get("transcribed"):
            assert p.get("source"), f"{r['_file']}: a transcribed figure names its source"


def test_a_result_without_provenance_is_refused(tmp_path):
    (tmp_path / "peers-x.json").write_text(json.dumps({"benchmark": "peers", "engines": {}}))
    with pytest.raises(plots.ResultError, match="peers-x.json: needs provenance"):
        plots.load(tmp_path)
    (tmp_path / "peers-x.json").write_text("{not json")
    with pytest.raises(plots.ResultError, match="not JSON"):
        plots.load(tmp_path)


def test_import_keeps_a_bench_json_line_and_plots_it(tmp_path):
    log = tmp_path / "run.log"
    rec = {"benchmark": "peers", "model": "m", "engines": {
        "zeroserve-q4_1": {"ok": True, "batch1_ms_per_token": 15.0, "tok_s": {"1": 60.0, "8": 90.0, "32": 110.0}},
        "vllm-fp32": {"ok": True, "batch1_ms_per_token": 60.0, "tok_s": {"1": 15.0, "8": 70.0, "32": 100.0}}}}
    log.write_text("progress...\nBENCH_JSON " + json.dumps(rec) + "\n")
    results = tmp_path / "results"
    results.mkdir()
    dst = plots.import_record(log, results, machine="test box", command="peers.py --json")
    kept = json.loads(dst.read_text())
    assert kept["engines"] == rec["engines"]
    assert kept["provenance"]["machine"] == "test box" and kept["provenance"]["transcribed"] is False
    out = plots.make_all(results, tmp_path / "img")
    assert {p.name for p in out} == {"bench-peers-throughput.png", "bench-peers-batch1.png"}


def test_import_needs_machine_and_command(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/plots.py", "--import", str(tmp_path / "x.log"),
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--machine and --command" in r.stderr
