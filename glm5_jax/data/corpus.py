"""Corpus: the *.py sources of the running Python's standard library.

* Files are found under `sysconfig.get_paths()["stdlib"]` (or `DataConfig.stdlib_root`),
  skipping any directory whose name is in `DataConfig.exclude_dirs` (test suites such as
  `test/`, `idlelib/idle_test`, `lib2to3/tests`, and `site-packages`).
* The list is sorted by POSIX relative path; `max_files` / `max_bytes` cut that sorted list
  (a prefix), so a capped corpus is always a deterministic subset.
* Held-out split by file: a file is `eval` iff the first 8 bytes of sha256(relpath), read as
  a fraction of 2**64, are < eval_fraction. The split of a file does not depend on the cap.
  If that selects no eval file (tiny capped corpora), the file with the smallest hash is
  moved to eval; if it selects every file, the largest-hash file is kept for train.
* Files that are not valid UTF-8 are skipped (none are in CPython 3.11's stdlib).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
from typing import List, Optional, Sequence, Tuple

from glm5_jax.data.config import DataConfig


@dataclasses.dataclass(frozen=True)
class CorpusFile:
    relpath: str  # POSIX-style path relative to the corpus root
    size: int  # bytes on disk


@dataclasses.dataclass(frozen=True)
class Corpus:
    root: str
    train: Tuple[CorpusFile, ...]
    eval: Tuple[CorpusFile, ...]

    def read(self, f: CorpusFile) -> str:
        with open(os.path.join(self.root, *f.relpath.split("/")), "rb") as fh:
            return fh.read().decode("utf-8")

    def split(self, name: str) -> Tuple[CorpusFile, ...]:
        if name not in ("train", "eval"):
            raise ValueError(f"split={name!r} is invalid; allowed: 'train', 'eval'")
        return self.train if name == "train" else self.eval

    def fingerprint(self, split: Optional[str] = None) -> str:
        """Hash of (python version, relpath, size) of the files of one or both splits."""
        files = {"train": self.train, "eval": self.eval}
        names = ["train", "eval"] if split is None else [split]
        payload = {
            "python": sys.version.split()[0],
            **{n: [[f.relpath, f.size] for f in files[n]] for n in names},
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def file_hash_fraction(relpath: str) -> float:
    """Deterministic value in [0, 1) derived from the relative path (used for the split)."""
    h = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def list_source_files(root: str, exclude_dirs: Sequence[str]) -> List[CorpusFile]:
    """All *.py files under root (excluded dirs pruned), sorted by relative path."""
    excl = set(exclude_dirs)
    out: List[CorpusFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in excl)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = os.path.join(dirpath, name)
            if not os.path.isfile(full):
                continue
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            out.append(CorpusFile(rel, os.path.getsize(full)))
    out.sort(key=lambda f: f.relpath)
    return out


def _is_utf8(root: str, f: CorpusFile) -> bool:
    try:
        with open(os.path.join(root, *f.relpath.split("/")), "rb") as fh:
            fh.read().decode("utf-8")
        return True
    except (UnicodeDecodeError, OSError):
        return False


def load_corpus(cfg: DataConfig) -> Corpus:
    root = cfg.stdlib_root or stdlib_root()
    files = list_source_files(root, cfg.exclude_dirs)
    kept: List[CorpusFile] = []
    total = 0
    for f in files:
        if cfg.max_files is not None and len(kept) >= cfg.max_files:
            break
        if cfg.max_bytes is not None and total >= cfg.max_bytes:
            break
        if not _is_utf8(root, f):
            continue
        kept.append(f)
        total += f.size
    if len(kept) < 2:
        raise ValueError(
            f"corpus under {root!r} has {len(kept)} usable .py files after caps "
            f"(max_files={cfg.max_files}, max_bytes={cfg.max_bytes}); need >= 2"
        )
    fracs = {f.relpath: file_hash_fraction(f.relpath) for f in kept}
    is_eval = {f.relpath: fracs[f.relpath] < cfg.eval_fraction for f in kept}
    if not any(is_eval.values()):
        is_eval[min(kept, key=lambda f: fracs[f.relpath]).relpath] = True
    if all(is_eval.values()):
        is_eval[max(kept, key=lambda f: fracs[f.relpath]).relpath] = False
    train = tuple(f for f in kept if not is_eval[f.relpath])
    ev = tuple(f for f in kept if is_eval[f.relpath])
    return Corpus(root=root, train=train, eval=ev)
