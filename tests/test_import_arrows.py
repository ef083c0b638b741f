"""The design's import arrows point down: common <- kernels <- services. Every import statement
of a layer is read from its source (ast), the lazy ones inside functions and the ones under
TYPE_CHECKING included, so no upward arrow hides from an import-time check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a layer and the packages above it, which none of its modules may import
ABOVE = {"common": ("zeroserve.kernels", "zeroserve.services", "kernels", "services"),
         "kernels": ("zeroserve.services", "services")}


def imported(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_no_module_imports_a_layer_above_its_own(layer):
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}"
           for p in sorted((ROOT / layer).rglob("*.py")) for line, name in imported(p)
           if any(name == up or name.startswith(up + ".") for up in ABOVE[layer])]
    assert not bad, bad


def test_the_check_sees_lazy_and_type_checking_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import zeroserve.services.x\n"
                 "def f():\n    from zeroserve.services.worker import y\n")
    assert [n for _, n in imported(f)] == ["typing", "zeroserve.services.x", "zeroserve.services.worker"]
