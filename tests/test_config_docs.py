"""docs/configuration.md is generated from the parser; these tests fail when it drifts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from zeroserve.common import config
from zeroserve.services import config_docs

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
REGEN = "python -m zeroserve.services.config_docs > docs/configuration.md"


def test_committed_reference_matches_the_flags():
    assert DOC.read_text(encoding="utf-8") == config_docs.render(), f"docs/configuration.md is stale: run {REGEN}"


def test_every_flag_has_help_text():
    assert config_docs.undocumented() == [], "flags without help text (add help= where they are defined)"


def test_every_knob_of_every_config_is_listed():
    text = DOC.read_text(encoding="utf-8")
    classes = [config.SchedulerConfig, config.WorkerArgs, config.GatewayArgs, config.DetokenizerArgs,
               config.EngineArgs, config.LaunchArgs, config.ClientArgs, config.MetricsArgs, config.ThreadArgs]
    missing = sorted({k.flag for cls in classes for k in config.knobs(cls) if f"`{k.flag}`" not in text})
    assert missing == []


def test_reference_ignores_the_callers_environment(monkeypatch):
    # a ZEROSERVE_* variable becomes a flag's default in the parser; the reference must not show it
    monkeypatch.setenv("ZEROSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("ZEROSERVE_MODEL", "/somewhere/else")
    assert config_docs.render() == DOC.read_text(encoding="utf-8")


def test_check_flag_reports_a_stale_file(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(config_docs.render().replace("`--max-num-seqs`", "`--max-seqs`"), encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "zeroserve.services.config_docs", "--check", str(stale)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "out of date" in r.stderr
    stale.write_text(config_docs.render(), encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "zeroserve.services.config_docs", "--check", str(stale)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_other_variables_are_read_where_the_reference_says():
    for var, _, where in config_docs.OTHER_ENV:
        assert var in (ROOT / where).read_text(encoding="utf-8"), f"{var} is not read in {where} any more"
