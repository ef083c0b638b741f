"""One import namespace: everything of ours imports as `zeroserve.*`, beside Hugging Face's
`kernels` (a dependency of transformers since 5.25) and whatever else a user has installed, from
any working directory, installed editable (the suite's own venv) or from a wheel.

Each test starts real processes: the import checks run in a fresh interpreter whose current
directory is the repository root (what `python -m` puts first on sys.path), the `up --demo` checks
run `zeroserve up --demo` from a temporary directory outside the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import free_port_block, no_leftover_processes  # noqa: E402,F401 (fixture)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

OUR_FOLDERS = ("common", "kernels", "services")  # linked into zeroserve/, no __init__.py of their own


def our_modules() -> list[str]:
    """Every module of ours by file (the links under zeroserve/ followed), as `zeroserve.*` names."""
    names = []
    for folder, dirs, files in os.walk(ROOT / "zeroserve", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                rel = (Path(folder) / f).relative_to(ROOT).with_suffix("")
                names.append(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    return sorted(names)


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))


def test_the_links_and_the_folders_are_what_the_packaging_relies_on():
    for name in OUR_FOLDERS:
        link = ROOT / "zeroserve" / name
        assert link.is_symlink() and link.resolve() == ROOT / name, f"zeroserve/{name} must link to {name}/"
        assert not (ROOT / name / "__init__.py").exists(), (
            f"{name}/__init__.py would make {name}/ a regular package that shadows an installed "
            f"'{name}' whenever the repository root is on sys.path")
    assert len(our_modules()) > 80


def test_transformers_and_every_module_of_ours_import_in_one_process_from_the_repository_root():
    """With Hugging Face's `kernels` installed, `python -c` from the repository root (the current
    directory first on sys.path) imports transformers' model classes and every zeroserve module."""
    pytest.importorskip("kernels", reason="Hugging Face's kernels is a test dependency (pyproject.toml)")
    code = f"""
import importlib, sys
from transformers import LlamaForCausalLM, Qwen3MoeForCausalLM  # pulls Hugging Face's kernels in
import kernels
assert getattr(kernels, "__file__", None) and not kernels.__file__.startswith({str(ROOT / "kernels")!r}), kernels
failed = []
for name in {our_modules()!r}:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{{name}}: {{e!r}}")
assert not failed, failed
assert not any(m == n or m.startswith(n + ".") for m in sys.modules for n in {OUR_FOLDERS!r}
               if m != "kernels" and not m.startswith("kernels.")), "a module of ours imported under a bare name"
print("imported", len({our_modules()!r}))
"""
    r = _run([sys.executable, "-c", code], cwd=ROOT, timeout=240, env={"TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^imported \d+$", r.stdout, re.M), r.stdout


def test_no_folder_of_ours_shadows_a_package_of_the_same_name(tmp_path):
    """Packages named like our folders (installed ones stand later on sys.path than the current
    directory) win over the folders when a command runs from the repository root."""
    site = tmp_path / "site"
    for name in OUR_FOLDERS:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"WHO = 'third-party {name}'\n")
    code = "import common, kernels, services; print(common.WHO, kernels.WHO, services.WHO)"
    r = _run([sys.executable, "-c", code], cwd=ROOT, timeout=60, env={"PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["third-party", "common", "third-party", "kernels", "third-party", "services"]


def _demo_answers(zeroserve_cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    port = free_port_block(4)
    r = _run([*zeroserve_cmd, "up", "--demo", "--port", str(port), "--threads", "1", "--num-kv-blocks", "64"],
             cwd=cwd, timeout=300, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert re.search(r"^answer: '", r.stdout, re.M), out[-4000:]
    assert re.search(r"^stopped\.$", r.stdout, re.M), out[-4000:]
    return r.stdout


@pytest.mark.timeout(400)
def test_up_demo_answers_from_a_directory_outside_the_repository(tmp_path):
    script = Path(sys.executable).with_name("zeroserve")
    assert script.exists(), f"the console script is not installed beside {sys.executable}"
    _demo_answers([str(script)], cwd=tmp_path)


@pytest.mark.timeout(900)
def test_a_wheel_declares_only_zeroserve_and_serves_from_a_fresh_venv(tmp_path):
    wheels = tmp_path / "wheels"
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
             cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = wheels.glob("zeroserve-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        top = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert z.read(top).decode().split() == ["zeroserve"]
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"zeroserve"}, sorted(tops)
    for needed in ("zeroserve/services/cli.py", "zeroserve/kernels/csrc/qmatmul.c",
                   "zeroserve/services/gateway/static/chat.html", "zeroserve/services/tiny_corpus.txt"):
        assert needed in names, f"{needed} is missing from the wheel"
    assert len([n for n in names if n.endswith(".py")]) == len(our_modules())

    # a fresh venv gets the wheel (not editable) and borrows the suite's dependencies through a
    # .pth line: a plain path entry, so the suite venv's own editable finder is not loaded
    venv = tmp_path / "venv"
    r = _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    vpy = venv / "bin" / "python"
    r = _run([str(vpy), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(whl)], cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    vsite = Path(_run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                      cwd=tmp_path, timeout=60).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (vsite / "_suite_dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    r = _run([str(vpy), "-c", "import zeroserve.services.cli as c; print(c.__file__)"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().startswith(str(vsite)), r.stdout + r.stderr
    _demo_answers([str(venv / "bin" / "zeroserve")], cwd=tmp_path)
