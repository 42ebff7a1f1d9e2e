"""Small helpers for the on-disk caches: settings hashing and atomic directory publish."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Callable


def settings_key(settings: Any) -> str:
    """16 hex chars of sha256 over the canonical JSON of `settings`."""
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def build_dir_atomically(final_dir: str, marker: str, build: Callable[[str], None]) -> str:
    """Create `final_dir` by running `build(tmp_dir)` then renaming; reuse it if present.

    `marker` is the file whose presence means the directory is complete. Concurrent builders
    race benignly: the loser discards its temporary directory.
    """
    if os.path.exists(os.path.join(final_dir, marker)):
        return final_dir
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(final_dir) + "-", dir=parent)
    try:
        build(tmp)
        try:
            os.replace(tmp, final_dir)
        except OSError:
            # Another process published first (target is a non-empty directory).
            if not os.path.exists(os.path.join(final_dir, marker)):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final_dir
