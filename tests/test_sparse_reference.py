"""reference.sparse_attention (custom VJP, chunked gathers) against a dense masked softmax."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import dsa_xla as ref


def _naive(q, k, v, idx, scale):
    """Dense attention over all S keys with a mask built from the index lists."""
    b, t, h, _ = q.shape
    s_len = k.shape[1]
    k = jnp.broadcast_to(k, k.shape[:2] + (h,) + k.shape[3:])
    v = jnp.broadcast_to(v, v.shape[:2] + (h,) + v.shape[3:])
    sel = jnp.zeros((b, t, s_len + 1), bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None],
        jnp.where(idx >= 0, idx, s_len)].set(True)[..., :s_len]
    s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    s = jnp.where(sel[:, None], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(jnp.where(sel[:, None], s, -1e30), -1, keepdims=True))
    p = jnp.where(sel[:, None], p, 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("bhts,bshd->bthd", p, v)


def _unique_idx(rng, b, t, s, kk, n_empty_rows=1):
    out = -np.ones((b, t, kk), np.int32)
    for bi in range(b):
        for ti in range(t):
            n = rng.integers(0, min(kk, s) + 1)
            out[bi, ti, :n] = rng.choice(s, size=n, replace=False)
            rng.shuffle(out[bi, ti])
    out[0, :n_empty_rows] = -1
    return jnp.asarray(out)


@pytest.mark.parametrize("hk", [1, 3])
@pytest.mark.parametrize("t,s,kk,chunk", [(13, 13, 5, 4), (16, 40, 8, 16), (9, 6, 8, 3)])
def test_sparse_attention_matches_dense_masked(hk, t, s, kk, chunk):
    rng = np.random.default_rng(t * 7 + hk)
    b, h, dq, dv = 2, 3, 8, 5
    q = jnp.asarray(rng.normal(size=(b, t, h, dq)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, hk, dq)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, hk, dv)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    idx = _unique_idx(rng, b, t, s, kk)
    scale = 0.4
    out = ref.sparse_attention(q, k, v, idx, scale=scale, chunk=chunk)
    np.testing.assert_allclose(out, _naive(q, k, v, idx, scale), atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(out)[0, 0] == 0.0)  # a row with no valid index returns zeros

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)
    g = jax.grad(loss(lambda q, k, v: ref.sparse_attention(q, k, v, idx, scale=scale, chunk=chunk)),
                 argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(loss(lambda q, k, v: _naive(q, k, v, idx, scale)), argnums=(0, 1, 2))(q, k, v)
    for a, r in zip(g, g_ref):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_allclose(a, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("hk", [1, 3])
def test_sparse_attention_value_prefix(hk):
    """v=None, dv: the value is k[..., :dv] -- same output and the same gradient w.r.t. k as
    passing that prefix as v (dense masked reference; the prefix's gradient is dK + dV)."""
    rng = np.random.default_rng(5 + hk)
    b, t, h, dq, dv, kk = 2, 12, 3, 9, 6, 5
    q = jnp.asarray(rng.normal(size=(b, t, h, dq)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, hk, dq)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    idx = _unique_idx(rng, b, t, t, kk)
    out = ref.sparse_attention(q, k, None, idx, scale=0.3, chunk=4, dv=dv)
    np.testing.assert_allclose(out, _naive(q, k, k[..., :dv], idx, 0.3), atol=1e-5, rtol=1e-5)
    g = jax.grad(lambda q, k: jnp.sum(w * ref.sparse_attention(q, k, None, idx, scale=0.3, chunk=4, dv=dv)),
                 (0, 1))(q, k)
    g_ref = jax.grad(lambda q, k: jnp.sum(w * _naive(q, k, k[..., :dv], idx, 0.3)), (0, 1))(q, k)
    for a, r in zip(g, g_ref):
        np.testing.assert_allclose(a, r, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="dv"):
        ref.sparse_attention(q, k, None, idx, scale=0.3)
    with pytest.raises(ValueError, match="dv"):
        ref.sparse_attention(q, k, k, idx, scale=0.3, dv=dv)


def test_sparse_attention_bad_shapes():
    q = jnp.zeros((1, 4, 4, 8))
    with pytest.raises(ValueError, match="allows 1 or H"):
        ref.sparse_attention(q, jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)),
                             jnp.zeros((1, 4, 2), jnp.int32), scale=1.0)
    with pytest.raises(ValueError, match="indices"):
        ref.sparse_attention(q, jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 4, 1, 8)),
                             jnp.zeros((1, 5, 2), jnp.int32), scale=1.0)
