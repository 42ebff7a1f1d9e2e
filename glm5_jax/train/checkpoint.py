"""Orbax checkpoints of the whole run state: params, optimizer state, step, PRNG key and the data
iterator's state.

Saves are asynchronous and atomic: `save` returns once the device arrays are snapshotted; the write
(orbax writes a temp dir, then renames) continues in a background thread (`wait`, `is_saving`,
`close`). Each process writes only its own shards (tensorstore, OCDBT). `restore` reads onto the
shardings of its target, so a run saved on (fsdp 2, expert 4) resumes on (fsdp 4, expert 2) or on one
device with identical values: orbax reads exactly the slices each new device needs.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "data"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict | None = None) -> None:
        """Start saving `state` (any sharding) and the data iterator's state; returns before the write ends."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=ocp.args.JsonSave(data_state or {})))

    def restore(self, step: int, target):
        """-> (state, data_state) saved at `step`, laid out like `target`: a pytree of arrays or
        ShapeDtypeStructs whose shardings say where each leaf goes (glm5_jax.train.state.abstract_state
        for a mesh)."""
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 data=ocp.args.JsonRestore()))
        return out["state"], out["data"]

    def is_saving(self) -> bool:
        return bool(self.manager.is_saving_in_progress())

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
