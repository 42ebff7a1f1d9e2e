"""The shape of the code base (docs/architecture.md, "Imports and layers"): every module sits in a layer of the
table below (the docs' table, mechanised) and imports nothing of a higher layer; no import cycle among the
project's modules (imports inside functions count for both), no private name imported across top-level
packages or between two experiment modules, experiments/ kept thin. Parses the sources with ast: imports
nothing of them."""

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


def _imports(name: str, source: str | None = None, is_package: bool | None = None):
    """(imported module or package, imported name or None) for every import statement of module `name`
    (its file, or `source`), at any depth (function bodies included); relative imports resolved."""
    path = MODULES.get(name, name)
    tree = ast.parse(open(path).read() if source is None else source, path)
    is_package = path.endswith("__init__.py") if is_package is None else is_package
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                yield base, a.name


def _targets(m: str, imports) -> set[str]:
    """The project modules that `imports` (pairs of _imports) of module m reach: `from pkg import mod` -> pkg.mod."""
    out = set()
    for base, name in imports:
        target = f"{base}.{name}" if name and f"{base}.{name}" in MODULES else base if base in MODULES else None
        if target and target != m:
            out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    return {m: _targets(m, _imports(m)) for m in MODULES}


# The layers of docs/architecture.md, bottom up, as (layer, step): a module may import modules of a lower or
# equal (layer, step), never a higher one, at module level or inside a function. An entry names a module (and
# the modules under it, if a package) or, ending in ".*", only the modules under a package; the longest
# entry that matches a module places it. Steps order the parts of one layer that import each other in one
# direction (the train chain, the evaluator below train.loop and the measurements above train.stages).
LAYERS = [
    ((0, 0), ["glm5_jax", "glm5_jax.errors", "glm5_jax.batch", "glm5_jax.chips"]),
    ((1, 0), ["glm5_jax.fields", "glm5_jax.config", "glm5_jax.data.config", "glm5_jax.train.config",
              "glm5_jax.optim.schedules", "glm5_jax.overrides", "glm5_jax.cli", "glm5_jax.intervals",
              "glm5_jax.hugepages"]),
    ((2, 0), ["pallas_kernels", "glm5_jax.utils"]),
    ((3, 0), ["glm5_jax.layers", "glm5_jax.parallel.ep", "glm5_jax.attention", "glm5_jax.losses"]),
    ((4, 0), ["glm5_jax.mtp"]),
    ((4, 1), ["glm5_jax.model"]),
    ((5, 0), ["glm5_jax.flops", "glm5_jax.sharding", "glm5_jax.hf", "glm5_jax.parallel", "glm5_jax.optim.newton_schulz"]),
    ((5, 1), ["glm5_jax.optim"]),
    ((5, 2), ["glm5_jax.quant", "glm5_jax.data.*"]),
    ((5, 3), ["glm5_jax.data", "glm5_jax.data.build", "glm5_jax.infer"]),
    ((5, 4), ["glm5_jax.train.checkpoint", "glm5_jax.train.observe", "glm5_jax.train.preempt"]),
    ((5, 5), ["glm5_jax.train.state"]),
    ((5, 6), ["glm5_jax.train.step", "glm5_jax.eval"]),
    ((5, 7), ["glm5_jax.train.loop"]),
    ((5, 8), ["glm5_jax.train", "glm5_jax.train.stages"]),
    ((5, 9), ["glm5_jax.eval.dsa", "glm5_jax.eval.long_context", "glm5_jax.parallel.plan", "glm5_jax.data.prep",
              "glm5_jax.rl", "glm5_jax.post", "glm5_jax.serve", "glm5_jax.agentic"]),
    ((6, 0), ["experiments", "experiments.registry", "experiments.report"]),
    ((6, 1), ["experiments.*", "tools"]),
    ((6, 2), ["experiments.run", "experiments.sweep"]),
]


def _layer(module: str, layers=LAYERS):
    """(layer, step) of `module` by the longest matching entry of `layers`, None when no entry matches."""
    best, length = None, -1
    for rank, entries in layers:
        for e in entries:
            hit = module.startswith(e[:-1]) if e.endswith(".*") else module == e or module.startswith(e + ".")
            if hit and len(e) > length:
                best, length = rank, len(e)
    return best


def _upward(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """'importer (layer) -> imported (higher layer)' for every import that goes up the table."""
    return [f"{m} {_layer(m, layers)} -> {t} {_layer(t, layers)}" for m in sorted(graph) for t in sorted(graph[m])
            if _layer(m, layers) is not None and _layer(t, layers) is not None and _layer(t, layers) > _layer(m, layers)]


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


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if _layer(m) is None)
    assert not missing, "modules in no layer of LAYERS (place them, and in docs/architecture.md): " + ", ".join(missing)


def test_no_upward_imports():
    up = _upward(_graph())
    assert not up, "imports up the layers of docs/architecture.md (function-level imports count):\n" + "\n".join(up)


def test_the_layer_check_finds_an_upward_import_lazy_or_not():
    """A kernel-layer module importing the train loop inside a function, a layer module importing the model at
    module level: both are reported, with their layers; the same imports downward are not."""
    lazy = "import jax\n\ndef f():\n    from glm5_jax.train.loop import train\n    return train\n"
    top = "from glm5_jax import model\nfrom . import common\n"
    graph = {"glm5_jax.utils": _targets("glm5_jax.utils", _imports("glm5_jax.utils", lazy, False)),
             "glm5_jax.layers.mlp": _targets("glm5_jax.layers.mlp", _imports("glm5_jax.layers.mlp", top, False))}
    assert graph == {"glm5_jax.utils": {"glm5_jax.train.loop"}, "glm5_jax.layers.mlp": {"glm5_jax.model",
                                                                                      "glm5_jax.layers.common"}}
    assert _upward(graph) == ["glm5_jax.layers.mlp (3, 0) -> glm5_jax.model (4, 1)",
                              "glm5_jax.utils (2, 0) -> glm5_jax.train.loop (5, 7)"]
    assert _upward({"glm5_jax.train.loop": {"glm5_jax.utils"}, "glm5_jax.model": {"glm5_jax.layers.mlp"}}) == []
    # the tree itself with one upward import added is caught
    tree = _graph()
    tree["glm5_jax.attention.mla"].add("glm5_jax.train.step")
    assert _upward(tree) == ["glm5_jax.attention.mla (3, 0) -> glm5_jax.train.step (5, 6)"]


def test_no_module_imports_argparse():
    """Every CLI parses absl flags through glm5_jax.cli.run (docs/architecture.md, "Errors and validation")."""
    bad = sorted(m for m in MODULES if any(base.split(".")[0] == "argparse" for base, _ in _imports(m)))
    assert not bad, "argparse imported (use absl flags and glm5_jax.cli.run): " + ", ".join(bad)


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
