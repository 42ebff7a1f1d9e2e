"""Mosaic-TPU sparse attention kernels (forward and the backward's dq/P/dS kernel) for `dsa`.

Layout (the caller, `dsa._attn_fwd` / `dsa._attn_bwd_pallas`, folds KV heads into the batch so
that every kernel sees a single KV head):
    q [B, Tp, H, Dq], k [B, S, Dq], v [B, S, Dv], idx [B, Tp, Kp] int32 (-1 = empty slot),
    Tp a multiple of bq, Kp a multiple of kc.

Grid (B, Tp/bq, Kp/kc); the last axis is an "arbitrary" (sequential) reduction over chunks of
kc selected keys, the online-softmax state lives in VMEM scratch. K and V stay in HBM
(memory_space=ANY). The chunk's indices arrive twice: as an SMEM block (scalar reads give the DMA
source rows) and as a VMEM block [bq, 1, kc] (vector mask of the -1 slots). Each grid step
gathers its bq*kc K rows and bq*kc V rows with one `make_async_copy` per row into VMEM buffers
[bq, kc, 1, D] (K/V are viewed as [B, S, 1, D]: the row and slot indices then address untiled
leading dimensions; a single-row copy into the tiled second-minor dimension of a bfloat16 buffer
is rejected by Mosaic, "Offsets along tiled dimensions must be aligned to tiles") (all K copies are started,
then all V copies, then the K copies are waited for, so the V gather overlaps the Q.K^T / softmax part); -1 slots copy row 0 and are masked. The
gathered tiles feed batched dense matmuls ("qhd,qkd->qhk", batch = query).

Empty slots / rows follow `pallas_kernels.dsa_xla`: masked logits are -inf, a row with no
valid index gets O = 0 and LSE = -inf.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._bounds import sparse_bwd_cost, sparse_fwd_cost
from pallas_kernels.dsa_xla import NEG_INF
_F32 = jnp.float32


def _gather(idx_smem, hbm, buf, sem, b, bq, kc):
    """Start one row DMA per (query, slot): hbm[b, idx] -> buf[t, j]."""

    def row(t, carry):
        def slot(j, carry):
            s = jnp.maximum(idx_smem[0, t, 0, j], 0)  # -1 -> row 0 (masked later)
            pltpu.make_async_copy(hbm.at[b, s], buf.at[t, j], sem).start()
            return carry
        return jax.lax.fori_loop(0, kc, slot, carry)

    jax.lax.fori_loop(0, bq, row, 0)


def _wait(hbm, buf, sem, n):
    """Wait for n row copies issued by `_gather` on `sem` (each wait consumes one row)."""

    def body(_, carry):
        pltpu.make_async_copy(hbm.at[0, 0], buf.at[0, 0], sem).wait()
        return carry

    jax.lax.fori_loop(0, n, body, 0)


def _fwd_kernel(idx_smem, idx_ref, q_ref, k_hbm, v_hbm, o_ref, lse_ref,
                kbuf, vbuf, sems, m_sc, l_sc, acc_sc, *, scale, bq, kc):
    b, c = pl.program_id(0), pl.program_id(2)
    nc = pl.num_programs(2)

    @pl.when(c == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, _F32)
        l_sc[...] = jnp.zeros(l_sc.shape, _F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    _gather(idx_smem, k_hbm, kbuf, sems.at[0], b, bq, kc)
    _gather(idx_smem, v_hbm, vbuf, sems.at[1], b, bq, kc)
    _wait(k_hbm, kbuf, sems.at[0], bq * kc)

    q = q_ref[0]  # [bq, H, D]
    valid = idx_ref[0] >= 0  # [bq, 1, kc]
    s = jnp.einsum("qhd,qkd->qhk", q, kbuf[:, :, 0, :], preferred_element_type=_F32) * scale
    s = jnp.where(valid, s, NEG_INF)
    m = m_sc[...]  # [bq, H, 1]
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=-1, keepdims=True)
    m_sc[...] = m_new

    _wait(v_hbm, vbuf, sems.at[1], bq * kc)
    vg = vbuf[:, :, 0, :]
    acc_sc[...] = alpha * acc_sc[...] + jnp.einsum(
        "qhk,qkd->qhd", p.astype(vg.dtype), vg, preferred_element_type=_F32)

    @pl.when(c == nc - 1)
    def _():
        l = l_sc[...]
        m = m_sc[...]
        ok = l > 0
        l_safe = jnp.where(ok, l, 1.0)
        o_ref[0] = jnp.where(ok, acc_sc[...] / l_safe, 0.0).astype(o_ref.dtype)
        lse_ref[0] = jnp.where(ok, jnp.where(m == NEG_INF, 0.0, m) + jnp.log(l_safe), NEG_INF)


def _idx_specs(bq, kc):
    smem = pl.BlockSpec((1, bq, 1, kc), lambda bi, i, c: (bi, i, 0, c), memory_space=pltpu.SMEM)
    vmem = pl.BlockSpec((1, bq, 1, kc), lambda bi, i, c: (bi, i, 0, c))
    return smem, vmem


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def attn_fwd(q, k, v, idx, *, scale, bq, kc, interpret):
    """-> (o [B, Tp, H, Dv] in q.dtype, lse [B, Tp, H, 1] float32)."""
    b, tp, h, dq = q.shape
    dv = v.shape[-1]
    kp = idx.shape[-1]
    smem, vmem = _idx_specs(bq, kc)
    idx4 = idx[:, :, None, :]
    kern = functools.partial(_fwd_kernel, scale=scale, bq=bq, kc=kc)
    return pl.pallas_call(
        kern,
        out_shape=[jax.ShapeDtypeStruct((b, tp, h, dv), q.dtype),
                   jax.ShapeDtypeStruct((b, tp, h, 1), _F32)],
        grid=(b, tp // bq, kp // kc),
        in_specs=[smem, vmem,
                  pl.BlockSpec((1, bq, h, dq), lambda bi, i, c: (bi, i, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((1, bq, h, dv), lambda bi, i, c: (bi, i, 0, 0)),
                   pl.BlockSpec((1, bq, h, 1), lambda bi, i, c: (bi, i, 0, 0))],
        scratch_shapes=[pltpu.VMEM((bq, kc, 1, dq), k.dtype),
                        pltpu.VMEM((bq, kc, 1, dv), v.dtype),
                        pltpu.SemaphoreType.DMA((2,)),
                        pltpu.VMEM((bq, h, 1), _F32),
                        pltpu.VMEM((bq, h, 1), _F32),
                        pltpu.VMEM((bq, h, dv), _F32)],
        compiler_params=_params(),
        cost_estimate=sparse_fwd_cost(q, k, v, idx),
        interpret=interpret,
    )(idx4, idx4, q, k[:, :, None], v[:, :, None])


def _bwd_kernel(idx_smem, idx_ref, q_ref, k_hbm, v_hbm, do_ref, lse_ref, delta_ref,
                dq_ref, p_ref, ds_ref, kbuf, vbuf, sems, dq_sc, *, scale, bq, kc):
    b, c = pl.program_id(0), pl.program_id(2)
    nc = pl.num_programs(2)

    @pl.when(c == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, _F32)

    _gather(idx_smem, v_hbm, vbuf, sems.at[1], b, bq, kc)
    _gather(idx_smem, k_hbm, kbuf, sems.at[0], b, bq, kc)

    q = q_ref[0]  # [bq, H, D]
    do = do_ref[0].astype(_F32)  # [bq, H, Dv]
    lse = lse_ref[0]  # [bq, H, 1]
    delta = delta_ref[0]  # [bq, H, 1]
    valid = idx_ref[0] >= 0  # [bq, 1, kc]
    row_ok = lse > NEG_INF
    lse_safe = jnp.where(row_ok, lse, 0.0)

    _wait(v_hbm, vbuf, sems.at[1], bq * kc)
    dp = jnp.einsum("qhd,qkd->qhk", do, vbuf[:, :, 0, :].astype(_F32), preferred_element_type=_F32)
    _wait(k_hbm, kbuf, sems.at[0], bq * kc)
    kg = kbuf[:, :, 0, :]
    s = jnp.einsum("qhd,qkd->qhk", q, kg, preferred_element_type=_F32) * scale
    ok = valid & row_ok
    p = jnp.where(ok, jnp.exp(jnp.where(ok, s, 0.0) - lse_safe), 0.0)
    ds = p * (dp - delta) * scale
    dq_sc[...] += jnp.einsum("qhk,qkd->qhd", ds, kg.astype(_F32), preferred_element_type=_F32)
    p_ref[0] = p
    ds_ref[0] = ds

    @pl.when(c == nc - 1)
    def _():
        dq_ref[0] = dq_sc[...].astype(dq_ref.dtype)


def attn_bwd_dq(q, k, v, idx, do, lse, delta, *, scale, bq, kc, interpret):
    """lse, delta [B, Tp, H, 1] -> (dq [B, Tp, H, Dq], P, scale*dS [B, Tp, H, Kp] float32)."""
    b, tp, h, dq = q.shape
    dv = v.shape[-1]
    kp = idx.shape[-1]
    smem, vmem = _idx_specs(bq, kc)
    idx4 = idx[:, :, None, :]
    kern = functools.partial(_bwd_kernel, scale=scale, bq=bq, kc=kc)
    row4 = lambda bi, i, c: (bi, i, 0, 0)
    return pl.pallas_call(
        kern,
        out_shape=[jax.ShapeDtypeStruct((b, tp, h, dq), q.dtype),
                   jax.ShapeDtypeStruct((b, tp, h, kp), _F32),
                   jax.ShapeDtypeStruct((b, tp, h, kp), _F32)],
        grid=(b, tp // bq, kp // kc),
        in_specs=[smem, vmem,
                  pl.BlockSpec((1, bq, h, dq), row4),
                  pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((1, bq, h, dv), row4),
                  pl.BlockSpec((1, bq, h, 1), row4),
                  pl.BlockSpec((1, bq, h, 1), row4)],
        out_specs=[pl.BlockSpec((1, bq, h, dq), row4),
                   pl.BlockSpec((1, bq, h, kc), lambda bi, i, c: (bi, i, 0, c)),
                   pl.BlockSpec((1, bq, h, kc), lambda bi, i, c: (bi, i, 0, c))],
        scratch_shapes=[pltpu.VMEM((bq, kc, 1, dq), k.dtype),
                        pltpu.VMEM((bq, kc, 1, dv), v.dtype),
                        pltpu.SemaphoreType.DMA((2,)),
                        pltpu.VMEM((bq, h, dq), _F32)],
        compiler_params=_params(),
        cost_estimate=sparse_bwd_cost(q, k, v, idx),
        interpret=interpret,
    )(idx4, idx4, q, k[:, :, None], v[:, :, None], do, lse, delta)
