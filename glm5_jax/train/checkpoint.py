"""Orbax checkpoints of the whole run state: params, optimizer state, step, PRNG key and every
process's data iterator state.

Saves are asynchronous and atomic: `save` returns once the device arrays are snapshotted; the write
(orbax writes a temp dir, then renames) continues in a background thread (`wait`, `is_saving`,
`close`). Every process calls save/restore (orbax coordinates them); each writes only its own shards
of the state (tensorstore, OCDBT) and its own iterator state (data/process_<i>-of-<n>.json, the
layout of grain's orbax handler). `restore` reads onto the shardings of its target, so a run saved on
(fsdp 2, expert 4) resumes on (fsdp 4, expert 2) or on one device with identical values: orbax reads
exactly the slices each new device needs. The directory may be a local path or a URL etils.epath
knows (gs://...).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


def _state_file(directory: epath.Path, index: int, count: int) -> epath.Path:
    return directory / f"process_{index}-of-{count}.json"


class DataStateHandler(ocp.CheckpointHandler):
    """Each process saves its own iterator state (a JSON dict) and restores its own.

    A process with no file of its own (the run resumes on a different number of processes) takes
    process 0's state: the project's iterators count global batches, so every process's state names
    the same position (glm5_jax.data.pipeline.TrainIterator)."""

    def save(self, directory: epath.Path, args: "DataStateSave"):
        _state_file(directory, jax.process_index(), jax.process_count()).write_text(
            json.dumps(args.state, sort_keys=True))

    def restore(self, directory: epath.Path, args: "DataStateRestore | None" = None) -> dict:
        own = _state_file(directory, jax.process_index(), jax.process_count())
        if not own.exists():
            saved = sorted(directory.glob("process_0-of-*.json"))
            if not saved:
                raise FileNotFoundError(f"no data iterator state in {directory}")
            own = saved[0]
        return json.loads(own.read_text())

    def structure(self, directory: epath.Path):
        return None

    def metadata(self, directory: epath.Path):
        return None

    def finalize(self, directory: epath.Path):
        pass

    def close(self):
        pass


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
    state: Any


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
    pass


class Checkpointer:
    def __init__(self, directory, *, keep: int = 2, async_save: bool = True):
        # orbax wants an absolute directory; a URL (gs://...) is one already
        self.directory = epath.Path(directory) if "://" in str(directory) else epath.Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "data"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict | None = None) -> None:
        """Start saving `state` (any sharding) and this process's data iterator state; returns before
        the write ends. Every process must call it."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=DataStateSave(data_state or {})))

    def restore(self, step: int, target):
        """-> (state, this process's data_state) saved at `step`, laid out like `target`: a pytree of
        arrays or ShapeDtypeStructs whose shardings say where each leaf goes
        (glm5_jax.train.state.abstract_state for a mesh)."""
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 data=DataStateRestore()))
        return out["state"], out["data"]

    def is_saving(self) -> bool:
        return bool(self.manager.is_saving_in_progress())

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
