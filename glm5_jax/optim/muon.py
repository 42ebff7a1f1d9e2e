"""Muon (momentum orthogonalised by Newton-Schulz) as an optax transformation.

Update for a matrix leaf W (kernel layout [in, out]). Every axis before the last two is a batch
axis: the scanned layer axis [repeats] of a stacked layer leaf, the expert axis, or both
([repeats, E, in, out]); each [in, out] slice is its own matrix.

    m_t   = beta * m_{t-1} + (1 - beta) * g_t                   (EMA momentum, float32)
    u_t   = beta * m_t + (1 - beta) * g_t                       (Nesterov look-ahead)
    O_t   = NS5(u_t / ||u_t||_F)                                (per matrix, float32)
    out_t = rms_scale * sqrt(max(fan_in, fan_out)) * O_t        (AdamW-matched RMS, Moonlight)

Learning rate and decoupled weight decay are applied outside (see ``make_optimizer``), so the
final parameter step is ``-lr * (out_t + wd * W)``.

Muon Split: a leaf may be given a :class:`HeadSplit`; its last axis is then viewed as
``[heads, sum(segments)]`` and every (head, segment) slice is orthogonalised (and RMS-scaled
with its own fan-in/fan-out) as an independent matrix.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from glm5_jax.utils import path_to_str

from .newton_schulz import (NS_COEFFS, NS_STEPS, HeadSplit, leaf_to_pieces, newton_schulz, orthogonalize_batches,
                            orthogonalize_leaf, pieces_to_leaf)

__all__ = ["NS_COEFFS", "NS_STEPS", "HeadSplit", "newton_schulz", "orthogonalize_leaf", "MuonState", "scale_by_muon",
           "muon"]

SplitFn = Callable[[str, tuple], Optional[HeadSplit]]
SpecFn = Callable[[str], Any]     # '/'-joined path -> the leaf's PartitionSpec on the mesh (None: unknown)


# --------------------------------------------------------------------------------------------
# The transformation
# --------------------------------------------------------------------------------------------
class MuonState(NamedTuple):
    count: jax.Array   # int32 scalar
    mu: Any            # float32 momentum, same tree as params


def scale_by_muon(*, beta: float = 0.95, nesterov: bool = True, bias_correction: bool = False,
                  rms_scale: Optional[float] = 0.2, coeffs: Sequence[float] = NS_COEFFS,
                  steps: int = NS_STEPS, eps: float = 1e-7, split_fn: Optional[SplitFn] = None,
                  mu_dtype=jnp.float32, spec_fn: Optional[SpecFn] = None,
                  chunk_bytes: Optional[int] = None) -> optax.GradientTransformation:
    """Muon direction (momentum -> Newton-Schulz -> RMS scale). No learning rate, no decay.

    ``split_fn(path, shape) -> HeadSplit | None`` chooses the Muon-Split view per leaf (path is the
    '/'-joined key path). ``bias_correction=True`` reproduces optax.contrib.muon's bias-corrected
    Nesterov combination exactly; the default (False) is the original Muon/Moonlight form. Both
    give the same direction on step 1 and converge to the same one as beta^t -> 0.
    Each leaf is one batched NS call over its leading axes (a layer stack's [repeats] axis, experts,
    Muon-Split heads): the scanned layout already batches same-shape matrices, so leaves are never
    concatenated (which would also mix their shardings).

    ``spec_fn(path) -> PartitionSpec`` (the parameter's sharding): when the step is traced under a
    mesh of more than one device (jax.sharding.get_abstract_mesh()), every leaf with a spec is
    orthogonalised where its shards live (glm5_jax.optim.distributed: all_to_all of its matrices'
    shards, Newton-Schulz on whole matrices split over the devices, back; ``chunk_bytes`` of float32
    matrices per device at a time). Same math, same state; without a mesh the code below runs as is.
    """
    coeffs = tuple(float(c) for c in coeffs)

    def combine(m, g, c_mu, c_g):
        if nesterov:
            return beta * c_mu * m + (1.0 - beta) * c_g * g.astype(jnp.float32)
        return m

    def init_fn(params):
        mu = jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype), params)
        return MuonState(count=jnp.zeros([], jnp.int32), mu=mu)

    def update_fn(updates, state, params=None):
        del params
        count = state.count + 1
        mu = jax.tree.map(lambda m, g: beta * m + (1.0 - beta) * g.astype(mu_dtype),
                          state.mu, updates)
        if bias_correction:
            t = count.astype(jnp.float32)
            c_mu = 1.0 / (1.0 - beta ** (t + 1.0))
            c_g = 1.0 / (1.0 - beta ** t)
        else:
            c_mu = c_g = 1.0
        mesh = jax.sharding.get_abstract_mesh() if spec_fn is not None else None
        distributed = mesh is not None and not mesh.empty and mesh.size > 1

        flat_mu, treedef = jax.tree_util.tree_flatten_with_path(mu)
        flat_g = treedef.flatten_up_to(updates)
        new_leaves = []
        for (path, m), g in zip(flat_mu, flat_g):
            p = path_to_str(path)
            sp = split_fn(p, tuple(m.shape)) if split_fn else None
            spec = spec_fn(p) if distributed else None
            if spec is not None:
                from .distributed import DEFAULT_CHUNK_BYTES, orthogonalize_sharded
                new_leaves.append(orthogonalize_sharded(
                    m, g, (c_mu, c_g), combine, spec, sp, mesh, rms_scale=rms_scale, coeffs=coeffs,
                    steps=steps, eps=eps, chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES))
                continue
            u = combine(m, g, c_mu, c_g)
            pieces = orthogonalize_batches(leaf_to_pieces(u, sp), rms_scale=rms_scale,
                                            coeffs=coeffs, steps=steps, eps=eps)
            new_leaves.append(pieces_to_leaf(pieces, u.shape, sp).astype(g.dtype))
        new_updates = jax.tree_util.tree_unflatten(treedef, new_leaves)
        return new_updates, MuonState(count=count, mu=jax.tree.map(
            lambda m: m.astype(mu_dtype), mu))

    return optax.GradientTransformation(init_fn, update_fn)


def muon(learning_rate, *, weight_decay: float = 0.1, beta: float = 0.95,
         rms_scale: Optional[float] = 0.2, split_fn: Optional[SplitFn] = None,
         bias_correction: bool = False, nesterov: bool = True,
         eps: float = 1e-7, spec_fn: Optional[SpecFn] = None,
         chunk_bytes: Optional[int] = None) -> optax.GradientTransformation:
    """Muon on every leaf (all leaves must be matrices, possibly stacked): direction, decoupled
    weight decay (lr * wd * W), learning rate (float or schedule). ``spec_fn``: see scale_by_muon."""
    return optax.chain(
        scale_by_muon(beta=beta, nesterov=nesterov, bias_correction=bias_correction,
                      rms_scale=rms_scale, split_fn=split_fn, eps=eps, spec_fn=spec_fn,
                      chunk_bytes=chunk_bytes),
        optax.add_decayed_weights(weight_decay) if weight_decay else optax.identity(),
        optax.scale_by_learning_rate(learning_rate),
    )
