"""Sharded orbax checkpoints that restore onto a different mesh, saved without blocking the step.

Each process writes only its own shards (orbax/tensorstore, OCDBT); restoring with target shardings
from another mesh makes orbax read exactly the slices each new device needs, so a run saved on
(fsdp 2, expert 4) resumes on (fsdp 4, expert 2) or on one device with identical values.
Saves are asynchronous: `save` returns once the device arrays are snapshotted; the write to storage
continues in a background thread (`Checkpointer.wait()` / `is_saving()` / `close()`).
"""

from __future__ import annotations

import jax

from glm5_jax.config import ModelConfig
from glm5_jax.parallel.state import abstract_state
from glm5_jax.train.checkpoint import Checkpointer
from glm5_jax.train.config import TrainConfig


def save(ckpt: Checkpointer, step: int, state, data_state: dict | None = None) -> None:
    """Start an asynchronous save of `state` (any sharding) and return."""
    ckpt.save(step, state, data_state or {})


def is_saving(ckpt: Checkpointer) -> bool:
    return bool(ckpt.manager.is_saving_in_progress())


def restore_on_mesh(ckpt: Checkpointer, step: int, model_cfg: ModelConfig, tcfg: TrainConfig, mesh, tx=None):
    """Restore the train state saved at `step` with the shardings of `mesh` -> (state, data_state)."""
    target, _ = abstract_state(model_cfg, tcfg, mesh, tx)
    return ckpt.restore(step, target)


def restore_like(ckpt: Checkpointer, step: int, like):
    """Restore onto the shardings of `like` (a pytree of arrays or ShapeDtypeStructs with shardings)."""
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    return ckpt.restore(step, target)
