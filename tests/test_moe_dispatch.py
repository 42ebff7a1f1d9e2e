"""Routed-expert dispatch: the tiled grouped matmul (CPU) and the ragged_dot path against a
per-token reference (each token times its own experts' weights), values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.layers.moe import expert_tile, ragged_experts, tiled_experts


def _per_token(x, ids, gate, up, down):
    """[N, k, D]: token n through expert ids[n, j], weights gathered per token (no grouping)."""
    outs = []
    for j in range(ids.shape[1]):
        g, u, d = gate[ids[:, j]], up[ids[:, j]], down[ids[:, j]]
        h = jax.nn.silu(jnp.einsum("nd,ndf->nf", x, g)) * jnp.einsum("nd,ndf->nf", x, u)
        outs.append(jnp.einsum("nf,nfd->nd", h, d))
    return jnp.stack(outs, axis=1)


def _case(n=37, d=16, f=8, e=5, k=2, seed=0):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(n, d)), jnp.float32)
    ids = jnp.asarray(r.integers(0, e - 1, (n, k)), jnp.int32)        # the last expert gets no token
    ws = [jnp.asarray(r.normal(size=s) * 0.3, jnp.float32) for s in [(e, d, f), (e, d, f), (e, f, d)]]
    return x, ids, ws


@pytest.mark.parametrize("tile", [1, 3, 8, 64])
def test_tiled_matches_per_token(tile):
    x, ids, (g, u, d) = _case()
    want = _per_token(x, ids, g, u, d)
    np.testing.assert_allclose(tiled_experts(x, ids, g, u, d, tile=tile), want, rtol=1e-5, atol=1e-5)
    loss = lambda fn: lambda x, g, u, d: jnp.sum(jnp.sin(fn(x, ids, g, u, d)))
    got = jax.grad(loss(lambda *a: tiled_experts(*a, tile=tile)), argnums=(0, 1, 2, 3))(x, g, u, d)
    ref = jax.grad(loss(_per_token), argnums=(0, 1, 2, 3))(x, g, u, d)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert float(jnp.max(jnp.abs(got[1][-1]))) == 0.0         # the unused expert gets no gradient


def test_ragged_matches_per_token():
    x, ids, (g, u, d) = _case(seed=1)
    np.testing.assert_allclose(ragged_experts(x, ids, g, u, d), _per_token(x, ids, g, u, d), rtol=1e-5, atol=1e-5)


def test_all_tokens_on_one_expert():
    x, _, (g, u, d) = _case(seed=2)
    ids = jnp.zeros((x.shape[0], 2), jnp.int32).at[:, 1].set(3)
    np.testing.assert_allclose(tiled_experts(x, ids, g, u, d, tile=8), _per_token(x, ids, g, u, d),
                               rtol=1e-5, atol=1e-5)


def test_expert_tile_bounds_padding():
    for rows, e in [(2048, 8), (8, 8), (10 ** 6, 4), (4096, 256)]:
        t = expert_tile(rows, e)
        assert 8 <= t <= 512 and t & (t - 1) == 0
        if rows // (8 * e) >= 8:
            assert e * t <= rows / 8 + 1e-9          # padding adds at most 1/8 of the routed rows


def test_chunked_a2a_dispatch_equals_one_dispatch_when_dropless():
    """ModelConfig.moe_token_chunk: dispatching a device's tokens in chunks (lax.map under
    jax.checkpoint) gives the one-dispatch output and gradients (x, router weights, expert weights)
    when dropless; the dropped count stays 0 and the slot total is n*k."""
    from glm5_jax.parallel.ep import dispatch_chunked, dispatch_local
    n, d, f, e, k = 24, 8, 6, 4, 2
    ks = jax.random.split(jax.random.PRNGKey(5), 6)
    x = jax.random.normal(ks[0], (n, d))
    w = jax.nn.softmax(jax.random.normal(ks[1], (n, k)))
    ids = jax.random.randint(ks[2], (n, k), 0, e)
    gate, up = jax.random.normal(ks[3], (e, d, f)), jax.random.normal(ks[4], (e, d, f))
    down = jax.random.normal(ks[5], (e, f, d))
    kw = dict(num_experts=e, capacity_factor=0.0)

    def loss(fn, **extra):
        return lambda x, w, g, u, dn: jnp.sum(jnp.sin(fn(x, w, ids, g, u, dn, **kw, **extra)[0]))

    one = dispatch_local(x, w, ids, gate, up, down, **kw)
    for chunk in (5,):      # 5: the chunk is the largest divisor of n below it (4): 6 chunks
        got = jax.jit(lambda *a: dispatch_chunked(*a, **kw, token_chunk=chunk))(x, w, ids, gate, up, down)
        np.testing.assert_allclose(got[0], one[0], rtol=1e-5, atol=1e-5)
        assert int(got[1]) == 0 and int(got[2]) == n * k
        g1 = jax.grad(loss(dispatch_local), argnums=(0, 1, 2, 3, 4))(x, w, gate, up, down)
        g2 = jax.jit(jax.grad(loss(dispatch_chunked, token_chunk=chunk), argnums=(0, 1, 2, 3, 4)))(x, w, gate, up, down)
        for a, b in zip(g2, g1):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_unsorted_dropless_round_matches_per_token():
    """The dropless one-round dispatch with el = E / ep <= k local experts (ep.dispatch_local's unsorted
    `_token_round`: a fixed place per (expert, token), dense matmuls) equals the per-token reference,
    values and gradients, and takes no sort (its program has no argsort of the slots: the sorted round's
    `_plan`). One device, so el = E = k: every token on every expert, in a different order per token;
    routed subsets over an expert axis: tests/test_moe_dropless.py's worst_case (data:2,expert:4, el = k = 2)."""
    from glm5_jax.parallel.ep import dispatch_local
    x, _, (gate, up, down) = _case(n=9, e=4, k=4, seed=3)
    ids = jnp.asarray(np.argsort(np.random.default_rng(1).random((9, 4)), axis=1), jnp.int32)
    w = jnp.asarray(np.random.default_rng(2).uniform(0.2, 1.0, (9, 4)), jnp.float32)
    kw = dict(num_experts=4, capacity_factor=0.0, round_factor=0.0)
    run = lambda x, w, g, u, d: dispatch_local(x, w, ids, g, u, d, **kw)[0]
    ref = lambda x, w, g, u, d: jnp.einsum("nkd,nk->nd", _per_token(x, ids, g, u, d), w)
    np.testing.assert_allclose(run(x, w, gate, up, down), ref(x, w, gate, up, down), rtol=2e-5, atol=2e-5)
    loss = lambda fn: jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1, 2, 3, 4))
    for a, b in zip(loss(run)(x, w, gate, up, down), loss(ref)(x, w, gate, up, down)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    assert "sort" not in str(jax.make_jaxpr(run)(x, w, gate, up, down))


@pytest.mark.parametrize("capacity", [30, 12])
def test_unsorted_round_with_many_tokens_compacts_each_experts_rows_and_stays_dropless(capacity):
    """Over a cache (dispatch_local(compact=True): inference) with more tokens than an expert's capacity C
    (TOKEN_ROUND_CAPACITY x its mean rows) `_token_round` runs each local expert over its own routed rows only,
    compacted into a [el, C, D] buffer, in passes of C rows (C = 12 for ~20 rows an expert: two passes), so
    the values still equal the per-token reference (dropless), with no sort."""
    from glm5_jax.parallel.ep import _token_round
    x, _, (gate, up, down) = _case(n=40, e=4, k=2, seed=5)
    rng = np.random.default_rng(4)
    ids = jnp.asarray(np.argsort(rng.random((40, 4)), axis=1)[:, :2], jnp.int32)
    w = jnp.asarray(rng.uniform(0.2, 1.0, (40, 2)), jnp.float32)
    run = lambda x, w, g, u, d: _token_round(x, w, ids, g, u, d, el=4, ep=1, expert_axis=None, tensor_axis=None,
                                             capacity=capacity)
    ref = lambda x, w, g, u, d: jnp.einsum("nkd,nk->nd", _per_token(x, ids, g, u, d), w)
    np.testing.assert_allclose(run(x, w, gate, up, down), ref(x, w, gate, up, down), rtol=2e-5, atol=2e-5)
    text = str(jax.make_jaxpr(run)(x, w, gate, up, down))
    assert " sort[" not in text and "cumsum" in text and "while[" in text
    loads = np.bincount(np.asarray(ids).ravel(), minlength=4)
    assert (loads > capacity).any() == (capacity == 12)        # overflow exercised only at C = 12
