"""Exact top-k of reference.indexer_topk (key-prefix groups, threshold selection) == the previous
full-row lax.top_k implementation, bit for bit, on random and tie-heavy data."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import dsa_xla as ref


def _inputs(seed, b, t, s, hi, di, integer):
    rng = np.random.default_rng(seed)
    if integer:  # exactly representable scores: many exact ties, +0.0 and -0.0
        q = rng.integers(-1, 2, size=(b, t, hi, di)).astype(np.float32)
        k = rng.integers(-1, 2, size=(b, s, di)).astype(np.float32)
        w = rng.integers(-2, 3, size=(b, t, hi)).astype(np.float32)
    else:
        q = rng.normal(size=(b, t, hi, di)).astype(np.float32)
        k = rng.normal(size=(b, s, di)).astype(np.float32)
        w = rng.normal(size=(b, t, hi)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(w)


# (B, T, S, Hi, Di, topk, causal, chunk, integer, packed)
CASES = [
    (2, 300, 300, 2, 16, 40, True, 64, False, False),
    (1, 256, 700, 3, 8, 64, True, 32, False, False),   # S > T
    (1, 200, 150, 1, 8, 64, True, 40, False, False),   # S < T: leading rows see nothing
    (2, 333, 333, 2, 4, 17, True, 111, True, False),
    (1, 512, 512, 1, 8, 100, False, 128, True, False),
    (1, 1000, 1000, 4, 32, 512, True, 100, False, False),
    (2, 256, 256, 2, 4, 9, True, 64, True, True),
    (1, 1024, 1024, 2, 3, 300, True, 256, True, False),
]


@pytest.mark.parametrize("cap", [0, None])
@pytest.mark.parametrize("case", CASES)
def test_indexer_topk_bit_identical(case, cap):
    b, t, s, hi, di, kk, causal, chunk, integer, packed = case
    q, k, w = _inputs(sum(case[:6]), b, t, s, hi, di, integer)
    seg = None
    if packed:
        seg = jnp.asarray(np.cumsum(np.random.default_rng(1).random((b, t)) < 0.02, axis=1),
                          jnp.int32)
    old = jax.jit(lambda a, b_, c: ref._indexer_topk_sort(
        a, b_, c, kk, causal=causal, segment_ids=seg, chunk=chunk))(q, k, w)
    new = jax.jit(lambda a, b_, c: ref.indexer_topk(
        a, b_, c, kk, causal=causal, segment_ids=seg, chunk=chunk, cap=cap))(q, k, w)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(old))



def test_indexer_topk_capped_chunk_and_prefix_groups(monkeypatch):
    """T = S = 2560: causal groups score real key prefixes (1024 .. 2560 keys; the first three
    groups share the 1024-key minimum and run as one), and a small score-tile budget lowers the
    query chunk below `chunk` (128 -> 32): still bit-identical to the full-row top-k, ties included."""
    b, t, hi, di, kk = 2, 2560, 3, 8, 100
    monkeypatch.setattr(ref, "_SCORE_TILE_BYTES", 32 * b * hi * t * 4)
    q, k, w = _inputs(7, b, t, t, hi, di, True)
    old = jax.jit(lambda a, b_, c: ref._indexer_topk_sort(a, b_, c, kk, chunk=128))(q, k, w)
    new = jax.jit(lambda a, b_, c: ref.indexer_topk(a, b_, c, kk, chunk=128))(q, k, w)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


def test_topk_rows_total_order():
    # XLA TopK's order: -0.0 < +0.0, NaN highest, -inf lowest; ties by lower index
    x = jnp.array([[0.0, -0.0, -0.0, 0.0, 1.0, -1.0, -jnp.inf, 2.0, 1.0, -jnp.inf]], jnp.float32)
    for k in (1, 3, 5, 8, 10):
        v, i = jax.lax.top_k(x, k)
        want = np.where(np.isneginf(np.asarray(v)), -1, np.asarray(i))
        np.testing.assert_array_equal(ref.topk_rows(x, k, cap=k), want)


def test_topk_rows_random_ties():
    rng = np.random.default_rng(0)
    s = rng.integers(-3, 4, size=(64, 2048)).astype(np.float32)
    s = np.where(np.arange(2048)[None] <= (np.arange(64) * 32)[:, None], s, -np.inf)
    x = jnp.asarray(s.astype(np.float32))
    for k, cap in ((512, None), (100, 150), (7, 8)):
        v, i = jax.lax.top_k(x, k)
        want = np.where(np.isneginf(np.asarray(v)), -1, np.asarray(i))
        np.testing.assert_array_equal(jax.jit(lambda y: ref.topk_rows(y, k, cap=cap))(x), want)
