"""Mosaic-TPU backward of MLA's MQA sparse attention, fused with the key gradient's scatter-add.

The backward of `pallas_kernels.dsa_xla.sparse_mqa_uv` (one shared [latent | k_rope] row per key, the value
the first r columns of that row) per query, as the jnp path computes it chunk by chunk, but with nothing
per selected slot written to HBM:

    [S ; dP] = [q ; dO] K_sel^T          [2H, K]  (dO zero-padded to Dq: dP = dO V_sel^T)
    P = exp(S - lse), delta = rowsum(P . dP), dS = P (dP - delta) scale
    [O ; dq] = [P ; dS] K_sel            [2H, Dq] (O = P V_sel in its first r columns)
    dK[idx] += [dS ; P]^T [q ; dO]       [K, Dq]  float32, read-modify-write of the selected rows

Grid (B, T): one query per step, all of its K selected rows at once (delta needs the whole row of P . dP).
K stays in HBM (memory_space=ANY) viewed as [B, S, 1, Dq]; the step gathers its rows with one
`make_async_copy` per slot into VMEM [K, 1, Dq] (the layout `sparse_attn_tpu` uses: the slot addresses an
untiled leading dimension; an empty slot reads row 0 and is masked). The float32 dK accumulator is an aliased
HBM input/output: the step reads the selected rows of dK into VMEM, adds the row gradients and writes them back,
each with one DMA per valid slot. Empty (-1) slots start no dK DMA at all: they would alias row 0, which the same query may
also have selected. Both grid axes are "arbitrary" (sequential on one core): two queries that selected the
same key must not update its row at the same time, and a step waits for its writes before the next
step's reads. Top-k slots of one query are distinct keys, so one step never writes a row twice.

HBM traffic per query: its K rows once (bfloat16) and its dK rows twice (float32, read and write),
against the jnp path's row gather, gathered-row reads by two matmuls, a float32 row-gradient tile written
and read again, and the scatter (docs/scaleout.md, the 128K row). The cost estimate says exactly this.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._bounds import cost, nbytes
from pallas_kernels.dsa_xla import NEG_INF

_F32 = jnp.float32
# The scoped VMEM limit: at GLM-5's shapes (64 heads, Dq 576, top-2048) one step needs ~42 MiB (the TPU compiler's
# CompileTimeScopedVmemOom at 32 and 40 MiB), under v5p's 64 MiB a core (pltpu.get_tpu_info_for_chip).
_VMEM_LIMIT = 48 * 2**20


def _rows(idx_smem, nk, copy, every=False):
    """Start copy(slot, key) for every valid slot of this step's query (every=True: for every slot, an empty one
    with key 0, as the jnp path gathers); -> the number started."""

    def body(j, n):
        s = idx_smem[0, 0, 0, j]
        if every:
            copy(j, jnp.maximum(s, 0)).start()
            return n + 1

        @pl.when(s >= 0)
        def _():
            copy(j, s).start()

        return n + (s >= 0).astype(jnp.int32)

    return jax.lax.fori_loop(0, nk, body, jnp.int32(0))


def _wait(desc, n):
    """Wait for n single-row copies on desc's semaphore (each wait consumes one row's bytes)."""

    def body(_, carry):
        desc.wait()
        return carry

    jax.lax.fori_loop(0, n, body, 0)


def _bwd_kernel(idx_smem, idx_ref, q_ref, do_ref, lse_ref, k_hbm, _dk_in, odq_ref, dk_hbm, kbuf, dkbuf,
                sems, *, scale, nk, h):
    b = pl.program_id(0)
    # every K slot is filled (an empty one with row 0, masked below): a VMEM row left from an earlier step could
    # hold a NaN, and 0 * NaN in the matmuls would reach dq and O
    n_k = _rows(idx_smem, nk, lambda j, s: pltpu.make_async_copy(k_hbm.at[b, s], kbuf.at[j], sems.at[0]), every=True)
    n_r = _rows(idx_smem, nk, lambda j, s: pltpu.make_async_copy(dk_hbm.at[b, s], dkbuf.at[j], sems.at[1]))

    qd = jnp.concatenate([q_ref[0, 0], do_ref[0, 0]], axis=0)                  # [2H, Dq]
    valid = idx_ref[0, 0] >= 0                                                   # [1, K]
    lse = lse_ref[0, 0]                                                          # [H, 1]
    _wait(pltpu.make_async_copy(k_hbm.at[0, 0], kbuf.at[0], sems.at[0]), n_k)
    kv = kbuf[:, 0, :]                                                           # [K, Dq]
    sdp = jax.lax.dot_general(qd, kv, (((1,), (1,)), ((), ())), preferred_element_type=_F32)  # [2H, K]
    p = jnp.exp(jnp.where(valid, sdp[:h] * scale - lse, NEG_INF))
    dp = sdp[h:]
    delta = jnp.sum(p * dp, axis=1, keepdims=True)                               # [H, 1]
    ds = p * (dp - delta) * scale
    odq_ref[0, 0] = jnp.dot(jnp.concatenate([p, ds], axis=0).astype(kv.dtype), kv,
                            preferred_element_type=_F32).astype(odq_ref.dtype)   # [2H, Dq]
    dsp = jnp.concatenate([ds, p], axis=0).astype(qd.dtype)                      # [2H, K]
    drow = jax.lax.dot_general(dsp, qd, (((0,), (0,)), ((), ())), preferred_element_type=_F32)  # [K, Dq]

    _wait(pltpu.make_async_copy(dk_hbm.at[0, 0], dkbuf.at[0], sems.at[1]), n_r)
    dkbuf[:, 0, :] = dkbuf[:, 0, :] + drow
    n_w = _rows(idx_smem, nk, lambda j, s: pltpu.make_async_copy(dkbuf.at[j], dk_hbm.at[b, s], sems.at[2]))
    _wait(pltpu.make_async_copy(dkbuf.at[0], dk_hbm.at[0, 0], sems.at[2]), n_w)


def mqa_bwd_cost(q, k, idx):
    """Per query: the three matmuls over its K rows, 2 K 2H Dq each (12 B T H K Dq FLOPs), one exp per
    (query, head, slot); bytes: q and dO, the LSE, the index block (twice: DMA addresses and mask), the
    gathered K rows, the selected dK rows read and written in float32, and [O ; dq] written."""
    b, t, h, dq = q.shape
    kk = idx.shape[-1]
    isz = jnp.dtype(q.dtype).itemsize
    rows = b * t * kk * dq * (jnp.dtype(k.dtype).itemsize + 2 * 4)
    io = b * t * h * (2 * dq * isz + 4) + b * t * 2 * h * dq * isz
    return cost(12 * b * t * h * kk * dq, b * t * h * kk, 2 * nbytes(idx) + rows + io)


def mqa_bwd(q, k, do, idx, lse, *, scale, interpret=False):
    """q, do [B, T, H, Dq] (do zero past the value width r), k [B, S, Dq], idx int32 [B, T, K] (-1 = empty),
    lse float32 [B, T, H] (the forward's; rows without a valid slot are never used) ->
    (odq [B, T, 2H, Dq] in q's dtype: rows :H hold O = P V (its first r columns), rows H: dq;
     dk float32 [B, S, Dq])."""
    b, t, h, dq = q.shape
    s = k.shape[1]
    nk = idx.shape[-1]
    idx4 = idx.astype(jnp.int32)[:, :, None, :]
    row = lambda bi, ti: (bi, ti, 0, 0)
    kern = functools.partial(_bwd_kernel, scale=float(scale), nk=nk, h=h)
    odq, dk = pl.pallas_call(
        kern,
        out_shape=[jax.ShapeDtypeStruct((b, t, 2 * h, dq), q.dtype),
                   jax.ShapeDtypeStruct((b, s, 1, dq), _F32)],
        grid=(b, t),
        in_specs=[pl.BlockSpec((1, 1, 1, nk), row, memory_space=pltpu.SMEM),
                  pl.BlockSpec((1, 1, 1, nk), row),
                  pl.BlockSpec((1, 1, h, dq), row),
                  pl.BlockSpec((1, 1, h, dq), row),
                  pl.BlockSpec((1, 1, h, 1), row),
                  pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((1, 1, 2 * h, dq), row),
                   pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((nk, 1, dq), k.dtype),
                        pltpu.VMEM((nk, 1, dq), _F32),
                        pltpu.SemaphoreType.DMA((3,))],
        input_output_aliases={6: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=_VMEM_LIMIT),
        cost_estimate=mqa_bwd_cost(q, k, idx),
        interpret=interpret,
    )(idx4, idx4, q, do.astype(q.dtype), lse.astype(_F32)[..., None], k[:, :, None],
      jnp.zeros((b, s, 1, dq), _F32))
    return odq, dk[:, :, 0]
