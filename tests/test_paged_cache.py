"""The paged KV cache (`LayerCache(pages=)`, `GLM5(cache_pages=)`): the model over a pool of pages through
per-row page tables gives what it gives over the dense per-row cache (exact DSA top-k included: the
indexer scores every cached key through the page table), with pages in any order, shared by reference
between rows that share a prefix, and with every token of a mixed decode + prefill step as its own row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import model
from glm5_jax.config import ModelConfig
from glm5_jax.infer import cache as kv
from glm5_jax.infer.decode import model_step

PS, N = 4, 8                      # page size, pages per row: each row sees 32 positions
CFGS = {"dsa_shared": ModelConfig(num_layers=3, mtp_depth=0, index_topk=8, indexer_types=("full", "shared", "full")),
        "mla": ModelConfig(attention="mla", num_layers=2, mtp_depth=0)}

step = jax.jit(model_step, static_argnums=0)


def _dense(cfg, params, toks, lens, new):
    """Prompts [B, T] (right-padded, lens) prefilled over a dense [B, 32] cache, then the tokens new [B, k]
    decoded one by one -> hidden states at every prompt position and every decode step."""
    b, t = toks.shape
    layers = kv.init_cache(cfg, b, PS * N)["layers"]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x, layers = step(cfg, params, layers, toks, pos, jnp.where(pos < lens[:, None], pos, -1))
    outs = [x]
    for i in range(new.shape[1]):
        x, layers = step(cfg, params, layers, new[:, i:i + 1], (lens + i)[:, None])
        outs.append(x)
    return outs


@pytest.mark.parametrize("name", ["dsa_shared", pytest.param("mla", marks=pytest.mark.slow)])
def test_paged_cache_equals_dense_cache_with_shuffled_and_shared_pages(name):
    """Row 1 shares row 0's first two pages (8 equal prompt tokens) by reference and prefills only its
    tokens 8..; the pool's pages are a random permutation. Every hidden state equals the dense cache's."""
    cfg = CFGS[name]
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    lens = np.array([21, 17, 11], np.int32)
    toks = rng.integers(1, cfg.vocab_size, (3, 21)).astype(np.int32)
    toks[1, :8] = toks[0, :8]
    new = rng.integers(1, cfg.vocab_size, (3, 3)).astype(np.int32)
    want = _dense(cfg, params, jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(new))

    perm = rng.permutation(40).astype(np.int32)
    table = perm[:3 * N].reshape(3, N).copy()
    table[1, :2] = table[0, :2]                        # shared by reference, never written by row 1
    pool = kv.init_cache(cfg, 40, PS)["layers"]
    pos = np.broadcast_to(np.arange(21, dtype=np.int32), (3, 21))
    wpos = np.where(pos < lens[:, None], pos, -1)
    x0, pool = step(cfg, params, pool, jnp.asarray(toks[:1]), jnp.asarray(pos[:1]), jnp.asarray(wpos[:1]),
                    pages=jnp.asarray(table[:1]))
    wpos_rest = wpos[1:].copy()
    wpos_rest[0, :8] = -1                              # row 1's shared prefix is already in the pool
    x12, pool = step(cfg, params, pool, jnp.asarray(toks[1:]), jnp.asarray(pos[1:]), jnp.asarray(wpos_rest),
                     pages=jnp.asarray(table[1:]))
    got = [jnp.concatenate([x0, x12])]
    for i in range(3):
        x, pool = step(cfg, params, pool, jnp.asarray(new[:, i:i + 1]), jnp.asarray(lens + i)[:, None],
                       pages=jnp.asarray(table))
        got.append(x)
    for w, g in zip(want[1:], got[1:]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5)
    for r in range(3):
        lo = 8 if r == 1 else 0                        # row 1 computed only its own positions
        np.testing.assert_allclose(np.asarray(got[0][r, lo:lens[r]]), np.asarray(want[0][r, lo:lens[r]]),
                                   atol=2e-5, rtol=1e-5)


def test_every_token_its_own_row_equals_the_batched_step():
    """A mixed step: two decode tokens and a 6-token prefill chunk flattened to 8 rows of one token, each
    with its sequence's page table and position (rows of one sequence write their keys before any attends),
    equal the same work done as a [B, T] prefill and a decode step."""
    cfg = CFGS["dsa_shared"]
    params = model.init_params(cfg, jax.random.PRNGKey(1))
    rng = np.random.default_rng(1)
    table = rng.permutation(40).astype(np.int32)[:3 * N].reshape(3, N)
    pool = kv.init_cache(cfg, 40, PS)["layers"]
    prompts = rng.integers(1, cfg.vocab_size, (2, 10)).astype(np.int32)
    pos = np.broadcast_to(np.arange(10, dtype=np.int32), (2, 10))
    _, pool = step(cfg, params, pool, jnp.asarray(prompts), jnp.asarray(pos), pages=jnp.asarray(table[:2]))
    dec = rng.integers(1, cfg.vocab_size, 2).astype(np.int32)
    chunk = rng.integers(1, cfg.vocab_size, 6).astype(np.int32)
    xd, ref = step(cfg, params, pool, jnp.asarray(dec[:, None]), jnp.full((2, 1), 10, jnp.int32),
                   pages=jnp.asarray(table[:2]))
    xp, ref = step(cfg, params, ref, jnp.asarray(chunk[None]), jnp.arange(6, dtype=jnp.int32)[None],
                   pages=jnp.asarray(table[2:]))
    rows_tok = np.concatenate([dec, chunk])[:, None]
    rows_pos = np.concatenate([[10, 10], np.arange(6)]).astype(np.int32)[:, None]
    rows_tab = np.concatenate([table[:2], np.repeat(table[2:], 6, axis=0)])
    xr, flat = step(cfg, params, pool, jnp.asarray(rows_tok), jnp.asarray(rows_pos), pages=jnp.asarray(rows_tab))
    np.testing.assert_allclose(np.asarray(xr[:2, 0]), np.asarray(xd[:, 0]), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(xr[2:, 0]), np.asarray(xp[0]), atol=2e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(flat), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5)
