"""Kernel-body math shared by the indexer's Mosaic (dsa.py) and Triton (indexer_triton.py) kernels:
plain jnp on values already loaded from refs, so each platform keeps only its own ref indexing."""

from __future__ import annotations

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


def block_visible(i, bq, bk, nk, t_total, s_total, causal):
    """[bq, nk] bool: query rows i*bq.. that exist and (causal) can see a key block's first key."""
    t = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, nk), 0)
    kb0 = jax.lax.broadcasted_iota(jnp.int32, (bq, nk), 1) * bk
    vis = t < t_total
    if causal:
        vis = vis & (kb0 <= t + (s_total - t_total))
    return vis
