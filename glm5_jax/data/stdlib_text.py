"""Real English text that ships with every Python: the docstrings of the standard library.

`write_stdlib_docs(path)` writes one document per stdlib module (its module, class and function
docstrings, each after a line naming it) as jsonl(.gz) or parquet, with fields "text" and "source". It
is the pre-training default on a fresh machine (nothing to download) and the "real text that no one
here wrote" of the data tests. Modules are read with `ast` (never imported); files that are not
UTF-8 or do not parse, and modules without docstrings, are skipped.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
from typing import Iterator, Optional, Sequence

from glm5_jax.data.config import DEFAULT_EXCLUDE_DIRS
from glm5_jax.data.corpus import stdlib_root
from glm5_jax.data.sources import walk_files

_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def module_docstrings(source: str, module: str) -> Optional[str]:
    """The docstrings of a module's source, each after a `name:` line, separated by blank lines."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    parts = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _NODES[1:]):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child, clean=True)
                if doc:
                    parts.append(f"{name}:\n{doc}")
                visit(child, name)

    doc = ast.get_docstring(tree, clean=True)
    if doc:
        parts.append(f"{module}:\n{doc}")
    visit(tree, module)
    return "\n\n".join(parts) if parts else None


def stdlib_docs(root: Optional[str] = None, exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE_DIRS,
                max_files: Optional[int] = None) -> Iterator[dict]:
    """{"text", "source"} per stdlib module with docstrings, in relative-path order."""
    root = root or stdlib_root()
    paths = sorted(walk_files(root, exclude_dirs, (".py",)), key=lambda p: os.path.relpath(p, root))
    for p in paths[:max_files]:
        rel = os.path.relpath(p, root).replace(os.sep, "/")
        try:
            with open(p, encoding="utf-8") as fh:
                src = fh.read()
        except (UnicodeDecodeError, OSError):
            continue
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        text = module_docstrings(src, module)
        if text:
            yield {"text": text, "source": rel}


def write_stdlib_docs(path: str, **kw) -> dict:
    """Write stdlib_docs(**kw) to `path` (.jsonl, .jsonl.gz or .parquet, atomically); returns
    {"documents", "bytes"} (text bytes)."""
    docs = list(stdlib_docs(**kw))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": [d["text"] for d in docs], "source": [d["source"] for d in docs]}), tmp)
    elif path.endswith((".jsonl", ".jsonl.gz")):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(tmp, "wt", encoding="utf-8") as fh:
            for d in docs:
                fh.write(json.dumps(d, ensure_ascii=False) + "\n")
    else:
        raise ValueError(f"path={path!r}: allowed extensions .jsonl, .jsonl.gz, .parquet")
    os.replace(tmp, path)
    return {"documents": len(docs), "bytes": sum(len(d["text"].encode("utf-8")) for d in docs)}
