"""The exact and near dedup stages over the scan's partitions, and the removal lists every stage writes.

One task per hash partition r reads partition r of every shard's scan (glm5_jax.data.prep.scan), so
a task holds about 1 / partitions of the corpus's digests or band keys, never all of them:
* exact: documents with the same digest; all but the first (lowest global id = first in corpus order)
  are removed, as duplicates of it.
* near: documents sharing a band hash in some band are candidates; a candidate is confirmed against
  the group's earlier members (at most MAX_COMPARE of them) by the signatures' estimated Jaccard
  (rows read from the shards' memory-mapped sig.npy), giving an edge (document, earlier document).
  Connected components of all partitions' edges (union-find over the edges only: one entry per
  near-duplicate, not per document) keep their lowest id and remove the rest as its duplicates.
A stage sees only documents that no earlier stage (and no filter) removed. Each stage's result is
`work/removed/<stage>.npy`, int64 [m, 2] (removed id, id of the kept document), sorted by id; every
file is written to a temporary name and renamed, so a killed run leaves whole files or none."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from glm5_jax.data.prep.scan import scan_dir

MAX_COMPARE = 64


def save_atomic(path: str, arr: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        np.save(fh, arr)
    os.replace(tmp, path)


def removed_path(work: str, stage: str) -> str:
    return os.path.join(work, "removed", f"{stage}.npy")


def removed_ids(work: str, stages: Sequence[str]) -> np.ndarray:
    """Sorted int64 ids removed by `stages` (finished ones)."""
    parts = [np.load(removed_path(work, s))[:, 0] for s in stages]
    return np.unique(np.concatenate(parts)) if parts else np.zeros([0], np.int64)


def _partition_rows(work: str, shards, stem: str, r: int, dead: np.ndarray) -> np.ndarray:
    rows = np.concatenate([np.load(os.path.join(scan_dir(work, s), f"{stem}_{r}.npy")) for s in shards])
    return rows[~np.isin(rows[:, 2].astype(np.int64), dead)] if len(dead) else rows


def _group_starts(keys: list[np.ndarray]) -> np.ndarray:
    """bool [n]: row i starts a new group of equal keys (rows sorted by the keys)."""
    n = len(keys[0])
    same = np.ones([max(n - 1, 0)], bool)
    for k in keys:
        same &= k[1:] == k[:-1]
    return np.concatenate([[True], ~same]) if n else np.zeros([0], bool)


def exact_partition(work: str, shards, r: int, prior: Sequence[str]) -> dict:
    out = os.path.join(work, "exact", f"part_{r}.npy")
    if os.path.exists(out):
        return {"partition": r, "reused": True}
    rows = _partition_rows(work, shards, "digests", r, removed_ids(work, prior))
    rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    starts = _group_starts([rows[:, 0], rows[:, 1]])
    first = np.maximum.accumulate(np.where(starts, np.arange(len(rows)), 0))
    dup = ~starts
    save_atomic(out, np.stack([rows[dup, 2], rows[first[dup], 2]], -1).astype(np.int64).reshape(-1, 2))
    return {"partition": r, "reused": False}


class _Signatures:
    """Signature rows by global id, from the shards' memory-mapped sig.npy files."""

    def __init__(self, work: str, shards):
        self.work, self.shards = work, list(shards)
        self.firsts = np.array([s.first for s in self.shards], np.int64)
        self.maps: dict[int, np.ndarray] = {}

    def __getitem__(self, g: int) -> np.ndarray:
        k = int(np.searchsorted(self.firsts, g, side="right")) - 1
        if k not in self.maps:
            self.maps[k] = np.load(os.path.join(scan_dir(self.work, self.shards[k]), "sig.npy"), mmap_mode="r")
        return self.maps[k][g - self.firsts[k]]


def near_partition(work: str, shards, r: int, prior: Sequence[str], threshold: float) -> dict:
    out = os.path.join(work, "near", f"part_{r}.npy")
    if os.path.exists(out):
        return {"partition": r, "reused": True}
    rows = _partition_rows(work, shards, "bands", r, removed_ids(work, prior))
    rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    starts = np.flatnonzero(_group_starts([rows[:, 0], rows[:, 1]]))
    ends = np.append(starts[1:], len(rows))
    sigs = _Signatures(work, shards)
    edges = set()
    for a, b in zip(starts[ends - starts > 1], ends[ends - starts > 1]):
        members = rows[a:b, 2].astype(np.int64)
        for j in range(1, len(members)):
            sj = sigs[members[j]]
            for i in members[max(0, j - MAX_COMPARE):j]:
                if np.mean(sigs[i] == sj) >= threshold:
                    edges.add((int(members[j]), int(i)))
                    break
    arr = np.array(sorted(edges), np.int64).reshape(-1, 2)
    save_atomic(out, arr)
    return {"partition": r, "reused": False}


def components(edges: np.ndarray) -> np.ndarray:
    """int64 [m, 2] (id, lowest id of its connected component) for every id of `edges` that is not the
    lowest of its component, sorted by id."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:
            parent[x], x = root, parent[x]
        return root

    for a, b in edges.tolist():
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    out = sorted((x, find(x)) for x in parent if find(x) != x)
    return np.array(out, np.int64).reshape(-1, 2)


def merge_partitions(work: str, stage: str, partitions: int) -> np.ndarray:
    """The stage's removal list from its partitions' outputs (exact: the pairs; near: components)."""
    parts = [np.load(os.path.join(work, stage, f"part_{r}.npy")) for r in range(partitions)]
    pairs = np.concatenate(parts) if parts else np.zeros([0, 2], np.int64)
    if stage == "near":
        pairs = components(pairs)
    return pairs[np.argsort(pairs[:, 0], kind="stable")] if len(pairs) else pairs.reshape(-1, 2)
