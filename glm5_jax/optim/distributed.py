"""Distributed Newton-Schulz: each Muon / Muon-Split matrix orthogonalised where its shards live.

The math is glm5_jax.optim.newton_schulz (which the single-device optimizer glm5_jax.optim.muon calls
too); this module only decides WHERE each matrix is orthogonalised when the parameters are sharded over
a mesh, and calls the same pieces (`leaf_to_pieces`, `orthogonalize_batches` -> `ns_matrix`,
`pieces_to_leaf`).

A Muon leaf [*lead, m, n] (lead = scanned layers, experts) is sharded by its PartitionSpec: lead dims
over some mesh axes (e.g. experts over `expert`), the matrix dims m / n over others (e.g. the embed or
latent dim over fsdp x expert x context, heads over tensor). Inside one `jax.shard_map` over the whole
mesh each device holds N local matrix shards [N, m/g_m, n/g_n]. With G = g_m * g_n the devices of
one matrix group (those that share the same lead slice):

  1. tiled all_to_all over the matrix axes (minor axis first): split the batch of N local shards G
     ways, concatenate the shards of each matrix -> [N/G, m, n] WHOLE matrices, each on exactly one
     device of the group (no replication: the same bytes as the shards, no gathered stack);
  2. Newton-Schulz + RMS scale on those N/G matrices (the work split G ways, no redundant compute);
  3. the inverse all_to_alls -> back to [N, m/g_m, n/g_n] shards in the parameter's layout.

This is Moonlight's distributed Muon (gather a matrix's shards only for its iterations, scatter the
result back) with the gather and scatter done for G matrices at once by one all_to_all each way.
The batch is walked in chunks (`lax.scan`; `chunk_bytes` of float32 whole matrices per device per
chunk), and the Nesterov combination of momentum and gradient is formed per chunk, so the only
leaf-sized buffers are the momentum (state) and the output. N is zero-padded to a multiple of G
(a zero matrix orthogonalises to zero) when it does not divide, e.g. a single [m, n] leaf: each
device of the group then handles at most one whole matrix.

Muon Split (HeadSplit): heads are whole on every device (num_heads % the n axes' size == 0), so the
split is applied to the local shard with num_heads / g_n heads; only m is exchanged.

Mesh axes that shard none of the leaf's dims (e.g. `data`) replicate it: those devices repeat the
same work (no mesh used here has one for the big leaves; see docs/scaleout.md).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .newton_schulz import HeadSplit, leaf_to_pieces, orthogonalize_batches, pieces_to_leaf

DEFAULT_CHUNK_BYTES = 256 * 2**20


def _entry_axes(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _matrix_axes(spec: P, ndim: int, mesh) -> tuple[list, list]:
    """(mesh axes of size > 1 sharding m, of size > 1 sharding n), each major to minor."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    if len(entries) != ndim:
        raise ValueError(f"PartitionSpec {spec} has more entries than the leaf's {ndim} dims")
    keep = lambda e: [a for a in _entry_axes(e) if mesh.shape[a] > 1]
    return keep(entries[-2]), keep(entries[-1])


def _chunk(per: int, m: int, n: int, chunk_bytes: int) -> int:
    """Largest divisor of `per` (whole matrices per device) with chunk x m x n float32 <= chunk_bytes."""
    cap = max(1, chunk_bytes // max(1, 4 * m * n))
    return max(d for d in range(1, min(per, cap) + 1) if per % d == 0)


def needs_exchange(spec: P, ndim: int, mesh) -> bool:
    """Whether a leaf with this spec is sharded over its matrix dims on `mesh` (else NS is local)."""
    m_axes, n_axes = _matrix_axes(spec, ndim, mesh)
    return bool(m_axes or n_axes)


def _orthogonalize_local(mu, g, coefs, combine, split, m_axes, n_axes, mesh, *, rms_scale, coeffs, steps,
                         eps, chunk_bytes, out_dtype):
    """Body of the shard_map: this device's shards of one leaf -> its shards of the Muon direction."""
    # an unsplit leaf is only reshaped (no float32 copy of the bf16 gradient); the split leaves are small
    mps = leaf_to_pieces(mu, split, cast=split is not None)
    gps = leaf_to_pieces(g, split, cast=split is not None)
    exch_n = [] if split is not None else n_axes            # split: whole heads locally, n is not exchanged
    sizes = [mesh.shape[a] for a in m_axes + exch_n]
    group = math.prod(sizes)
    outs = []
    for mp, gp in zip(mps, gps):
        num, ml, nl = mp.shape
        mfull = ml * math.prod(mesh.shape[a] for a in m_axes)
        nfull = nl * math.prod(mesh.shape[a] for a in exch_n)
        per = -(-num // group)
        c = _chunk(per, mfull, nfull, chunk_bytes)
        k = per // c
        pad = k * c * group - num
        if pad:
            mp = jnp.pad(mp, ((0, pad), (0, 0), (0, 0)))
            gp = jnp.pad(gp, ((0, pad), (0, 0), (0, 0)))
        mp = mp.reshape((k, c * group, ml, nl))
        gp = gp.reshape((k, c * group, ml, nl))

        def body(_, xs):
            u = combine(xs[0], xs[1], *coefs)                  # [c*G, m/g_m, n/g_n] float32
            for a in reversed(m_axes):                         # minor axis first: shards concatenate in order
                u = jax.lax.all_to_all(u, a, 0, 1, tiled=True)
            for a in reversed(exch_n):
                u = jax.lax.all_to_all(u, a, 0, 2, tiled=True)
            o = orthogonalize_batches([u], rms_scale=rms_scale, coeffs=coeffs, steps=steps, eps=eps)[0]
            for a in exch_n:                                   # the inverse, in the reverse order
                o = jax.lax.all_to_all(o, a, 2, 0, tiled=True)
            for a in m_axes:
                o = jax.lax.all_to_all(o, a, 1, 0, tiled=True)
            return None, o.astype(out_dtype)

        _, o = jax.lax.scan(body, None, (mp, gp))
        outs.append(o.reshape((k * c * group, ml, nl))[:num])
    return pieces_to_leaf(outs, mu.shape, split)


def orthogonalize_sharded(mu: jax.Array, g: jax.Array, coefs: Sequence, combine: Callable, spec: P,
                          split: Optional[HeadSplit], mesh, *, rms_scale, coeffs, steps: int, eps: float,
                          chunk_bytes: int = DEFAULT_CHUNK_BYTES, out_dtype=None) -> jax.Array:
    """The Muon direction of one leaf on `mesh` (an abstract or concrete mesh of > 1 device):
    `combine(mu, g, *coefs)` (the momentum look-ahead, float32), Newton-Schulz and RMS scale per matrix
    (per head / segment with `split`), in `out_dtype` (default g.dtype), sharded as `spec`.
    Equal to the single-device `orthogonalize_leaf(combine(mu, g, *coefs), split)` up to float rounding."""
    out_dtype = g.dtype if out_dtype is None else out_dtype
    m_axes, n_axes = _matrix_axes(spec, mu.ndim, mesh)
    local_split = split
    if split is not None and n_axes:
        gn = math.prod(mesh.shape[a] for a in n_axes)
        if split.num_heads % gn:
            raise ValueError(f"Muon Split: {split.num_heads} heads do not divide over mesh axes "
                             f"{'*'.join(n_axes)}={gn} of the leaf's last dim (spec {spec}); heads must be whole "
                             "on every device")
        local_split = HeadSplit(split.num_heads // gn, split.segments)
    coefs = tuple(jnp.asarray(c, jnp.float32) for c in coefs)

    def local(mu, g, *coefs):
        return _orthogonalize_local(mu, g, coefs, combine, local_split, m_axes, n_axes, mesh,
                                    rms_scale=rms_scale, coeffs=coeffs, steps=steps, eps=eps,
                                    chunk_bytes=chunk_bytes, out_dtype=out_dtype)

    spec = P(*(tuple(spec) + (None,) * (mu.ndim - len(tuple(spec)))))
    fn = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec) + (P(),) * len(coefs), out_specs=spec,
                       check_vma=False)
    return fn(mu, g, *coefs)


__all__ = ["DEFAULT_CHUNK_BYTES", "needs_exchange", "orthogonalize_sharded"]
