"""One generation path (issue 65): the paged runtime (glm5_jax/infer) is the only code that runs the model to
generate. Everything outside glm5_jax/infer (the package, tools, experiments) reaches generation through
its public names (`infer.generate`, `PagedRuntime`, the serving engine, `RolloutEngine`), so:

* no module outside glm5_jax/infer imports a private name of glm5_jax.infer (``from glm5_jax.infer.x
  import _y``, or ``module._y`` on an imported glm5_jax.infer module);
* no module outside glm5_jax/infer imports the per-token pieces a generation loop is built of (the dense
  decode step, the trunk step, the MTP block, the samplers, the speculative step);
* infer.decode has no decode loop left (``_decode_loop``), and its ``generate`` is the runtime's driver.

Static (ast), so it runs in well under a second.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEP_PIECES = {"decode_step", "_decode_step", "model_step", "mtp_block", "sample", "sample_rows", "filter_logits",
               "speculative_step", "_decode_loop", "paged_step"}


def _modules():
    for top in ("glm5_jax", "tools", "experiments"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith("glm5_jax/infer/"):
                yield rel, ast.parse(path.read_text(), filename=rel)


def _infer_imports(tree):
    """(imported names from glm5_jax.infer*, local names bound to glm5_jax.infer* modules)."""
    names, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("glm5_jax.infer"):
            for a in node.names:
                names.append((node.lineno, node.module, a.name))
                if node.module == "glm5_jax.infer" or a.name[:1].islower():
                    modules.add(a.asname or a.name)        # possibly a submodule (from glm5_jax.infer import decode)
        elif isinstance(node, ast.ImportFrom) and node.module == "glm5_jax":
            modules.update(a.asname or a.name for a in node.names if a.name == "infer")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("glm5_jax.infer"):
                    modules.add(a.asname or a.name)
    return names, modules


def test_no_private_name_of_infer_is_used_outside_it():
    bad = []
    for rel, tree in _modules():
        names, modules = _infer_imports(tree)
        bad += [f"{rel}:{line}: from {mod} import {name}" for line, mod, name in names if name.startswith("_")]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in modules):
                bad.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "private names of glm5_jax.infer used outside it:\n" + "\n".join(bad)


def test_no_generation_loop_pieces_outside_infer():
    bad = []
    for rel, tree in _modules():
        names, modules = _infer_imports(tree)
        bad += [f"{rel}:{line}: from {mod} import {name}" for line, mod, name in names if name in STEP_PIECES]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in STEP_PIECES and isinstance(node.value, ast.Name)
                    and node.value.id in modules):
                bad.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, ("generation outside the runtime (use infer.generate, PagedRuntime, the serving engine or "
                     "RolloutEngine):\n" + "\n".join(bad))


def test_infer_generate_is_the_runtime_driver():
    import glm5_jax.infer as infer
    from glm5_jax.infer import decode, generation

    assert infer.generate is generation.generate
    assert not hasattr(decode, "_decode_loop") and not hasattr(decode, "generate")
    src = (ROOT / "glm5_jax/infer/generation.py").read_text()
    assert "PagedRuntime" in src and "while_loop" not in src
