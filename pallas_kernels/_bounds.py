"""Kernel-body math shared by the indexer's Mosaic (dsa.py) and Triton (indexer_triton.py) kernels:
plain jnp on values already loaded from refs, so each platform keeps only its own ref indexing.
And the cost estimates every DSA pallas_call carries (`*_cost`: the kernel's matmul FLOPs, exps and
HBM bytes as closed forms of its operand shapes; tools.budget counts them)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def dot_t(a, b):
    """a [m, d] @ b[n, d]^T -> [m, n] in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def head_bound(qj, wj, kmax, kmin):
    """Upper bound of w_j * relu(q_j . k) over every key k in a block with per-dim [kmin, kmax]:
    qj [bq, Di], wj [bq, 1], kmax/kmin [nk, Di] -> [bq, nk]."""
    qp, qn = jnp.maximum(qj, 0.0), jnp.minimum(qj, 0.0)
    hi = dot_t(qp, kmax) + dot_t(qn, kmin)
    lo = dot_t(qp, kmin) + dot_t(qn, kmax)
    return jnp.where(wj >= 0, wj * jnp.maximum(hi, 0.0), wj * jnp.maximum(lo, 0.0))


def block_visible(i, bq, bk, nk, t_total, shift, causal):
    """[bq, nk] bool: query rows i*bq.. that exist and (causal) can see a key block's first key.
    Causal: local query t sits at key position t + shift (shift = S - T: bottom-right alignment; under
    context parallelism the chunk's global query offset; a traced scalar read from a ref is fine)."""
    t = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, nk), 0)
    kb0 = jax.lax.broadcasted_iota(jnp.int32, (bq, nk), 1) * bk
    vis = t < t_total
    if causal:
        vis = vis & (kb0 <= t + shift)
    return vis


def nbytes(*xs) -> int:
    """Total bytes of arrays / ShapeDtypeStructs (None skipped)."""
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in xs if x is not None))


def cost(flops, transcendentals, bytes_accessed):
    """The pallas_call cost estimate (TPU: written into the tpu_custom_call's backend config, which
    tools.budget counts; XLA's own cost analysis cannot see into a kernel). Integers, >= 0."""
    from jax.experimental import pallas as pl
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                           bytes_accessed=int(bytes_accessed))


def sparse_fwd_cost(q, k, v, idx):
    """Sparse attention forward over q [B, Tp, H, Dq], selected rows of k [.., Dq] / v [.., Dv], idx
    [B, Tp, Kp]: the two matmuls 2 B Tp H Kp (Dq + Dv) FLOPs, one exp per (query, head, slot); bytes:
    q, the index blocks (read twice: DMA addresses and mask), the gathered K and V rows, O and the LSE."""
    b, tp, h, dq = q.shape
    kp, dv = idx.shape[-1], v.shape[-1]
    isz = lambda x: jnp.dtype(x.dtype).itemsize
    rows = b * tp * kp * (dq * isz(k) + dv * isz(v))
    out = b * tp * h * (dv * isz(q) + 4)
    return cost(2 * b * tp * h * kp * (dq + dv), b * tp * h * kp, nbytes(q) + 2 * nbytes(idx) + rows + out)


def sparse_bwd_cost(q, k, v, idx):
    """The backward's dq / P / dS kernel: S = q K^T, dP = dO V^T, dq += dS K: 2 B Tp H Kp (2 Dq + Dv)
    FLOPs, one exp per (query, head, slot); bytes: q, dO, LSE, delta, the index blocks (twice), the
    gathered rows, dq and the float32 P and dS written out."""
    b, tp, h, dq = q.shape
    kp, dv = idx.shape[-1], v.shape[-1]
    isz = lambda x: jnp.dtype(x.dtype).itemsize
    rows = b * tp * kp * (dq * isz(k) + dv * isz(v))
    io = b * tp * h * (2 * dq * isz(q) + dv * isz(q) + 8) + 2 * b * tp * h * kp * 4
    return cost(2 * b * tp * h * kp * (2 * dq + dv), b * tp * h * kp, 2 * nbytes(idx) + rows + io)


def bound_cost(qp, wp, kmax, kmin, segq, smin, smax, n_out):
    """Indexer block bound: 4 matmuls [Tp, Di] x [Di, nk] per index head (q+/q- against kmax/kmin):
    8 B Tp nk Hi Di FLOPs; bytes: the inputs once and the [B, nq, nk] float32 bound."""
    b, tp, hi, di = qp.shape
    nk = kmax.shape[1]
    return cost(8 * b * tp * nk * hi * di, 0, nbytes(qp, wp, kmax, kmin, segq, smin, smax) + 4 * n_out)


def score_cost(qp, wp, kp, n_blocks, bq, bk):
    """Indexer token scoring of one round of `n_blocks` table entries per query block: 2 B Tp
    n_blocks bk Hi Di FLOPs (the q.k matmuls; every entry counted, an inactive one does less);
    bytes: q, w once, one [bk, Di] key block (+ its segment ids) per (query block, entry), the
    [B, Tp, n_blocks bk] float32 scores."""
    b, tp, hi, di = qp.shape
    nq = tp // bq
    keys = b * nq * n_blocks * bk * (di * jnp.dtype(kp.dtype).itemsize + 4)
    return cost(2 * b * tp * n_blocks * bk * hi * di, 0, nbytes(qp, wp) + 4 * b * tp + keys + 4 * b * tp * n_blocks * bk)
