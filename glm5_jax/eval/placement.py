"""Where a batch goes: the rows of a global batch each process holds and the global array built from them.

The train loop (glm5_jax.train.loop) and the evaluator (glm5_jax.eval.evaluator) place batches the same way:
split on the first axis over the mesh's batch axes (data, fsdp, expert; glm5_jax.sharding.batch_sharding),
each process giving only the rows its devices hold. Kept below both so neither imports the other."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax.sharding import batch_sharding


def local_rows(sharding, batch_size: int) -> list[int]:
    """The rows of a [batch_size, ...] global batch that this process's devices hold under `sharding`,
    in the order jax.make_array_from_process_local_data expects its local data (ascending)."""
    rows = set()
    for idx in sharding.addressable_devices_indices_map((batch_size,)).values():
        rows.update(range(*idx[0].indices(batch_size)))
    return sorted(rows)


def global_batch(sharding, local: dict, batch_size: int) -> dict:
    """The global [batch_size, ...] arrays from this process's rows (local_rows) of each leaf."""
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), (batch_size,) + np.shape(v)[1:])
            for k, v in local.items()}


def params_mesh(params):
    """The mesh `params` live on (their first leaf's NamedSharding), or None (plain arrays)."""
    sh = getattr(jax.tree_util.tree_leaves(params)[0], "sharding", None)
    return sh.mesh if isinstance(sh, NamedSharding) else None


def eval_sharding(mesh, batch_size: int) -> NamedSharding:
    """The batch's rows over the mesh's batch axes as in training; replicated when they do not split evenly."""
    bsh = batch_sharding(mesh)
    if batch_size % math.prod(mesh.shape[a] for a in bsh.spec[0]):
        return NamedSharding(mesh, P())                 # rows do not split evenly: every device gets all
    return bsh


def place_batch(mesh, batch: dict) -> dict:
    """A full host batch (the same on every process) on `mesh` (None: the default device, jnp.asarray)."""
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    size = len(next(iter(batch.values())))
    sh = eval_sharding(mesh, size)
    rows = local_rows(sh, size)
    return global_batch(sh, {k: np.asarray(v)[rows] for k, v in batch.items()}, size)


__all__ = ["eval_sharding", "global_batch", "local_rows", "params_mesh", "place_batch"]
