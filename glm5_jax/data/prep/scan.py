"""Stage 1, per shard: quality filters, exact digests and MinHash band keys of every document.

Writes `work/scan/<shard>/` (published by an atomic rename, so a shard is either whole or absent):
  filtered.npy        int8 [n]: 0 kept, 1 + i when FILTERS[i] rejects the document
  sig.npy             uint32 [n, num_perm]: MinHash signatures (near; rows of filtered documents are 0)
  bands_<r>.npy       uint64 [m, 3]: (band, band hash, global id) of the kept documents whose band hash
                      falls in partition r (hash % partitions)
  digests_<r>.npy     uint64 [m, 3]: (digest high, digest low, global id), partition r by digest
Partitioning by hash is what lets the exact and near stages run one task per partition over every
shard without any process holding all digests or signatures."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from glm5_jax.data._cache import build_dir_atomically
from glm5_jax.data.clean import (
    FILTERS,
    CleanConfig,
    digest,
    filter_reason,
    lsh_bands,
    minhash_signature,
)
from glm5_jax.data.prep.plan import Shard

DONE = "filtered.npy"


def scan_dir(work: str, shard: Shard) -> str:
    return os.path.join(work, "scan", shard.name)


def band_hashes(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """uint64 [n, bands]: an 8-byte BLAKE2b of each band's rows of each signature."""
    out = np.zeros([len(sigs), bands], np.uint64)
    for i, s in enumerate(sigs):
        for b in range(bands):
            h = hashlib.blake2b(s[b * rows:(b + 1) * rows].tobytes(), digest_size=8).digest()
            out[i, b] = int.from_bytes(h, "little")
    return out


def _partitioned(d: str, stem: str, rows: np.ndarray, key: np.ndarray, partitions: int) -> None:
    part = (key % np.uint64(partitions)).astype(np.int64)
    for r in range(partitions):
        np.save(os.path.join(d, f"{stem}_{r}.npy"), rows[part == r])


def scan_shard(work: str, shard: Shard, cfg: CleanConfig, partitions: int) -> dict:
    """Scan `shard` into work/scan/<shard>/ unless it is there already; returns how many documents each
    filter rejected ({name: count})."""
    d = scan_dir(work, shard)

    def build(tmp):
        n = shard.num_docs
        filtered = np.zeros([n], np.int8)
        ids, digests, sigs = [], [], np.zeros([n, cfg.num_perm if "near" in cfg.dedup else 0], np.uint32)
        for g, _, doc in shard.documents():
            text = doc.plain_text()
            why = filter_reason(text, cfg) if cfg.filters else None
            if why is not None:
                filtered[g - shard.first] = 1 + FILTERS.index(why)
                continue
            ids.append(g)
            if "exact" in cfg.dedup:
                digests.append(np.frombuffer(digest(text), np.uint64))
            if "near" in cfg.dedup:
                sigs[g - shard.first] = minhash_signature(text, cfg)
        ids = np.asarray(ids, np.uint64)
        if "exact" in cfg.dedup:
            dg = np.stack(digests) if digests else np.zeros([0, 2], np.uint64)
            _partitioned(tmp, "digests", np.column_stack([dg, ids]).astype(np.uint64), dg[:, 1], partitions)
        if "near" in cfg.dedup:
            np.save(os.path.join(tmp, "sig.npy"), sigs)
            b, r = lsh_bands(cfg)
            hashes = band_hashes(sigs[(ids - shard.first).astype(np.int64)], b, r)
            rows = np.stack([np.repeat(np.arange(b, dtype=np.uint64)[None], len(ids), 0), hashes,
                             np.repeat(ids[:, None], b, 1)], axis=-1).reshape(-1, 3)
            _partitioned(tmp, "bands", rows, rows[:, 1], partitions)
        np.save(os.path.join(tmp, DONE), filtered)

    build_dir_atomically(d, DONE, build)
    counts = np.bincount(np.load(os.path.join(d, DONE)), minlength=1 + len(FILTERS))
    return {f: int(counts[1 + i]) for i, f in enumerate(FILTERS)}
