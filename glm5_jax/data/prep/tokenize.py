"""The last stage, per shard: the documents no filter or dedup stage removed, tokenized into the
shard's own token cache `OUT/shards/<shard>/` (glm5_jax.data.token_cache layout: train / eval tokens
and offsets, plus shard.json with its counts), published by an atomic rename: a finished shard is
never redone, a half-written one (a `.tmp-*` folder) is never read."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence

import numpy as np

from glm5_jax.data._cache import build_dir_atomically
from glm5_jax.data.prep.dedup import removed_ids
from glm5_jax.data.prep.plan import Shard
from glm5_jax.data.token_cache import write_token_items

SHARD_INDEX = "shard.json"


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str):
    from glm5_jax.data.tokenizer import load_tokenizer_setting
    return load_tokenizer_setting(path)


def shard_out_dir(out: str, shard: Shard) -> str:
    return os.path.join(out, "shards", shard.name)


def tokenize_shard(out: str, work: str, shard: Shard, tokenizer_path: str, stages: Sequence[str],
                   scanned: bool) -> dict:
    """Tokenize the shard's surviving documents (unless done); returns its shard.json."""
    d = shard_out_dir(out, shard)

    def build(tmp):
        dead = removed_ids(work, stages)
        dead = set(dead[(dead >= shard.first) & (dead < shard.first + shard.num_docs)].tolist())
        filtered = np.load(os.path.join(work, "scan", shard.name, "filtered.npy")) if scanned else None
        items = ((split, doc) for g, split, doc in shard.documents()
                 if g not in dead and (filtered is None or filtered[g - shard.first] == 0))
        stats = write_token_items(_tokenizer(tokenizer_path), items, tmp, shard.num_docs - len(dead), quiet=True)
        with open(os.path.join(tmp, SHARD_INDEX), "w") as fh:
            json.dump({"shard": shard.index, "first": shard.first, "documents_in": shard.num_docs, **stats}, fh)

    build_dir_atomically(d, SHARD_INDEX, build)
    with open(os.path.join(d, SHARD_INDEX)) as fh:
        return json.load(fh)
