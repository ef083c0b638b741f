"""The import graph of our packages: no cycle, and no arrow that points up the layers.

Every module of ours (common/, kernels/, services/, zeroserve/*.py, under their `zeroserve.*`
names) is parsed with `ast`; every import counts: top-level, inside functions (lazy) and under
`TYPE_CHECKING`. `from P import n` is an import of module P.n when that is one of ours, else of
P; `from zeroserve import Client` follows zeroserve/__init__.py's lazy `__getattr__` to the
module it loads. The layers (docs/architecture.md, "Layers"), lowest first:

    common                      protocol, config, tokenizer; no torch
    kernels                     -> common
    worker, scheduler, detokenizer, backend_peer, tiny_model, the client library
                                -> common (the worker: kernels; worker and detokenizer: backend_peer)
    engine (LLM's in-process cluster), gateway
                                -> the services / the client library below them
    zeroserve.llm, zeroserve/__init__.py (the public API)
    cli, launcher, prepare_model, config_docs (the commands)

A room imports itself and the rooms it lists in ROOMS, nothing else.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"common": "zeroserve.common", "kernels": "zeroserve.kernels", "services": "zeroserve.services"}

# room -> (its module prefixes, the rooms it may import)
ROOMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "common": (("zeroserve.common",), ()),
    "kernels": (("zeroserve.kernels",), ("common",)),
    "peer": (("zeroserve.services.backend_peer",), ("common",)),
    "worker": (("zeroserve.services.worker",), ("common", "kernels", "peer")),
    "scheduler": (("zeroserve.services.scheduler",), ("common",)),
    "detokenizer": (("zeroserve.services.detokenizer",), ("common", "peer")),
    "test-models": (("zeroserve.services.tiny_model",), ("common",)),
    "client": (("zeroserve.client", "zeroserve.sync_client", "zeroserve.streams", "zeroserve.liveness",
                "zeroserve._request"), ("common",)),
    "engine": (("zeroserve.services.engine",), ("common", "worker", "scheduler", "detokenizer")),
    "gateway": (("zeroserve.services.gateway",), ("common", "client")),
    "api": (("zeroserve.llm", "zeroserve"), ("common", "client", "engine", "test-models")),
    "commands": (("zeroserve.services.cli", "zeroserve.services.launcher", "zeroserve.services.prepare_model",
                  "zeroserve.services.config_docs"),
                 ("common", "kernels", "peer", "worker", "scheduler", "detokenizer", "test-models", "client",
                  "engine", "gateway", "api")),
}

KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def our_modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in FOLDERS.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([pkg, *parts])] = f
    for f in (ROOT / "zeroserve").glob("*.py"):
        mods["zeroserve" if f.stem == "__init__" else f"zeroserve.{f.stem}"] = f
    return mods


def lazy_exports(tree: ast.Module) -> dict[str, str]:
    """A package's `__getattr__`: `if name == "X": from M import X` -> {"X": "M"}."""
    out = {}
    for fn in tree.body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__"):
            continue
        for node in ast.walk(fn):
            if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                    and isinstance(node.test.comparators[0], ast.Constant)):
                for imp in node.body:
                    if isinstance(imp, ast.ImportFrom):
                        out[node.test.comparators[0].value] = imp.module
    return out


def import_graph() -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    """module -> {imported module of ours: first line}."""
    mods = our_modules()
    trees = {m: ast.parse(f.read_text(), str(f)) for m, f in mods.items()}
    lazy = {m: lazy_exports(t) for m, t in trees.items() if mods[m].name == "__init__.py"}

    def ours(name: str | None) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for m, tree in trees.items():
        is_pkg = mods[m].name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [ours(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module
                if node.level:  # relative: from the importer's package
                    pkg = m.split(".") if is_pkg else m.split(".")[:-1]
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in mods:
                        targets.append(sub)
                    elif a.name in lazy.get(base, {}):
                        targets.append(ours(lazy[base][a.name]))
                    else:
                        targets.append(ours(base))
            for t in targets:
                if t is not None and t != m:
                    graph.setdefault(m, {}).setdefault(t, node.lineno)
    return graph, mods


def room_of(module: str) -> str | None:
    best, best_len = None, -1
    for room, (prefixes, _) in ROOMS.items():
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = room, len(p)
    return best


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph.get(w, ()))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _graph_without_exceptions():
    graph, mods = import_graph()
    for a, b in KNOWN_EXCEPTIONS:
        graph.get(a, {}).pop(b, None)
    return graph, mods


def _where(mods: dict[str, Path], m: str, line: int) -> str:
    return f"{mods[m].relative_to(ROOT)}:{line}"


def test_the_graph_sees_our_modules_and_every_module_has_a_room():
    graph, mods = import_graph()
    assert len(mods) > 80 and "zeroserve.services.scheduler.cluster" in mods
    # lazy and TYPE_CHECKING imports are read too
    assert "zeroserve.services.worker.model.post_norm" in graph["zeroserve.services.worker.model.llama"]
    assert graph["zeroserve.services.scheduler.cluster"].get("zeroserve.common.config")
    homeless = sorted(m for m in mods if room_of(m) is None)
    assert not homeless, f"modules in no room (add them to ROOMS in {Path(__file__).name}): {homeless}"
    for a, b in KNOWN_EXCEPTIONS:  # an exception that no longer exists must go
        assert b in graph.get(a, {}), f"known exception {a} -> {b} is gone: remove it from KNOWN_EXCEPTIONS"


def test_no_import_cycles():
    graph, mods = _graph_without_exceptions()
    found = cycles(graph)
    lines = []
    for comp in found:
        members = set(comp)
        lines.append("cycle: " + ", ".join(comp))
        lines += [f"    {a} -> {b} ({_where(mods, a, graph[a][b])})"
                  for a in comp for b in sorted(graph.get(a, {})) if b in members]
    assert not found, "\n" + "\n".join(lines)


def test_no_arrow_points_up_the_layers():
    graph, mods = _graph_without_exceptions()
    bad = []
    for a, targets in sorted(graph.items()):
        ra = room_of(a)
        allowed = {ra, *ROOMS[ra][1]}
        for b, line in sorted(targets.items()):
            rb = room_of(b)
            if rb not in allowed:
                bad.append(f"{a} ({ra}) -> {b} ({rb}) at {_where(mods, a, line)}")
    assert not bad, "imports that point up (or sideways) the layers:\n" + "\n".join(bad)


def test_llm_runs_the_clusters_lifecycle_not_one_of_its_own():
    """The in-process engine drives the scheduler's Cluster, the worker's runner and the
    detokenizer's state; it builds no policy, fan-out or detokenizer of its own."""
    graph, _ = import_graph()
    engine = graph["zeroserve.services.engine"]
    for own in ("zeroserve.services.scheduler.cluster", "zeroserve.services.worker.model_runner",
                "zeroserve.services.detokenizer.state"):
        assert own in engine, own
    for second in ("zeroserve.common.detokenize", "zeroserve.services.scheduler.policy",
                   "zeroserve.services.scheduler.block_manager", "zeroserve.services.scheduler.admission"):
        assert second not in engine, f"services/engine.py imports {second}: the lifecycle lives in the cluster's state"


if __name__ == "__main__":  # print the graph room to room
    g, _ = import_graph()
    pairs = sorted({(room_of(a), room_of(b)) for a, ts in g.items() for b in ts if room_of(a) != room_of(b)})
    for a, b in pairs:
        print(f"{a} -> {b}")
