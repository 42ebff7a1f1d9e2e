"""Pallas-Triton (GPU) sparse attention kernels (forward and the backward's dq/P/dS kernel).

One program per (batch, query): q [Hp, Dp] against chunks of kc selected keys. K/V stay in global
memory (a Triton block is only a pointer base, nothing is staged in shared memory); the chunk's
rows are gathered with an index-array load `k_ref[0, ids]` -> [kc, Dp]. The logits and P.V are
plain 2-D `tl.dot`s ([Hp, Dp] x [Dp, kc], [Hp, kc] x [kc, Dvp]), so the caller pads H, Dq, Dv
and kc to powers of two >= 16 (Triton tensor shapes must be powers of two, tl.dot needs every
dimension >= 16). Layout as in `sparse_attn_tpu`: KV heads folded into the batch,
q [B, Tp, Hp, Dp], k [B, S, Dp], v [B, S, Dvp], idx [B, Tp, Kp] (-1 = empty slot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._bounds import sparse_bwd_cost, sparse_fwd_cost
from pallas_kernels.dsa_xla import NEG_INF
_F32 = jnp.float32


def _params():
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=4, num_stages=1)


def _dot_t(a, b):  # a [m, d] . b [n, d]^T -> [m, n] f32
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _dot(a, b):  # a [m, k] . b [k, n] -> [m, n] f32
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)


def _chunk(idx_ref, k_ref, v_ref, c, kc):
    ids = idx_ref[0, 0, pl.ds(c * kc, kc)]  # [kc]
    valid = ids >= 0
    safe = jnp.where(valid, ids, 0)
    return valid, k_ref[0, safe], v_ref[0, safe]  # [kc], [kc, Dp], [kc, Dvp]


def _fwd_kernel(idx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, kc, n_chunks):
    q = q_ref[0, 0]  # [Hp, Dp]
    h = q.shape[0]
    dv = v_ref.shape[-1]

    def body(c, carry):
        m, l, acc = carry
        valid, kg, vg = _chunk(idx_ref, k_ref, v_ref, c, kc)
        s = _dot_t(q, kg) * scale
        s = jnp.where(valid[None, :], s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[:, None] * acc + _dot(p.astype(vg.dtype), vg)
        return m_new, l, acc

    init = (jnp.full((h,), NEG_INF, _F32), jnp.zeros((h,), _F32), jnp.zeros((h, dv), _F32))
    m, l, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    ok = l > 0
    l_safe = jnp.where(ok, l, 1.0)
    o_ref[0, 0] = jnp.where(ok[:, None], acc / l_safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[0, 0] = jnp.where(ok, jnp.where(m == NEG_INF, 0.0, m) + jnp.log(l_safe), NEG_INF)


def attn_fwd(q, k, v, idx, *, scale, kc):
    """-> (o [B, Tp, Hp, Dvp] in q.dtype, lse [B, Tp, Hp] float32)."""
    b, tp, h, dq = q.shape
    s, dv = k.shape[1], v.shape[-1]
    kp = idx.shape[-1]
    kern = functools.partial(_fwd_kernel, scale=scale, kc=kc, n_chunks=kp // kc)
    return pl.pallas_call(
        kern,
        out_shape=[jax.ShapeDtypeStruct((b, tp, h, dv), q.dtype),
                   jax.ShapeDtypeStruct((b, tp, h), _F32)],
        grid=(b, tp),
        in_specs=[pl.BlockSpec((1, 1, kp), lambda bi, t: (bi, t, 0)),
                  pl.BlockSpec((1, 1, h, dq), lambda bi, t: (bi, t, 0, 0)),
                  pl.BlockSpec((1, s, dq), lambda bi, t: (bi, 0, 0)),
                  pl.BlockSpec((1, s, dv), lambda bi, t: (bi, 0, 0))],
        out_specs=[pl.BlockSpec((1, 1, h, dv), lambda bi, t: (bi, t, 0, 0)),
                   pl.BlockSpec((1, 1, h), lambda bi, t: (bi, t, 0))],
        compiler_params=_params(),
        cost_estimate=sparse_fwd_cost(q, k, v, idx),
    )(idx, q, k, v)


def _bwd_kernel(idx_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, p_ref, ds_ref,
                *, scale, kc, n_chunks):
    q = q_ref[0, 0]  # [Hp, Dp]
    do = do_ref[0, 0].astype(_F32)  # [Hp, Dvp]
    lse = lse_ref[0, 0]  # [Hp]
    delta = delta_ref[0, 0]
    row_ok = (lse > NEG_INF)[:, None]
    lse_safe = jnp.where(lse > NEG_INF, lse, 0.0)

    def body(c, dq):
        valid, kg, vg = _chunk(idx_ref, k_ref, v_ref, c, kc)
        s = _dot_t(q, kg) * scale
        ok = valid[None, :] & row_ok
        p = jnp.where(ok, jnp.exp(jnp.where(ok, s, 0.0) - lse_safe[:, None]), 0.0)
        dp = _dot_t(do, vg.astype(_F32))
        ds = p * (dp - delta[:, None]) * scale
        p_ref[0, 0, :, pl.ds(c * kc, kc)] = p
        ds_ref[0, 0, :, pl.ds(c * kc, kc)] = ds
        return dq + _dot(ds, kg.astype(_F32))

    dq = jax.lax.fori_loop(0, n_chunks, body, jnp.zeros(q.shape, _F32))
    dq_ref[0, 0] = dq.astype(dq_ref.dtype)


def attn_bwd_dq(q, k, v, idx, do, lse, delta, *, scale, kc):
    """lse, delta [B, Tp, Hp] -> (dq [B, Tp, Hp, Dp], P, scale*dS [B, Tp, Hp, Kp] float32)."""
    b, tp, h, dq = q.shape
    s, dv = k.shape[1], v.shape[-1]
    kp = idx.shape[-1]
    kern = functools.partial(_bwd_kernel, scale=scale, kc=kc, n_chunks=kp // kc)
    row3 = lambda bi, t: (bi, t, 0)
    row4 = lambda bi, t: (bi, t, 0, 0)
    return pl.pallas_call(
        kern,
        out_shape=[jax.ShapeDtypeStruct((b, tp, h, dq), q.dtype),
                   jax.ShapeDtypeStruct((b, tp, h, kp), _F32),
                   jax.ShapeDtypeStruct((b, tp, h, kp), _F32)],
        grid=(b, tp),
        in_specs=[pl.BlockSpec((1, 1, kp), row3),
                  pl.BlockSpec((1, 1, h, dq), row4),
                  pl.BlockSpec((1, s, dq), lambda bi, t: (bi, 0, 0)),
                  pl.BlockSpec((1, s, dv), lambda bi, t: (bi, 0, 0)),
                  pl.BlockSpec((1, 1, h, dv), row4),
                  pl.BlockSpec((1, 1, h), row3),
                  pl.BlockSpec((1, 1, h), row3)],
        out_specs=[pl.BlockSpec((1, 1, h, dq), row4),
                   pl.BlockSpec((1, 1, h, kp), row4),
                   pl.BlockSpec((1, 1, h, kp), row4)],
        compiler_params=_params(),
        cost_estimate=sparse_bwd_cost(q, k, v, idx),
    )(idx, q, k, v, do, lse, delta)
