"""The shape of the code base (docs/architecture.md, "Imports and layers"): no import cycle among the project's
modules (imports inside functions count), no private name imported across top-level packages or between
two experiment modules, experiments/ kept thin. Parses the sources with ast: imports nothing of them."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("glm5_jax", "pallas_kernels", "experiments", "tools")
EXPERIMENTS_MAX_LINES = 4200
EXPERIMENT_FILE_MAX_LINES = 450


def _modules() -> dict[str, str]:
    """{dotted module name: path} of every .py file under PACKAGES (a package is its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


MODULES = _modules()


def _imports(name: str):
    """(imported module or package, imported name or None) for every import statement of module `name`,
    at any depth (function bodies included); relative imports resolved."""
    path = MODULES[name]
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                yield base, a.name


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m in MODULES:
        for base, name in _imports(m):
            target = f"{base}.{name}" if name and f"{base}.{name}" in MODULES else base if base in MODULES else None
            if target and target != m:
                graph[m].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
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


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (function-level imports count): " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_private_imports_across_packages_or_between_experiments():
    bad = []
    for m in MODULES:
        for base, name in _imports(m):
            top = base.split(".")[0]
            if not name or top not in PACKAGES or not name.startswith("_") or name.startswith("__"):
                continue
            if top != m.split(".")[0] or m.startswith("experiments."):
                bad.append(f"{m}: from {base} import {name}")
    assert not bad, "private names imported across packages / between experiment modules:\n" + "\n".join(bad)


def test_experiments_stay_thin():
    sizes = {m: sum(1 for _ in open(p)) for m, p in MODULES.items() if m.split(".")[0] == "experiments"}
    big = {m: n for m, n in sizes.items() if n > EXPERIMENT_FILE_MAX_LINES}
    assert sum(sizes.values()) <= EXPERIMENTS_MAX_LINES and not big, (
        f"experiments/: {sum(sizes.values())} lines (at most {EXPERIMENTS_MAX_LINES}); files over "
        f"{EXPERIMENT_FILE_MAX_LINES} lines: {big}")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
