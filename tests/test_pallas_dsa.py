"""Pallas DSA kernels (interpret mode on CPU) against the jnp references and a NumPy brute force."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import dsa
from pallas_kernels import dsa_xla as ref


def _np_scores(q, k, w):
    dots = np.einsum("bthd,bsd->bths", np.asarray(q, np.float64), np.asarray(k, np.float64))
    return np.einsum("bth,bths->bts", np.asarray(w, np.float64), np.maximum(dots, 0.0))


def _np_visible(t, s, causal):
    if not causal:
        return np.ones((t, s), bool)
    return np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t)


def _check_topk_set(out, q, k, w, topk, causal, tol=1e-5):
    """out is a valid exact top-k: right size, visible, unique, and no better key left out."""
    out = np.asarray(out)
    sc = _np_scores(q, k, w)
    b, t, s = sc.shape
    vis = _np_visible(t, s, causal)
    for bi in range(b):
        for ti in range(t):
            row = out[bi, ti]
            n_vis = int(vis[ti].sum())
            n = min(topk, n_vis)
            assert (row[:n] >= 0).all() and (row[n:] == -1).all(), (bi, ti, row)
            sel = row[:n]
            assert len(set(sel.tolist())) == n
            assert vis[ti, sel].all()
            rest = np.setdiff1d(np.nonzero(vis[ti])[0], sel)
            if n and rest.size:
                assert sc[bi, ti, sel].min() >= sc[bi, ti, rest].max() - tol


def _np_topk_tiebreak(q, k, w, topk, causal):
    """Brute force with the documented order: score descending, then key index ascending."""
    sc = _np_scores(q, k, w)
    b, t, s = sc.shape
    vis = _np_visible(t, s, causal)
    out = -np.ones((b, t, topk), np.int64)
    for bi in range(b):
        for ti in range(t):
            keys = np.nonzero(vis[ti])[0]
            order = keys[np.lexsort((keys, -sc[bi, ti, keys]))][:topk]
            out[bi, ti, :order.size] = order
    return out


def _rand_idx_inputs(seed, b, t, s, hi, di, integer=False):
    rng = np.random.default_rng(seed)
    if integer:  # exactly representable scores: lots of exact ties
        q = rng.integers(-1, 2, size=(b, t, hi, di)).astype(np.float32)
        k = rng.integers(-1, 2, size=(b, s, di)).astype(np.float32)
        w = rng.integers(1, 3, size=(b, t, hi)).astype(np.float32)
    else:
        q = rng.normal(size=(b, t, hi, di)).astype(np.float32)
        k = rng.normal(size=(b, s, di)).astype(np.float32)
        w = rng.normal(size=(b, t, hi)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(w)


# (seed, B, T, S, Hi, Di, topk, causal, block)
INDEXER_CASES = [
    (0, 2, 37, 37, 2, 16, 12, True, 8),     # T not a multiple of the block, early rows < topk
    (1, 1, 20, 45, 3, 8, 64, True, 8),      # S > T (bottom-right), topk > visible keys
    (2, 1, 24, 30, 2, 8, 5, False, 8),      # non-causal
]


@pytest.mark.parametrize("case", INDEXER_CASES)
def test_indexer_topk_exact(case):
    seed, b, t, s, hi, di, topk, causal, blk = case
    q, k, w = _rand_idx_inputs(seed, b, t, s, hi, di)
    out = dsa.indexer_topk(q, k, w, topk, causal=causal, block_size=blk, round_blocks=2)
    assert out.shape == (b, t, topk) and out.dtype == jnp.int32
    _check_topk_set(out, q, k, w, topk, causal)
    np.testing.assert_array_equal(out, ref.indexer_topk(q, k, w, topk, causal=causal))


def test_indexer_topk_ties_and_pruning():
    # integer inputs: exact ties everywhere (incl. score 0), tie-break must be lower index first
    b, t, s, hi, di, topk = 1, 40, 40, 2, 4, 6
    q, k, w = _rand_idx_inputs(3, b, t, s, hi, di, integer=True)
    out = np.asarray(dsa.indexer_topk(q, k, w, topk, block_size=8, round_blocks=1))
    np.testing.assert_array_equal(out, _np_topk_tiebreak(q, k, w, topk, True))
    np.testing.assert_array_equal(out, ref.indexer_topk(q, k, w, topk))
    # structured keys: one block of "hot" keys -> the bound prunes most blocks, result unchanged
    q2, k2, w2 = _rand_idx_inputs(4, 1, 48, 48, 2, 8)
    w2 = jnp.abs(w2)
    k2 = k2.at[:, 8:16].add(6.0)
    q2 = q2 + 1.0
    ub = np.asarray(dsa.indexer_block_stats(q2, k2, w2, 4, block_size=8))
    assert np.isfinite(ub).any()
    out2 = dsa.indexer_topk(q2, k2, w2, 4, block_size=8, round_blocks=1)
    _check_topk_set(out2, q2, k2, w2, 4, True)
    np.testing.assert_array_equal(out2, ref.indexer_topk(q2, k2, w2, 4))


def _packed_segments(rng, b, t, n_docs):
    """[B, T] int32 segment ids of n_docs contiguous documents per row (random lengths >= 1)."""
    segs = np.zeros((b, t), np.int32)
    for bi in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=n_docs - 1, replace=False))
        segs[bi] = np.searchsorted(cuts, np.arange(t), side="right")
    return segs


@pytest.mark.parametrize("blk,topk,kernels", [(8, 5, "tpu"), (8, 20, "tpu"), (16, 3, "tpu"),
                                               (8, 5, "gpu"), (16, 20, "gpu")])
def test_indexer_topk_segments(blk, topk, kernels):
    """Packed documents: the kernel equals the reference with segment_ids (same order, -1
    padding where a document prefix has fewer than topk keys), and never selects a key of another
    document or of the future (NumPy brute force)."""
    b, t, hi, di = 2, 45, 2, 8
    q, k, w = _rand_idx_inputs(11 + blk + topk, b, t, t, hi, di)
    segs = _packed_segments(np.random.default_rng(topk), b, t, 4)
    out = np.asarray(dsa.indexer_topk(q, k, w, topk, block_size=blk, round_blocks=1,
                                      segment_ids=jnp.asarray(segs), kernels=kernels))
    want = ref.indexer_topk(q, k, w, topk, segment_ids=jnp.asarray(segs))
    np.testing.assert_array_equal(out, want)
    sc = _np_scores(q, k, w)
    for bi in range(b):
        for ti in range(t):
            vis = np.nonzero((np.arange(t) <= ti) & (segs[bi] == segs[bi, ti]))[0]
            order = vis[np.lexsort((vis, -sc[bi, ti, vis]))][:topk]
            np.testing.assert_array_equal(out[bi, ti, :order.size], order)
            assert (out[bi, ti, order.size:] == -1).all()


@pytest.mark.parametrize("blk,topk,kernels", [(8, 5, "tpu"), (8, 20, "tpu"), (16, 20, "gpu")])
def test_indexer_topk_query_offset_equals_rows_of_the_full_topk(blk, topk, kernels):
    """Context parallelism: the kernel on query chunks at global offsets (a traced q_offset, the keys'
    own segment ids) returns the unsharded top-k's rows, index for index, and the reference's result
    with the same arguments; a shard's queries never select a key after their global position."""
    b, t, hi, di, c = 2, 48, 2, 8, 16
    q, k, w = _rand_idx_inputs(5 + blk + topk, b, t, t, hi, di)
    segs = jnp.asarray(_packed_segments(np.random.default_rng(topk), b, t, 3))
    full = np.asarray(ref.indexer_topk(q, k, w, topk, segment_ids=segs))
    run = jax.jit(lambda qc, wc, sc, off: dsa.indexer_topk(qc, k, wc, topk, block_size=blk, round_blocks=1,
                                                           segment_ids=sc, kv_segment_ids=segs, q_offset=off,
                                                           kernels=kernels))
    for a in (0, 16, 32):   # chunks in a shuffled order, as the context layout holds them
        got = np.asarray(run(q[:, a:a + c], w[:, a:a + c], segs[:, a:a + c], jnp.int32(a)))
        np.testing.assert_array_equal(got, full[:, a:a + c])
        want = ref.indexer_topk(q[:, a:a + c], k, w[:, a:a + c], topk, segment_ids=segs[:, a:a + c],
                                kv_segment_ids=segs, q_offset=jnp.int32(a))
        np.testing.assert_array_equal(got, want)
        assert (got <= a + np.arange(c)[None, :, None]).all()
    with pytest.raises(ValueError, match="kv_segment_ids"):
        dsa.indexer_topk(q[:, :c], k, w[:, :c], topk, kv_segment_ids=segs, q_offset=0)


def test_indexer_topk_approx():
    b, t, s, hi, di, topk, blk = 1, 33, 33, 2, 8, 6, 8
    q, k, w = _rand_idx_inputs(5, b, t, s, hi, di)
    out = np.asarray(dsa.indexer_topk(q, k, w, topk, block_size=blk, mode="approx",
                                      approx_blocks=2))
    vis = _np_visible(t, s, True)
    for ti in range(t):
        row = out[0, ti]
        valid = row[row >= 0]
        assert (row[len(valid):] == -1).all()
        assert len(set(valid.tolist())) == len(valid) == min(topk, int(vis[ti].sum()))
        assert (valid < s).all() and vis[ti, valid].all()
    # keeping every block makes approx exact
    full = dsa.indexer_topk(q, k, w, topk, block_size=blk, mode="approx", approx_blocks=5)
    np.testing.assert_array_equal(full, ref.indexer_topk(q, k, w, topk))


def _attn_inputs(seed, b, t, s, h, hk, d, dv, kk, empty_rows=True):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)).astype(np.float32))
    k = jnp.asarray(rng.normal(size=(b, s, hk, d)).astype(np.float32))
    v = jnp.asarray(rng.normal(size=(b, s, hk, dv)).astype(np.float32))
    idx = rng.integers(0, s, size=(b, t, kk))
    idx[rng.random(idx.shape) < 0.3] = -1
    if empty_rows:
        idx[:, 1] = -1
        idx[:, -1] = -1
    return q, k, v, jnp.asarray(idx, jnp.int32)


# (seed, B, T, S, H, Hk, D, Dv, K, block_q, block_k)
ATTN_CASES = [
    (0, 2, 19, 23, 4, 1, 8, 8, 10, 8, 4),   # MQA, T and K not multiples of the blocks
    (1, 1, 16, 20, 2, 2, 8, 4, 7, 8, 8),    # Hk == H, Dv != Dq
    (3, 1, 21, 21, 3, 1, 12, 8, 6, 4, 4),   # MLA's MQA form: one key row, Dv != Dq (latent + rope)
]


@pytest.mark.parametrize("case", ATTN_CASES)
def test_sparse_attention_fwd_bwd(case):
    seed, b, t, s, h, hk, d, dv, kk, bq, bkc = case
    q, k, v, idx = _attn_inputs(seed, b, t, s, h, hk, d, dv, kk)
    scale = d ** -0.5
    out = dsa.sparse_attention(q, k, v, idx, scale=scale, block_q=bq, block_k=bkc)
    want = ref.sparse_attention(q, k, v, idx, scale=scale)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(out)[:, 1] == 0) and np.all(np.asarray(out)[:, -1] == 0)

    cot = jnp.asarray(np.random.default_rng(seed + 7).normal(size=out.shape).astype(np.float32))

    def loss(fn):
        return lambda q_, k_, v_: jnp.sum(fn(q_, k_, v_) * cot)

    g = jax.grad(loss(lambda a, b_, c: dsa.sparse_attention(
        a, b_, c, idx, scale=scale, block_q=bq, block_k=bkc, bwd_rows=bq)), (0, 1, 2))(q, k, v)
    g_ref = jax.grad(loss(lambda a, b_, c: ref.sparse_attention(a, b_, c, idx, scale=scale)),
                     (0, 1, 2))(q, k, v)
    for name, x, y in zip("qkv", g, g_ref):
        err = np.abs(np.asarray(x) - np.asarray(y)).max() / max(np.abs(np.asarray(y)).max(), 1e-30)
        assert err < 1e-4, (name, err)


def test_sparse_attention_all_empty():
    q, k, v, idx = _attn_inputs(2, 1, 9, 12, 2, 1, 8, 8, 5)
    idx = jnp.full_like(idx, -1)
    out, lse = dsa.sparse_attention_with_lse(q, k, v, idx, scale=0.5, block_q=8, block_k=4)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
    g = jax.grad(lambda a, b_, c: jnp.sum(dsa.sparse_attention(a, b_, c, idx, scale=0.5,
                                                                block_q=8, block_k=4)),
                 (0, 1, 2))(q, k, v)
    assert all(np.all(np.asarray(x) == 0) for x in g)


def _all_shapes(jaxpr):
    """Shapes of every value produced anywhere in a (closed) jaxpr, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        out += [tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _all_shapes(inner)
    return out


def test_sparse_attention_backward_holds_no_thk_array():
    """The backward works in query chunks: no value of the gradient program spans all T queries
    with the H x K probability layout (P / dS exist one chunk at a time)."""
    b, t, h, d, dv, kk = 1, 32, 4, 8, 6, 5
    q, k, v, idx = _attn_inputs(4, b, t, t, h, 1, d, dv, kk)
    f = lambda a, b_, c: jnp.sum(dsa.sparse_attention(a, b_, c, idx, scale=0.3, block_q=8,
                                                      block_k=8, bwd_rows=8))
    shapes = _all_shapes(jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(q, k, v).jaxpr)
    assert any(s[-2:] == (h, kk) for s in shapes)  # the chunk's P / dS exist ...
    assert not [s for s in shapes if len(s) >= 3 and s[-2:] == (h, kk) and t in s[:-2]], \
        "a [T, H, K] array in the backward"
