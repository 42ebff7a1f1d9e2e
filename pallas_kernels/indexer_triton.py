"""Pallas-Triton (GPU) kernels of the lightning indexer's top-k (`dsa.indexer_topk`): the block bound
and the token scoring over a block table, the same math as the Mosaic kernels in `dsa`.

Triton has no scalar prefetch: the block table, its activity flags and the round offset are plain
global-memory arrays read with scalar loads, and the selected key block is a dynamic slice of the
whole K array (`k_ref[b, pl.ds(kb * bk, bk)]`). Every operand is a whole array (no BlockSpecs;
Triton blocks are only pointer bases), indexed by the program ids. Triton block shapes must be
powers of two: the caller pads the key-block count to one (`nkp`); bq, bk, Di must already be
(GLM-5: 128, 128, 128). Inactive table entries are masked to -inf rather than skipped (no
control flow in the kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._bounds import block_visible, bound_cost, dot_t, head_bound, score_cost
from pallas_kernels.dsa_xla import NEG_INF

_F32 = jnp.float32


_dot_t = dot_t


def _params():
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=4, num_stages=1)


def _bound_kernel(q_ref, w_ref, kmax_ref, kmin_ref, segq_ref, smin_ref, smax_ref, shift_ref, ub_ref, *,
                  n_heads, bq, bk, t_total, causal):
    bi, i = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * bq, bq)
    kmax = kmax_ref[bi].astype(_F32)  # [nkp, Di]
    kmin = kmin_ref[bi].astype(_F32)
    nk = kmax.shape[0]
    acc = jnp.zeros((bq, nk), _F32)
    for j in range(n_heads):
        acc = acc + head_bound(q_ref[bi, rows, j, :].astype(_F32), w_ref[bi, rows, j].astype(_F32)[:, None],
                               kmax, kmin)
    vis = block_visible(i, bq, bk, nk, t_total, shift_ref[0], causal)
    seg = segq_ref[bi, rows][:, None]
    vis = vis & (seg >= smin_ref[bi][None, :]) & (seg <= smax_ref[bi][None, :])
    ub_ref[bi, i, :] = jnp.max(jnp.where(vis, acc, NEG_INF), axis=0)


def block_bounds(qp, wp, kmax, kmin, segq, smin, smax, shift, *, bq, bk, t_total, s_total, causal, interpret):
    """qp [B, Tp, Hi, Di], wp [B, Tp, Hi], kmax/kmin [B, nkp, Di], segq [B, Tp], smin/smax [B, nkp],
    shift int32 [1] (causal: local query t sits at key position t + shift) -> UB [B, Tp / bq, nkp]."""
    b, tp, hi, _ = qp.shape
    nq, nkp = tp // bq, kmax.shape[1]
    del s_total
    kern = functools.partial(_bound_kernel, n_heads=hi, bq=bq, bk=bk, t_total=t_total, causal=causal)
    return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((b, nq, nkp), _F32), grid=(b, nq),
                          compiler_params=None if interpret else _params(),
                          cost_estimate=bound_cost(qp, wp, kmax, kmin, segq, smin, smax, b * nq * nkp),
                          interpret=interpret)(qp, wp, kmax, kmin, segq, smin, smax, shift)


def _score_kernel(tbl_ref, act_ref, off_ref, q_ref, w_ref, k_ref, segq_ref, segk_ref, o_ref, *,
                  n_heads, bq, bk, t_total, s_total, causal):
    bi, i, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pos = off_ref[0] + c
    kb = tbl_ref[bi, i, pos]
    active = act_ref[bi, i, pos] > 0
    rows, keys = pl.ds(i * bq, bq), pl.ds(kb * bk, bk)
    k = k_ref[bi, keys, :].astype(_F32)  # [bk, Di]
    acc = jnp.zeros((bq, bk), _F32)
    for j in range(n_heads):
        d = _dot_t(q_ref[bi, rows, j, :].astype(_F32), k)
        acc = acc + w_ref[bi, rows, j].astype(_F32)[:, None] * jnp.maximum(d, 0.0)
    t = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    s = kb * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    vis = active & (s < s_total) & (segq_ref[bi, rows][:, None] == segk_ref[bi, keys][None, :])
    if causal:   # off_ref[1]: the causal shift (S - T, or the context chunk's global query offset)
        vis = vis & (s <= t + off_ref[1])
    o_ref[bi, rows, pl.ds(c * bk, bk)] = jnp.where(vis, acc, NEG_INF)


def score_round(tbl, act, off, qp, wp, kp, segq, segk, n_blocks, *, bq, bk, t_total, s_total, causal,
                interpret):
    """Scores [B, Tp, n_blocks * bk] of the table entries off[0] .. off[0] + n_blocks - 1 (off int32
    [2] = [round offset, causal shift]; segq [B, Tp], segk [B, Sp])."""
    b, tp, hi, _ = qp.shape
    kern = functools.partial(_score_kernel, n_heads=hi, bq=bq, bk=bk, t_total=t_total,
                             s_total=s_total, causal=causal)
    off_arr = jnp.asarray(off, jnp.int32)
    return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((b, tp, n_blocks * bk), _F32),
                          grid=(b, tp // bq, n_blocks), compiler_params=None if interpret else _params(),
                          cost_estimate=score_cost(qp, wp, kp, n_blocks, bq, bk),
                          interpret=interpret)(tbl, act, off_arr, qp, wp, kp, segq, segk)
