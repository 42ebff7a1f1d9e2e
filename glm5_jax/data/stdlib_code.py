"""Real code that ships with every Python: the standard library's modules without their docstrings.

`write_stdlib_code(path)` writes one jsonl document per stdlib module ({"text", "source"}): the module's
code with its module / class / function docstrings removed (`strip_docstrings`), so that a mixture of
it with glm5_jax.data.stdlib_text's docstrings never trains on a held-out docstring as code. Beside
`write_stdlib_docs`, the two sources of the `pretrain` experiment's default "docs+code" mixture.
"""

from __future__ import annotations

import ast
import json
import os
from typing import Optional

from glm5_jax.data.config import DEFAULT_EXCLUDE_DIRS
from glm5_jax.data.corpus import stdlib_root
from glm5_jax.data.sources import walk_files

__all__ = ["strip_docstrings", "write_stdlib_code"]


def strip_docstrings(source: str) -> Optional[str]:
    """A module's code without its module / class / function docstrings (ast.unparse: comments and
    formatting are normalised too); None if it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    try:
        return ast.unparse(tree)
    except (ValueError, RecursionError):
        return None


def write_stdlib_code(path: str, max_bytes: int = 2_000_000) -> dict:
    """The code of the stdlib modules (relative-path order, tests excluded) without docstrings, one jsonl
    document per module ({"text", "source"}), until max_bytes of text; written atomically. Returns
    {"documents", "bytes"}."""
    root = stdlib_root()
    paths = sorted(walk_files(root, DEFAULT_EXCLUDE_DIRS, (".py",)), key=lambda p: os.path.relpath(p, root))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    n = size = 0
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        for p in paths:
            if size >= max_bytes:
                break
            try:
                with open(p, encoding="utf-8") as src:
                    code = strip_docstrings(src.read())
            except (UnicodeDecodeError, OSError):
                continue
            if code and code.strip():
                rel = os.path.relpath(p, root).replace(os.sep, "/")
                fh.write(json.dumps({"text": code, "source": rel}, ensure_ascii=False) + "\n")
                n, size = n + 1, size + len(code.encode("utf-8"))
    os.replace(path + ".tmp", path)
    return {"documents": n, "bytes": size}
