"""No import cycle among writescope's modules (issue 18: scheduler/calibrate imported
engine/llm, which imports calibrate; scheduler/policies and scheduler/roofline imported each
other). The graph is built from the source with ``ast``: every import statement, at module level
or inside a function (a deferred import hides a cycle, it does not remove it), except those
under ``if TYPE_CHECKING:``. A package's implicit import of its parent is not an edge; an explicit
``from writescope.engine import LLM`` is one (to the package's ``__init__``)."""

from __future__ import annotations

import ast
from pathlib import Path

import writescope

ROOT = Path(writescope.__file__).parent


def module_files() -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of the writescope package."""
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _statements(node: ast.AST):
    """Every import statement under ``node``, skipping ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (s for n in child.orelse for s in _statements(ast.Module([n], [])))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _statements(child)


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported writescope module: line of the first such import}}``."""
    mods = module_files()
    graph: dict[str, dict[str, int]] = {}
    for name, f in mods.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for st in _statements(ast.parse(f.read_text(), str(f))):
            if isinstance(st, ast.Import):
                targets = [a.name for a in st.names]
            else:
                base = st.module or ""
                if st.level:  # relative: from the package, up level - 1
                    up = package.split(".")[: len(package.split(".")) - st.level + 1]
                    base = ".".join(up + ([st.module] if st.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in st.names]
            for t in targets:
                if t in mods and t != name:
                    edges.setdefault(t, st.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_graph_sees_the_engines_imports():
    g = import_graph()
    assert {"writescope.engine.runner", "writescope.budget.memory"} <= set(g["writescope.engine.llm"])
    assert "writescope.scheduler.roofline" in g["writescope.scheduler.policies"]
    assert "writescope.scheduler.placement" in g["writescope.scheduler.roofline"]
    assert "writescope.scheduler.policies" in g["writescope.scheduler"]  # a package's __init__ is a module too


def test_cycles_are_found():
    g = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert cycles(g) == [["a", "b", "c"]]


def test_no_import_cycle_among_writescope_modules():
    g = import_graph()
    found = cycles(g)
    where = ["; ".join(f"{m} -> {t} (line {line})" for m in c for t, line in g[m].items() if t in c) for c in found]
    assert not found, "import cycles: " + " | ".join(where)


def test_no_cycle_through_a_package_s_init():
    """Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so those imports are edges
    too. A package whose ``__init__`` imports its own modules makes a harmless cycle inside it
    (Python finishes the package before the module); a cycle that leaves the package is what
    failed once: ``moe.block`` imported ``engine.threads``, whose package imported ``engine.llm``,
    which came back to ``moe`` through the budget, and ``import writescope.scheduler.calibrate`` on its
    own raised ImportError. The engine's and the top package's names are imported on first use."""
    g = import_graph()
    mods = module_files()
    for name in list(g):
        parts = name.split(".")
        for i in range(2, len(parts)):  # the top package below: every module imports it
            ancestor = ".".join(parts[:i])
            if ancestor in mods:
                g[name].setdefault(ancestor, 0)
    package = lambda m: ".".join(m.split(".")[:2])  # noqa: E731 - writescope.<package>
    across = [c for c in cycles(g) if len({package(m) for m in c}) > 1]
    assert not across, across
    assert "writescope.engine" in g["writescope.engine.threads"]  # the implicit edges are there
    # the top package, which every module imports first, imports nothing of its own when it loads
    top = ast.parse((ROOT / "__init__.py").read_text())
    eager = [ast.unparse(st) for st in top.body if isinstance(st, (ast.Import, ast.ImportFrom)) and "writescope" in ast.unparse(st)]
    assert not eager, eager


def test_modules_import_on_their_own():
    """A few modules below the engine, each imported first in a fresh interpreter (the order that
    failed: see test_no_cycle_through_a_package_s_init)."""
    import subprocess
    import sys

    for m in ("writescope.scheduler.calibrate", "writescope.moe.block", "writescope.budget.plan", "writescope.bench.timeline"):
        r = subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True, text=True)
        assert r.returncode == 0, (m, r.stderr[-600:])
