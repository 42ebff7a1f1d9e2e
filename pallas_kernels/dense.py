"""Dense causal flash attention in pure jnp (the baseline of tools/bench_dsa.py).

Block-tiled online softmax with a hand-written single-pass backward (custom_vjp, log-sum-exp
saved). Only the ~T^2/2 block pairs on or below the causal diagonal are visited (dynamic-length
inner loops), and only the diagonal block is masked. Memory is O(T) plus one [block, block] tile
per head. q [B, T, H, D], k [B, T, Hk, D], v [B, T, Hk, Dv], Hk in {1, H}, S == T (prefill).

Layout (what makes it fast on XLA CPU): one KV head per program. Hk = 1 (MQA, as DSA's absorbed
MLA) folds the H query heads into the matmul rows, M = block*H, so every product is a plain 2-D
GEMM with a single contracting dimension ([M, D] x [D, blk]); Hk = H is run as B*H sequences of
one head. (Contracting over two dimensions at once, or broadcasting K/V to H heads, costs XLA CPU
~2x per product.)

Backward (FlashAttention-2 order): the outer loop walks key blocks j and carries dK_j, dV_j; the
inner loop walks query blocks i >= j and adds dS_ij K_j into a carried dQ. The probabilities are
built transposed ([blk(k), M]) so that dV = P^T dO and dK = dS^T Q are NN GEMMs. Per block pair:
5 matmuls (S, dP, dV, dK, dQ) and one exp, against 7 and two when the probabilities are recomputed
once for dQ and once for dK/dV.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def _mm(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=_F32)


def _diag_mask(blk, h):
    """Bool [blk*H (query rows m = q*H + head), blk (keys)]: key <= query."""
    return jnp.arange(blk)[None, :] <= (jnp.arange(blk * h) // h)[:, None]


def _fwd(q, k, v, scale, blk):
    """q [B, n, blk*H, D], k [B, n, blk, D], v [B, n, blk, Dv] -> o [B, n, M, Dv], lse [B, n, M]."""
    b, n, m, _ = q.shape
    h = m // blk
    tri = _diag_mask(blk, h)

    def per_q(i):
        qb = q[:, i]

        def step(j, c):
            mx, l, acc = c
            s = _mm("bmd,bkd->bmk", qb, k[:, j]) * scale
            s = jax.lax.cond(j == i, lambda s: jnp.where(tri, s, -jnp.inf), lambda s: s, s)
            m_new = jnp.maximum(mx, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(mx - m_new)
            pv = _mm("bmk,bkd->bmd", p.astype(v.dtype), v[:, j])
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

        init = (jnp.full((b, m), -jnp.inf, _F32), jnp.zeros((b, m), _F32),
                jnp.zeros((b, m, v.shape[-1]), _F32))
        mx, l, acc = jax.lax.fori_loop(0, i + 1, step, init)
        return (acc / l[..., None]).astype(q.dtype), mx + jnp.log(l)

    o, lse = jax.lax.map(per_q, jnp.arange(n))
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(lse, 0, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q, k, v, scale, blk):
    return _fwd(q, k, v, scale, blk)[0]


def _flash_fwd(q, k, v, scale, blk):
    o, lse = _fwd(q, k, v, scale, blk)
    return o, (q, k, v, o, lse)


def _flash_bwd(scale, blk, res, do):
    q, k, v, o, lse = res
    b, n, m, _ = q.shape
    h = m // blk
    tri_t = _diag_mask(blk, h).T  # [blk(k), M]
    delta = jnp.sum(do.astype(_F32) * o.astype(_F32), -1)  # [B, n, M]

    def per_k(dq, j):
        kb, vb = k[:, j], v[:, j]

        def step(i, c):
            dk, dv, dq = c
            qb, dob = q[:, i], do[:, i]
            s_t = _mm("bkd,bmd->bkm", kb, qb) * scale
            s_t = jax.lax.cond(i == j, lambda s: jnp.where(tri_t, s, -jnp.inf), lambda s: s, s_t)
            p_t = jnp.exp(s_t - lse[:, i][:, None, :])  # [B, k, M]
            dp_t = _mm("bkd,bmd->bkm", vb, dob)
            ds_t = p_t * (dp_t - delta[:, i][:, None, :]) * scale
            dv = dv + _mm("bkm,bmd->bkd", p_t.astype(dob.dtype), dob)
            dk = dk + _mm("bkm,bmd->bkd", ds_t.astype(qb.dtype), qb)
            dq_i = _mm("bkm,bkd->bmd", ds_t.astype(kb.dtype), kb)
            return dk, dv, dq.at[:, i].add(dq_i)

        init = (jnp.zeros(kb.shape, _F32), jnp.zeros(vb.shape, _F32), dq)
        dk, dv, dq = jax.lax.fori_loop(j, n, step, init)
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq, (dk, dv) = jax.lax.scan(per_k, jnp.zeros(q.shape, _F32), jnp.arange(n))
    return dq.astype(q.dtype), jnp.moveaxis(dk, 0, 1), jnp.moveaxis(dv, 0, 1)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, *, scale: float, block: int = 512):
    """Causal dense attention (S == T), differentiable; T must be a multiple of `block`
    (smaller T uses one block)."""
    b, t, h, d = q.shape
    hk, dv = k.shape[2], v.shape[-1]
    if hk not in (1, h):
        raise ValueError(f"k has {hk} heads; flash_attention allows 1 or H={h}")
    blk = min(block, t)
    if t % blk:
        raise ValueError(f"T={t} must be a multiple of block={blk}")
    n = t // blk
    if hk == h and h > 1:  # one sequence per head: [B*H, T, 1, D]
        fold = lambda x: jnp.swapaxes(x, 1, 2).reshape(b * h, t, 1, x.shape[-1])  # noqa: E731
        o = flash_attention(fold(q), fold(k), fold(v), scale=scale, block=block)
        return jnp.swapaxes(o.reshape(b, h, t, dv), 1, 2)
    o = _flash(q.reshape(b, n, blk * h, d), k.reshape(b, n, blk, d), v.reshape(b, n, blk, dv),
               float(scale), blk)
    return o.reshape(b, t, h, dv)
