"""Recall of DSA's page-level selection (ModelConfig.dsa_decode_pages) against the exact top-k.

    python -m tools.dsa_page_recall [--preset=tiny] [--init_from=CKPT] [--seq_len=2048] [--index_topk=64]
        [--pages=4,16,64] [--queries=64] [--seed=0] [--json]

Runs the model's own forward over a window of the Python standard library's source (byte tokens modulo
the vocabulary), keeps every full indexer layer's query / key / weight outputs (the lightning indexer), and
for the last `--queries` positions compares `select_topk_cached(..., page=P)` (the selection decode runs
with dsa_decode_pages=P) with the exact top-k (page=0, the default) over the same index keys: recall = the
share of the exact top-k's slots that the page selection holds, averaged over layers and queries, and
`mass` = the share of the exact top-k's index-score softmax mass that it holds. Random-init weights (no
--init_from) give the selection's floor on unstructured scores; a trained checkpoint, what decode would see.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from glm5_jax import cli
from glm5_jax.attention.indexer import Indexer, select_topk_cached
from glm5_jax.config import PRESETS
from glm5_jax.errors import Glm5Error
from pallas_kernels.dsa_xla import index_scores


class RecallError(Glm5Error):
    """A bad flag: raised before anything runs."""


def stdlib_tokens(n: int, vocab: int) -> np.ndarray:
    """The first n bytes of the standard library's *.py sources (sorted paths) as token ids (byte % vocab)."""
    from glm5_jax.data.corpus import stdlib_root
    root, out, size = stdlib_root(), [], 0
    for d, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if f.endswith(".py") and size < n:
                with open(os.path.join(d, f), "rb") as fh:
                    b = fh.read()
                out.append(b)
                size += len(b)
    return (np.frombuffer(b"".join(out)[:n], np.uint8).astype(np.int32) % vocab)[None]


def indexer_outputs(cfg, params, tokens) -> list:
    """[(q_idx [B, T, Hi, Di], k_idx [B, T, Di], w [B, T, Hi])] per full indexer layer (scanned stacks split)."""
    from glm5_jax.model import GLM5
    _, st = GLM5(cfg).apply({"params": params}, jnp.asarray(tokens), logits=False,
                            capture_intermediates=lambda m, name: isinstance(m, Indexer) and name == "__call__",
                            mutable=["intermediates"])
    out = []

    def walk(tree):
        for k, v in sorted(tree.items()):
            if k == "__call__":
                q, kk, w = v[0]
                if q.ndim == 5:      # a scanned stack: [repeats, B, T, ...]
                    out.extend((q[r], kk[r], w[r]) for r in range(q.shape[0]))
                else:
                    out.append((q, kk, w))
            elif isinstance(v, dict):
                walk(v)
    walk(st["intermediates"])
    return out


def page_recall(q, k, w, topk: int, page: int, queries: int) -> tuple[float, float]:
    """(slot recall, index-score softmax mass recall) of page=P vs exact over the last `queries` positions."""
    t = q.shape[1]
    pos = jnp.broadcast_to(jnp.arange(t - queries, t), (q.shape[0], queries))
    qs, ws = q[:, t - queries:], w[:, t - queries:]
    exact = np.asarray(select_topk_cached(qs, k, ws, topk, pos))
    paged = np.asarray(select_topk_cached(qs, k, ws, topk, pos, page=page))
    scores = np.asarray(index_scores(qs, k, ws), np.float64)
    scores = np.where(np.arange(t) <= np.asarray(pos)[..., None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    hit = (exact[..., :, None] == paged[..., None, :]).any(-1) & (exact >= 0)
    mass_exact = np.take_along_axis(p, np.maximum(exact, 0), -1) * (exact >= 0)
    recall = hit.sum(-1) / np.maximum((exact >= 0).sum(-1), 1)
    mass = (mass_exact * hit).sum(-1) / np.maximum(mass_exact.sum(-1), 1e-30)
    return float(recall.mean()), float(mass.mean())


def run(preset: str = "tiny", init_from: str | None = None, seq_len: int = 2048, index_topk: int = 64,
        pages=(4, 16, 64), queries: int = 64, seed: int = 0) -> dict:
    if preset not in PRESETS:
        raise RecallError(f"--preset={preset!r}; allowed: {', '.join(PRESETS)}")
    if not 0 < queries <= seq_len or index_topk >= seq_len:
        raise RecallError(f"need 0 < queries ({queries}) <= seq_len ({seq_len}) and index_topk ({index_topk}) < seq_len")
    bad = [p for p in pages if p < 1 or index_topk % p]
    if bad:
        raise RecallError(f"--pages={bad}: each page size must be >= 1 and divide index_topk={index_topk}")
    cfg = PRESETS[preset]().replace(attention="dsa", index_topk=index_topk, mtp_depth=0)
    if init_from:
        from glm5_jax.train.checkpoint import load_params
        params = load_params(init_from, cfg)
    else:
        from glm5_jax.model import init_params
        params = init_params(cfg, jax.random.PRNGKey(seed))
    layers = indexer_outputs(cfg, params, stdlib_tokens(seq_len, cfg.vocab_size))
    rows = {}
    for p in pages:
        r = [page_recall(q, k, w, index_topk, p, queries) for q, k, w in layers]
        rows[p] = {"recall": float(np.mean([a for a, _ in r])), "mass": float(np.mean([b for _, b in r]))}
    return {"preset": preset, "init_from": init_from, "seq_len": seq_len, "index_topk": index_topk,
            "queries": queries, "layers": len(layers), "pages": rows}


FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("preset", "tiny", "Model preset (random init) when --init_from is not given.")
    flags.DEFINE_string("init_from", None, "Trained weights: a HF dir, params checkpoint or run workdir.")
    flags.DEFINE_integer("seq_len", 2048, "Cached tokens the queries select from.")
    flags.DEFINE_integer("index_topk", 64, "Exact top-k the pages are measured against.")
    flags.DEFINE_list("pages", ["4", "16", "64"], "Page sizes (tokens per page) to measure.")
    flags.DEFINE_integer("queries", 64, "Query positions per layer.")
    flags.DEFINE_integer("seed", 0, "Seed of the tokens (and of the random init).")
    flags.DEFINE_bool("json", False, "Print one JSON object.")


def main(argv) -> int:
    del argv
    try:
        pages = tuple(int(x) for x in FLAGS.pages)
        r = run(FLAGS.preset, FLAGS.init_from, FLAGS.seq_len, FLAGS.index_topk, pages, FLAGS.queries, FLAGS.seed)
    except (RecallError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if FLAGS.json:
        print(json.dumps(r))
    else:
        for p, v in r["pages"].items():
            print(f"pages of {p:4d}: recall {v['recall']:.3f}, index-score mass {v['mass']:.3f} "
                  f"({r['layers']} layers x {r['queries']} queries at T={r['seq_len']}, k={r['index_topk']})")
    return 0


if __name__ == "__main__":
    cli.run(main, define_flags)
