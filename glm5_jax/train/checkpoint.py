"""Orbax checkpoints of the whole run state: params, optimizer state, step, PRNG key and the data
iterator's state. Saves are asynchronous and atomic (orbax writes to a temp dir, then renames)."""

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

    def save(self, step: int, state, data_state: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=ocp.args.JsonSave(data_state)))

    def restore(self, step: int, abstract_state):
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, abstract_state)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 data=ocp.args.JsonRestore()))
        return out["state"], out["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
