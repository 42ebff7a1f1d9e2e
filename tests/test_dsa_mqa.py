"""DSA's sparse attention in MLA's MQA form (W_UK absorbed into the queries, one shared
[latent | k_rope] row per key, W_UV after attention) against the expanded per-head form."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.attention.indexer import indexer_kl_sparse
from glm5_jax.attention.mla import dsa_attention

B, T, S, H, R, DN, DR, DV, K = 2, 5, 7, 3, 6, 4, 2, 5, 4


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    qn, qr = rng.normal(size=(B, T, H, DN)), rng.normal(size=(B, T, H, DR))
    lat, kr = rng.normal(size=(B, S, R)), rng.normal(size=(B, S, DR))
    w_uk, w_uv = rng.normal(size=(R, H, DN)) * 0.5, rng.normal(size=(R, H, DV)) * 0.5
    idx = np.stack([np.stack([rng.permutation(S)[:K] for _ in range(T)]) for _ in range(B)]).astype(np.int32)
    idx[0, 1, 2:] = -1          # fewer selected keys than K
    idx[1, 3, :] = -1           # nothing to attend: zeros
    return qn, qr, lat, kr, w_uk, w_uv, idx


def _expanded_numpy(qn, qr, lat, kr, w_uk, w_uv, idx, scale):
    """Per (b, t, h): softmax over the selected keys of the expanded per-head k = [lat W_UK | k_rope]."""
    out = np.zeros((B, T, H, DV))
    for b in range(B):
        for t in range(T):
            sel = [s for s in idx[b, t] if s >= 0]
            for h in range(H):
                if not sel:
                    continue
                k = np.concatenate([lat[b, sel] @ w_uk[:, h], kr[b, sel]], -1)
                v = lat[b, sel] @ w_uv[:, h]
                z = k @ np.concatenate([qn[b, t, h], qr[b, t, h]]) * scale
                p = np.exp(z - z.max())
                out[b, t, h] = (p / p.sum()) @ v
    return out


def _expanded_jnp(qn, qr, lat, kr, w_uk, w_uv, idx, scale):
    """Dense expanded attention with the unselected keys masked (a differentiable reference)."""
    k = jnp.concatenate([jnp.einsum("bsr,rhd->bshd", lat, w_uk),
                         jnp.broadcast_to(kr[:, :, None], (B, S, H, DR))], -1)
    v = jnp.einsum("bsr,rhd->bshd", lat, w_uv)
    z = jnp.einsum("bthd,bshd->bhts", jnp.concatenate([qn, qr], -1), k) * scale
    sel = jnp.any(idx[..., None] == jnp.arange(S), axis=2)[:, None]          # [B, 1, T, S]
    z = jnp.where(sel, z, -jnp.inf)
    m = jnp.max(z, -1, keepdims=True)
    p = jnp.where(sel, jnp.exp(z - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("bhts,bshd->bthd", p, v)


def test_mqa_sparse_attention_equals_expanded_heads():
    args = _inputs()
    scale = (DN + DR) ** -0.5
    f32 = [jnp.asarray(a, jnp.float32) for a in args[:-1]] + [jnp.asarray(args[-1])]
    got = np.asarray(dsa_attention(*f32, scale=scale))
    np.testing.assert_allclose(got, _expanded_numpy(*args, scale), rtol=1e-5, atol=1e-5)
    assert np.all(got[1, 3] == 0)


def test_mqa_sparse_attention_gradients_equal_expanded_heads():
    args = _inputs(1)
    scale = (DN + DR) ** -0.5
    f32 = [jnp.asarray(a, jnp.float32) for a in args[:-1]]
    idx = jnp.asarray(args[-1])
    ct = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, H, DV)), jnp.float32)
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a, idx, scale=scale) * ct), argnums=tuple(range(6)))
    got = grad(dsa_attention)(*f32)
    want = grad(lambda *a, scale: _expanded_jnp(*a, scale))(*f32)
    for name, g, w in zip(("q_nope", "q_rope", "latent", "k_rope", "w_uk", "w_uv"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5, err_msg=name)


def test_sparse_indexer_kl_same_in_mqa_and_expanded_form():
    qn, qr, lat, kr, w_uk, _, idx = _inputs(3)
    lat, kr = lat[:, :T], kr[:, :T]                       # the KL runs over the layer's own keys (S == T)
    idx = np.where(idx < T, idx, -1)
    rng = np.random.default_rng(4)
    qi, ki, w = rng.normal(size=(B, T, 2, 3)), rng.normal(size=(B, T, 3)), rng.normal(size=(B, T, 2))
    f = lambda *a: [jnp.asarray(x, jnp.float32) for x in a]
    q_exp = np.concatenate([qn, qr], -1)
    k_exp = np.concatenate([np.einsum("bsr,rhd->bshd", lat, w_uk), np.broadcast_to(kr[:, :, None], (B, T, H, DR))], -1)
    q_mqa = np.concatenate([np.einsum("bthd,rhd->bthr", qn, w_uk), qr], -1)
    k_mqa = np.concatenate([lat, kr], -1)[:, :, None]
    kl_exp = indexer_kl_sparse(*f(q_exp, k_exp), 0.7, *f(qi, ki, w), jnp.asarray(idx), chunk=2)
    kl_mqa = indexer_kl_sparse(*f(q_mqa, k_mqa), 0.7, *f(qi, ki, w), jnp.asarray(idx), chunk=2)
    np.testing.assert_allclose(float(kl_mqa), float(kl_exp), rtol=1e-5)


def _mqa_case(seed, b=2, t=6, s=9, h=4, dq=8, kk=4):
    """MQA operands with empty slots, a query with none, and key 0 selected by every other query (its float32
    gradient row is read-modified-written by several queries in turn)."""
    rng = np.random.default_rng(seed)
    idx = np.stack([np.stack([rng.permutation(s)[:kk] for _ in range(t)]) for _ in range(b)]).astype(np.int32)
    idx[:, ::2, 0] = np.where((idx[:, ::2] == 0).any(-1), idx[:, ::2, 0], 0)
    idx[0, 1, 2:] = -1
    idx[1, 3, :] = -1
    idx[0, 4, 1] = -1                                   # an empty slot between valid ones
    idx[0, 0, -1] = -1                                  # in the kernel's first step (its VMEM rows not yet written)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return f(b, t, h, dq), f(b, s, 1, dq), jnp.asarray(idx)


def test_fused_mqa_backward_kernel_equals_its_closed_form():
    """sparse_mqa_tpu.mqa_bwd (interpret mode) against the formulas written out in jnp over the gathered rows:
    O = P V, dq = dS K, and dK[s] summed over every (query, slot) that selected s, with P = exp(S - lse)."""
    from pallas_kernels import sparse_mqa_tpu
    q, k, idx = _mqa_case(0)
    k = k[:, :, 0]
    b, t, h, dq = q.shape
    r, scale = 6, 0.3
    do = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32).at[..., r:].set(0.0)
    valid = idx >= 0
    kg = jax.vmap(lambda kb, ib: kb[ib])(k, jnp.where(valid, idx, 0))                   # [B, T, K, Dq]
    z = jnp.where(valid[:, :, None], jnp.einsum("btkd,bthd->bthk", kg, q) * scale, -jnp.inf)
    lse = jax.nn.logsumexp(z, axis=-1)                                                 # -inf: no valid slot
    p = jnp.where(valid[:, :, None], jnp.exp(z - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    dp = jnp.einsum("btkd,bthd->bthk", kg, do)
    ds = p * (dp - jnp.sum(p * dp, -1, keepdims=True)) * scale
    rows = jnp.einsum("bthk,bthd->btkd", ds, q) + jnp.einsum("bthk,bthd->btkd", p, do)
    dk = np.zeros(k.shape)
    for bi, ti, j in zip(*np.nonzero(np.asarray(valid))):
        dk[bi, idx[bi, ti, j]] += np.asarray(rows[bi, ti, j])
    # Pallas' TPU interpret mode: uninitialised VMEM holds NaN (an empty slot's row must not reach O or dq), DMAs
    # complete only when waited for, and a race between the steps' dK row DMAs would be reported
    from jax.experimental.pallas import tpu as pltpu
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", dma_execution_mode="on_wait")
    odq, dk_got = jax.jit(lambda *a: sparse_mqa_tpu.mqa_bwd(*a, scale=scale, interpret=params))(q, k, do, idx, lse)
    assert tpu_interpret.races is None or not tpu_interpret.races.races_found
    np.testing.assert_allclose(np.asarray(odq[:, :, :h]), np.asarray(jnp.einsum("bthk,btkd->bthd", p, kg)),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(odq[:, :, h:]), np.asarray(jnp.einsum("bthk,btkd->bthd", ds, kg)),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dk_got), dk, rtol=1e-5, atol=1e-5)
    assert np.abs(dk[:, 0]).max() > 0 and np.all(np.asarray(odq[1, 3]) == 0)


def test_pallas_mqa_uv_equals_jnp_in_values_and_gradients():
    """dsa.sparse_mqa_uv (the Pallas forward and the fused backward, interpret mode) equals
    dsa_xla.sparse_mqa_uv (the jnp rows) in the output and the gradients of q, k and W_UV."""
    from pallas_kernels import dsa, dsa_xla
    q, k, idx = _mqa_case(2)
    rng = np.random.default_rng(3)
    w_uv = jnp.asarray(rng.normal(size=(6, q.shape[2], 5)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=q.shape[:3] + (5,)), jnp.float32)

    def run(fn):
        return jax.value_and_grad(lambda *a: jnp.sum(fn(*a, idx, scale=0.3) * ct), argnums=(0, 1, 2))(q, k, w_uv)

    (v_x, g_x), (v_p, g_p) = run(dsa_xla.sparse_mqa_uv), run(functools.partial(dsa.sparse_mqa_uv, interpret=True))
    np.testing.assert_allclose(float(v_p), float(v_x), rtol=1e-6)
    for name, a, w in zip(("q", "k", "w_uv"), g_p, g_x):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=name)
