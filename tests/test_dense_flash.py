"""The dense flash-attention baseline of tools/bench_dsa.py against a naive masked softmax."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.dense import flash_attention


def _naive(q, k, v, scale):
    h = q.shape[2]
    k = jnp.broadcast_to(k, k.shape[:2] + (h,) + k.shape[3:])
    v = jnp.broadcast_to(v, v.shape[:2] + (h,) + v.shape[3:])
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    t = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


@pytest.mark.parametrize("hk", [1, 3])
@pytest.mark.parametrize("t,block", [(48, 16), (32, 32), (40, 64)])
def test_flash_matches_naive_fwd_and_grads(hk, t, block):
    if t % min(block, t):
        pytest.skip("T must be a multiple of the block")
    rng = np.random.default_rng(t + hk)
    b, h, d, dv = 2, 3, 8, 5
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, hk, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, hk, dv)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    scale = d ** -0.5
    out = flash_attention(q, k, v, scale=scale, block=block)
    np.testing.assert_allclose(out, _naive(q, k, v, scale), atol=1e-5, rtol=1e-5)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)
    g = jax.grad(loss(lambda q, k, v: flash_attention(q, k, v, scale=scale, block=block)),
                 argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(loss(lambda q, k, v: _naive(q, k, v, scale)), argnums=(0, 1, 2))(q, k, v)
    for a, r in zip(g, g_ref):
        np.testing.assert_allclose(a, r, atol=1e-4, rtol=1e-4)


def test_flash_rejects_bad_shapes():
    q = jnp.zeros((1, 48, 4, 8))
    with pytest.raises(ValueError, match="multiple of block"):
        flash_attention(q, jnp.zeros((1, 48, 1, 8)), jnp.zeros((1, 48, 1, 8)), scale=1.0, block=32)
    with pytest.raises(ValueError, match="allows 1 or H"):
        flash_attention(q, jnp.zeros((1, 48, 2, 8)), jnp.zeros((1, 48, 2, 8)), scale=1.0)
