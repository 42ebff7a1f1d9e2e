"""Dense causal flash attention in pure jnp (the baseline of tools/bench_dsa.py).

Block-tiled online softmax with a hand-written backward (custom_vjp, log-sum-exp saved), and the
blocks above the causal diagonal skipped with lax.cond, so it does ~T^2/2 work and keeps only
O(T) memory (plus one [block, block] tile per head). q [B, T, H, D], k [B, T, Hk, D],
v [B, T, Hk, Dv], Hk in {1, H}, S == T (prefill).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def _kv(x, hk):  # [B, blk, Hk, D] -> [B, Hk or 1, blk, D]
    return jnp.swapaxes(x, 1, 2)


def _blocks(x, blk):  # [B, T, ...] -> [n, B, blk, ...]
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // blk, blk, *x.shape[2:]), 1, 0)


def _unblocks(x):  # [n, B, blk, ...] -> [B, T, ...]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _scores(qb, kb, scale, i, j, blk):
    # qb [B, blk, H, D], kb [B, blk, Hk, D] -> [B, H, blk, blk] (masked, scaled)
    s = jnp.einsum("bqhd,bkhd->bhqk", qb, kb, preferred_element_type=_F32) * scale
    qi = i * blk + jnp.arange(blk)[:, None]
    kj = j * blk + jnp.arange(blk)[None, :]
    return jnp.where(kj <= qi, s, -jnp.inf)


def _bcast(kb, h):
    return jnp.broadcast_to(kb, kb.shape[:2] + (h,) + kb.shape[3:]) if kb.shape[2] == 1 else kb


def _fwd(q, k, v, scale, blk):
    b, t, h, d = q.shape
    n = t // blk
    qs, ks, vs = _blocks(q, blk), _blocks(k, blk), _blocks(v, blk)

    def per_q(i):
        qb = qs[i]

        def step(carry, j):
            def upd(c):
                m, l, acc = c
                s = _scores(qb, _bcast(ks[j], h), scale, i, j, blk)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - m_new[..., None])
                alpha = jnp.exp(m - m_new)
                acc = alpha[..., None] * acc + jnp.einsum(
                    "bhqk,bkhd->bhqd", p.astype(v.dtype), _bcast(vs[j], h),
                    preferred_element_type=_F32)
                return m_new, alpha * l + p.sum(-1), acc
            return jax.lax.cond(j <= i, upd, lambda c: c, carry), None

        init = (jnp.full((b, h, blk), -jnp.inf, _F32), jnp.zeros((b, h, blk), _F32),
                jnp.zeros((b, h, blk, v.shape[-1]), _F32))
        (m, l, acc), _ = jax.lax.scan(step, init, jnp.arange(n))
        o = acc / l[..., None]
        return jnp.swapaxes(o, 1, 2).astype(q.dtype), jnp.swapaxes(m + jnp.log(l), 1, 2)

    o, lse = jax.lax.map(per_q, jnp.arange(n))
    return _unblocks(o), _unblocks(lse)  # [B, T, H, Dv], [B, T, H]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q, k, v, scale, blk):
    return _fwd(q, k, v, scale, blk)[0]


def _flash_fwd(q, k, v, scale, blk):
    o, lse = _fwd(q, k, v, scale, blk)
    return o, (q, k, v, o, lse)


def _flash_bwd(scale, blk, res, do):
    q, k, v, o, lse = res
    b, t, h, d = q.shape
    hk = k.shape[2]
    n = t // blk
    delta = jnp.sum(do.astype(_F32) * o.astype(_F32), -1)  # [B, T, H]
    qs, ks, vs, dos = _blocks(q, blk), _blocks(k, blk), _blocks(v, blk), _blocks(do, blk)
    lses, deltas = _blocks(lse, blk), _blocks(delta, blk)

    def probs(i, j):
        s = _scores(qs[i], _bcast(ks[j], h), scale, i, j, blk)
        p = jnp.exp(s - jnp.swapaxes(lses[i], 1, 2)[..., None])
        dp = jnp.einsum("bqhd,bkhd->bhqk", dos[i], _bcast(vs[j], h), preferred_element_type=_F32)
        ds = p * (dp - jnp.swapaxes(deltas[i], 1, 2)[..., None]) * scale
        return p, ds

    def dq_block(i):
        def step(acc, j):
            def upd(a):
                _, ds = probs(i, j)
                return a + jnp.einsum("bhqk,bkhd->bqhd", ds, _bcast(ks[j], h).astype(_F32))
            return jax.lax.cond(j <= i, upd, lambda a: a, acc), None
        acc, _ = jax.lax.scan(step, jnp.zeros((b, blk, h, d), _F32), jnp.arange(n))
        return acc.astype(q.dtype)

    def dkv_block(j):
        def step(acc, i):
            def upd(a):
                dk, dv = a
                p, ds = probs(i, j)
                dv_c = jnp.einsum("bhqk,bqhd->bkhd", p, dos[i].astype(_F32))
                dk_c = jnp.einsum("bhqk,bqhd->bkhd", ds, qs[i].astype(_F32))
                if hk == 1:
                    dv_c, dk_c = dv_c.sum(2, keepdims=True), dk_c.sum(2, keepdims=True)
                return dk + dk_c, dv + dv_c
            return jax.lax.cond(i >= j, upd, lambda a: a, acc), None
        init = (jnp.zeros((b, blk, hk, d), _F32), jnp.zeros((b, blk, hk, v.shape[-1]), _F32))
        (dk, dv), _ = jax.lax.scan(step, init, jnp.arange(n))
        return dk.astype(k.dtype), dv.astype(v.dtype)

    dq = _unblocks(jax.lax.map(dq_block, jnp.arange(n)))
    dk, dv = jax.lax.map(dkv_block, jnp.arange(n))
    return dq, _unblocks(dk), _unblocks(dv)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, *, scale: float, block: int = 512):
    """Causal dense attention (S == T), differentiable; T must be a multiple of `block`
    (smaller T uses one block)."""
    t = q.shape[1]
    blk = min(block, t)
    if t % blk:
        raise ValueError(f"T={t} must be a multiple of block={blk}")
    return _flash(q, k, v, float(scale), blk)
