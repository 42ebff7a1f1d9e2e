"""The semantic dedup stage (SemDeDup, Abbas et al. 2023) over shards.

1. embed (a task per shard): each document that no earlier stage removed is tokenized with the
   embedding checkpoint's own tokenizer, cut to `embed_max_tokens`, run through the checkpoint's trunk
   (glm5_jax.model.GLM5, final-normed hidden states, no LM head) and mean-pooled over its tokens:
   `work/semantic/emb/<shard>/` holds ids.npy and emb.npy (float32 [n, d_model]).
2. centre and k-means (spherical: cosine assignment, normalised mean updates): the corpus mean of the
   embeddings (summed per shard) is subtracted before normalising, because mean-pooled LM states share
   a large common direction (anisotropy) that would make every pair look alike. Each Lloyd iteration
   is a task per shard returning per-cluster sums; the driver adds them in shard order (so the result
   does not depend on the workers) and saves the centroids (`centroids_<it>.npy`, a resume point).
   Initial centroids: `semantic_clusters` documents drawn with the config's seed.
3. assign (a task per shard): each document's nearest centroid, written partitioned by cluster.
4. dedup (a task per cluster partition): within a cluster, in corpus order, a document whose cosine
   similarity to an earlier kept document exceeds `semantic_threshold` is removed as a duplicate of
   the most similar one. A task holds its clusters' embeddings only.
The embedding model is loaded once per worker process (cached by path)."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

import numpy as np

from glm5_jax.data._cache import build_dir_atomically
from glm5_jax.data.clean import CleanConfig
from glm5_jax.data.prep.dedup import removed_ids, save_atomic
from glm5_jax.data.prep.plan import Shard
from glm5_jax.data.sources import DataError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def _sem(work: str, *parts: str) -> str:
    return os.path.join(work, "semantic", *parts)


def find_tokenizer(model_path: str, explicit: str | None) -> str:
    """The embedding checkpoint's tokenizer: `explicit`, else a tokenizer.json / tokenizer.model in the
    checkpoint folder or up to two folders above it (a run's step folder sits in WORKDIR/checkpoints/)."""
    if explicit:
        return explicit
    d = os.path.abspath(model_path)
    for _ in range(3):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(d, name)):
                return os.path.join(d, name)
        d = os.path.dirname(d)
    raise DataError(f"--embed_model={model_path!r} has no {' or '.join(TOKENIZER_FILES)} beside it (nor up to two "
                    "folders above); pass the tokenizer it was trained with as --embed_tokenizer=PATH")


def check_embedder(cfg: CleanConfig) -> None:
    """Refuse an embedding checkpoint that is not one, or has no tokenizer, before any stage runs."""
    from glm5_jax.train.checkpoint import checkpoint_kind
    checkpoint_kind(cfg.embed_model)
    find_tokenizer(cfg.embed_model, cfg.embed_tokenizer)


@functools.lru_cache(maxsize=2)
def load_embedder(model_path: str, tokenizer_path: str | None):
    """(ModelConfig, params on one device, tokenizer) of an embedding checkpoint (any kind
    glm5_jax.train.checkpoint.load_params reads)."""
    from glm5_jax.data.tokenizer import load_tokenizer_setting
    from glm5_jax.train.checkpoint import checkpoint_config, load_params
    cfg = checkpoint_config(model_path)
    params = load_params(model_path, cfg)
    tok = load_tokenizer_setting(find_tokenizer(model_path, tokenizer_path))
    if tok.vocab_size > cfg.vocab_size:
        raise DataError(f"--embed_model={model_path!r} has vocab_size {cfg.vocab_size} < its tokenizer's "
                        f"{tok.vocab_size} ({tok.model_path}); pass the model's own tokenizer as --embed_tokenizer")
    return cfg, params, tok


@functools.lru_cache(maxsize=8)
def _pooled_fn(cfg):
    import jax
    import jax.numpy as jnp

    from glm5_jax.model import GLM5

    def pooled(params, tokens, lengths):
        hidden = GLM5(cfg).apply({"params": params}, tokens, logits=False, return_hidden=True)["hidden"]
        mask = (jnp.arange(tokens.shape[1])[None] < lengths[:, None]).astype(jnp.float32)
        return (hidden.astype(jnp.float32) * mask[..., None]).sum(1) / jnp.maximum(mask.sum(1), 1)[:, None]
    return jax.jit(pooled)


def embed_texts(texts: Sequence[str], cfg: CleanConfig) -> np.ndarray:
    """float32 [len(texts), d_model]: mean-pooled final hidden states of the embedding checkpoint."""
    mcfg, params, tok = load_embedder(cfg.embed_model, cfg.embed_tokenizer)
    fn = _pooled_fn(mcfg)
    ids = [list(x[:cfg.embed_max_tokens]) or [tok.eos_id] for x in tok.encode_batch(list(texts))]
    out = np.zeros([len(ids), mcfg.d_model], np.float32)
    order = np.argsort([len(x) for x in ids], kind="stable")       # similar lengths share a padded shape
    for a in range(0, len(ids), cfg.embed_batch):
        rows = order[a:a + cfg.embed_batch]
        width = 1 << max(3, math.ceil(math.log2(max(len(ids[i]) for i in rows))))
        toks = np.full([cfg.embed_batch, width], tok.pad_id, np.int32)
        lengths = np.zeros([cfg.embed_batch], np.int32)
        for k, i in enumerate(rows):
            toks[k, :len(ids[i])] = ids[i]
            lengths[k] = len(ids[i])
        out[rows] = np.asarray(fn(params, toks, lengths))[:len(rows)]
    return out


def embed_shard(work: str, shard: Shard, cfg: CleanConfig, prior: Sequence[str]) -> dict:
    """Embed the shard's surviving documents into work/semantic/emb/<shard>/; returns the embedding sum
    and count (for the corpus mean)."""
    d = _sem(work, "emb", shard.name)

    def build(tmp):
        dead = set(removed_ids(work, prior).tolist())
        filtered = np.load(os.path.join(work, "scan", shard.name, "filtered.npy"))
        ids, texts = [], []
        for g, _, doc in shard.documents():
            if g not in dead and filtered[g - shard.first] == 0:
                ids.append(g)
                texts.append(doc.plain_text())
        width = load_embedder(cfg.embed_model, cfg.embed_tokenizer)[0].d_model
        emb = embed_texts(texts, cfg) if texts else np.zeros([0, width], np.float32)
        np.save(os.path.join(tmp, "emb.npy"), emb)
        np.save(os.path.join(tmp, "ids.npy"), np.asarray(ids, np.int64))

    build_dir_atomically(d, "ids.npy", build)
    emb = np.load(os.path.join(d, "emb.npy"))
    return {"sum": emb.astype(np.float64).sum(0), "count": len(emb)}


def _unit(x: np.ndarray, mean: np.ndarray) -> np.ndarray:
    v = x.astype(np.float64) - mean
    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


def shard_vectors(work: str, shard: Shard, mean: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = _sem(work, "emb", shard.name)
    return np.load(os.path.join(d, "ids.npy")), _unit(np.load(os.path.join(d, "emb.npy")), mean)


def initial_centroids(work: str, shards: Sequence[Shard], counts: Sequence[int], k: int, seed: int,
                      mean: np.ndarray) -> np.ndarray:
    """k surviving documents drawn with `seed` (rows read from their shards' files only)."""
    firsts = np.concatenate([[0], np.cumsum(counts)])
    picks = np.sort(np.random.default_rng(seed).choice(int(firsts[-1]), k, replace=False))
    rows = []
    for p in picks:
        s = int(np.searchsorted(firsts, p, side="right")) - 1
        emb = np.load(os.path.join(_sem(work, "emb", shards[s].name), "emb.npy"), mmap_mode="r")
        rows.append(np.asarray(emb[p - firsts[s]]))
    return _unit(np.stack(rows), mean)


def kmeans_step(work: str, shard: Shard, centroids: np.ndarray, mean: np.ndarray) -> tuple:
    """(per-cluster sums of the shard's unit vectors [k, d], counts [k])."""
    _, v = shard_vectors(work, shard, mean)
    nearest = np.argmax(v @ centroids.T, axis=1) if len(v) else np.zeros([0], np.int64)
    sums = np.zeros_like(centroids)
    np.add.at(sums, nearest, v)
    return sums, np.bincount(nearest, minlength=len(centroids))


def update_centroids(centroids: np.ndarray, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(sums, axis=1, keepdims=True)
    return np.where((counts[:, None] > 0) & (norm > 0), sums / np.maximum(norm, 1e-12), centroids)


def assign_shard(work: str, shard: Shard, centroids: np.ndarray, mean: np.ndarray, partitions: int) -> dict:
    """Each surviving document's nearest centroid -> work/semantic/assign/<shard>/part_<r>.npy (id, cluster)."""
    d = _sem(work, "assign", shard.name)

    def build(tmp):
        ids, v = shard_vectors(work, shard, mean)
        cluster = np.argmax(v @ centroids.T, axis=1).astype(np.int64) if len(v) else np.zeros([0], np.int64)
        for r in range(partitions):
            keep = cluster % partitions == r
            np.save(os.path.join(tmp, f"part_{r}.npy"), np.stack([ids[keep], cluster[keep]], -1).reshape(-1, 2))
        np.save(os.path.join(tmp, "done.npy"), np.zeros([0]))

    build_dir_atomically(d, "done.npy", build)
    return {"shard": shard.index}


def semantic_partition(work: str, shards: Sequence[Shard], r: int, mean: np.ndarray, threshold: float) -> dict:
    """SemDeDup within the clusters of partition r -> work/semantic/part_<r>.npy (removed id, kept id)."""
    out = _sem(work, f"part_{r}.npy")
    if os.path.exists(out):
        return {"partition": r, "reused": True}
    rows, vecs = [], []
    for s in shards:
        a = np.load(os.path.join(_sem(work, "assign", s.name), f"part_{r}.npy"))
        if len(a):
            d = _sem(work, "emb", s.name)
            ids = np.load(os.path.join(d, "ids.npy"))
            emb = np.load(os.path.join(d, "emb.npy"), mmap_mode="r")
            rows.append(a)
            vecs.append(_unit(np.asarray(emb[np.searchsorted(ids, a[:, 0])]), mean))
    pairs = []
    if rows:
        rows, vecs = np.concatenate(rows), np.concatenate(vecs)
        for c in np.unique(rows[:, 1]):
            members = np.flatnonzero(rows[:, 1] == c)
            members = members[np.argsort(rows[members, 0], kind="stable")]
            kept: list[int] = []
            for m in members:
                if kept:
                    sims = vecs[kept] @ vecs[m]
                    best = int(np.argmax(sims))
                    if sims[best] > threshold:
                        pairs.append((int(rows[m, 0]), int(rows[kept[best], 0])))
                        continue
                kept.append(m)
    save_atomic(out, np.array(sorted(pairs), np.int64).reshape(-1, 2))
    return {"partition": r, "reused": False}
