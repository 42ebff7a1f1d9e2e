"""The dense flash attention (CPU path of core.causal_attention, bench_dsa baseline) against a naive
masked softmax: MHA / GQA / MQA, Dv != Dq, T not a multiple of the block, packed segment ids."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.dense import flash_attention


def _naive(q, k, v, scale, seg=None):
    h = q.shape[2]
    k = jnp.repeat(k, h // k.shape[2], axis=2)  # KV head j serves query heads j*g .. j*g+g-1
    v = jnp.repeat(v, h // v.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    t = q.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    if seg is not None:
        mask = mask & (seg[:, :, None] == seg[:, None, :])
    s = jnp.where(mask[:, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


CASES = [  # (H, Hk, T, block, segments)
    (3, 1, 48, 16, False), (3, 3, 32, 32, False), (3, 1, 40, 64, False),
    (4, 2, 37, 16, True),     # GQA, T not a multiple of the block, packed documents
    (2, 1, 33, 8, True),      # MQA (MLA's form), many blocks fully outside a document
]


@pytest.mark.parametrize("h,hk,t,block,segs", CASES)
def test_flash_matches_naive_fwd_and_grads(h, hk, t, block, segs):
    rng = np.random.default_rng(t + hk)
    b, d, dv = 2, 8, 5
    seg = None
    if segs:  # contiguous documents, different cuts per row
        seg = jnp.asarray(np.stack([np.searchsorted(np.sort(rng.choice(np.arange(1, t), 3, replace=False)),
                                                    np.arange(t), side="right") for _ in range(b)]), jnp.int32)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, hk, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, hk, dv)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    scale = d ** -0.5
    out = flash_attention(q, k, v, scale=scale, segment_ids=seg, block=block)
    np.testing.assert_allclose(out, _naive(q, k, v, scale, seg), atol=1e-5, rtol=1e-5)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)
    g = jax.grad(loss(lambda q, k, v: flash_attention(q, k, v, scale=scale, segment_ids=seg, block=block)),
                 argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(loss(lambda q, k, v: _naive(q, k, v, scale, seg)), argnums=(0, 1, 2))(q, k, v)
    for a, r in zip(g, g_ref):
        np.testing.assert_allclose(a, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("h,hk,t,block", [(4, 4, 37, 16), (3, 1, 24, 32)])
def test_flash_key_mask_equals_sparse_attention_over_the_same_indices(h, hk, t, block):
    """A top-k set given as a dense key mask (topk_key_mask) gives the sparse reference's output and
    gradients (softmax over exactly the selected keys): causal indices with -1 slots, packed
    documents, and a query that selects nothing (zeros, finite gradients). T % block != 0 for
    (37, 16): padded rows see no key."""
    from pallas_kernels import dsa_xla as ref
    from pallas_kernels.dense import topk_key_mask
    rng = np.random.default_rng(t)
    b, d, dv, kk = 2, 8, 5, 6
    seg = jnp.asarray(np.repeat([0, 1], [t // 2, t - t // 2])[None].repeat(b, 0), jnp.int32)
    idx = np.full((b, t, kk), -1, np.int32)
    segn = np.asarray(seg)
    for bi in range(b):
        for ti in range(t):
            vis = [s for s in range(ti + 1) if segn[bi, s] == segn[bi, ti]]
            sel = rng.permutation(vis)[:rng.integers(1, kk + 1)]
            idx[bi, ti, :len(sel)] = sel
    idx[1, 5] = -1   # selects nothing
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, hk, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, hk, dv)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    scale = d ** -0.5
    mask = topk_key_mask(jnp.asarray(idx), t)
    flash = lambda q, k, v: flash_attention(q, k, v, scale=scale, segment_ids=seg, block=block, key_mask=mask)
    sparse = lambda q, k, v: ref.sparse_attention(q, k, v, jnp.asarray(idx), scale=scale)
    np.testing.assert_allclose(flash(q, k, v), sparse(q, k, v), atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(flash(q, k, v))[1, 5] == 0)
    g = jax.grad(lambda *a: jnp.sum(flash(*a) * w), argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(lambda *a: jnp.sum(sparse(*a) * w), argnums=(0, 1, 2))(q, k, v)
    for a, r in zip(g, g_ref):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, r, atol=1e-4, rtol=1e-4)


def test_flash_rejects_bad_shapes():
    q = jnp.zeros((1, 48, 4, 8))
    with pytest.raises(ValueError, match="S == T"):
        flash_attention(q, jnp.zeros((1, 40, 1, 8)), jnp.zeros((1, 40, 1, 8)), scale=1.0)
    with pytest.raises(ValueError, match="multiple of key heads 3"):
        flash_attention(q, jnp.zeros((1, 48, 3, 8)), jnp.zeros((1, 48, 3, 8)), scale=1.0)
    with pytest.raises(ValueError, match="key_mask"):
        flash_attention(q, jnp.zeros((1, 48, 1, 8)), jnp.zeros((1, 48, 1, 8)), scale=1.0,
                        key_mask=jnp.ones((1, 48, 40), bool))
    with pytest.raises(ValueError, match="segment_ids"):
        flash_attention(q, jnp.zeros((1, 48, 1, 8)), jnp.zeros((1, 48, 1, 8)), scale=1.0,
                        segment_ids=jnp.zeros((1, 40), jnp.int32))


def _packed_inputs(t=40, h=4, hk=2, d=24, dv=16):
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(1, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, t, hk, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, t, hk, dv)), jnp.float32)
    seg = jnp.asarray(np.repeat([0, 1, 2], [15, 10, t - 25])[None], jnp.int32)
    return q, k, v, seg


@pytest.mark.parametrize("platform", ["cpu", "tpu", "gpu"])
def test_causal_attention_each_platform_kernel(platform):
    """core.causal_attention's kernel for each platform (TPU splash / GPU Pallas-Triton flash run in
    interpret mode here) against the naive masked softmax: GQA, Dv != Dq, packed documents,
    T not a multiple of any block; forward and gradients."""
    from glm5_jax.attention import core
    q, k, v, seg = _packed_inputs()
    fns = {"cpu": lambda a, b_, c: core.causal_attention(a, b_, c, scale=0.2, segment_ids=seg, chunk=16),
           "tpu": lambda a, b_, c: core.splash_attention(a, b_, c, scale=0.2, segment_ids=seg, interpret=True),
           "gpu": lambda a, b_, c: core.gpu_flash_attention(a, b_, c, scale=0.2, segment_ids=seg, block=16,
                                                            interpret=True)}
    fn = fns[platform]
    np.testing.assert_allclose(fn(q, k, v), _naive(q, k, v, 0.2, seg), atol=1e-5, rtol=1e-5)
    loss = lambda f: lambda a, b_, c: jnp.sum(jnp.sin(f(a, b_, c)))
    g = jax.grad(loss(fn), (0, 1, 2))(q, k, v)
    g_ref = jax.grad(loss(lambda a, b_, c: _naive(a, b_, c, 0.2, seg)), (0, 1, 2))(q, k, v)
    for a, r in zip(g, g_ref):
        np.testing.assert_allclose(a, r, atol=1e-4, rtol=1e-4)


def test_causal_attention_rejects_bad_platform_and_lengths():
    from glm5_jax.attention import core
    q, k, v, _ = _packed_inputs()
    with pytest.raises(ValueError, match="platform='metal'"):
        core.causal_attention(q, k, v, scale=1.0, platform="metal")
    with pytest.raises(ValueError, match="S == T"):
        core.causal_attention(q, k[:, :20], v[:, :20], scale=1.0)


def test_causal_attention_under_a_mesh_uses_the_partitionable_kernel():
    """Pallas kernels cannot be auto-partitioned: under a multi-device mesh every platform runs the
    jnp flash path (here: asking for "tpu" on a 2-device CPU mesh still traces no Pallas call)."""
    from glm5_jax.attention import core
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    q, k, v, seg = _packed_inputs()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        text = str(jax.make_jaxpr(lambda a, b_, c: core.causal_attention(
            a, b_, c, scale=0.2, segment_ids=seg, platform="tpu"))(q, k, v))
    assert "pallas_call" not in text
