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

Starting weights (`--init_from`, TrainConfig.init_from) come from `load_params`: a Hugging
Face folder (config.json + safetensors, streamed by glm5_jax.hf.read_params), a params checkpoint
(config.json + an orbax `params/` tree, as tools.convert_hf writes with `save_params`) or a training
run (its workdir, its checkpoints/ folder or one step of it: the params of the state, its model from
the MODEL_CONFIG file the loop writes into the workdir), read straight onto the model's parameter
shardings on the mesh.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from glm5_jax.errors import Glm5Error


def _short(err) -> str:
    if err is None:
        return "unreadable on another process"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}"


def _all_processes_ok(tag: str, ok: bool, timeout_s: float = 600.0) -> bool:
    """Whether `ok` holds on every process (one process: `ok`), through the coordination service."""
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return ok
    client.key_value_set(f"glm5_ok/{tag}/{jax.process_index()}", "1" if ok else "0")
    return all(client.blocking_key_value_get(f"glm5_ok/{tag}/{i}", int(timeout_s * 1000)) == "1"
               for i in range(jax.process_count()))


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


UNREADABLE = "unreadable"       # in a Checkpointer folder: step folders restore_latest could not read


class CheckpointError(RuntimeError):
    """No checkpoint of a run could be read."""


class Checkpointer:
    """keep: the newest checkpoints kept; keep_period: steps that are multiples of it are kept as well
    (permanent ones beside the rolling window). Temporary directories of an interrupted write are
    removed when the manager opens (orbax only ever lists committed steps). log: where the fallback
    warning of restore_latest goes (default stderr)."""

    def __init__(self, directory, *, keep: int = 2, async_save: bool = True, keep_period: int | None = None,
                 log=None):
        # orbax wants an absolute directory; a URL (gs://...) is one already
        self.directory = epath.Path(directory) if "://" in str(directory) else epath.Path(directory).resolve()
        self.log = log
        self.manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "data"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_period or None,
                                                 enable_async_checkpointing=async_save, create=True,
                                                 cleanup_tmp_directories=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

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

    def restore_latest(self, target):
        """(step, state, data_state) of the newest checkpoint that reads back (None when there is none).
        An unreadable newer one (a damaged or half-deleted write) is passed over with one warning naming
        it and the step resumed from; CheckpointError when none reads. With several processes every
        process moves on together (a step counts as readable only when it read on all of them)."""
        steps = self.all_steps()[::-1]
        failed = []
        for step in steps:
            try:
                state, data = self.restore(step, target)
                err = None
            except Exception as e:          # noqa: BLE001 -- any read error: try the next older one
                err = e
            if not _all_processes_ok(f"restore/{self.directory}/{step}", err is None):
                failed.append((step, err))
                continue
            if failed:
                bad = ", ".join(f"step {s} ({_short(e)})" for s, e in failed)
                aside = self.directory / UNREADABLE
                msg = (f"[checkpoint] WARNING: unreadable checkpoint {bad} in {self.directory}; resuming from "
                       f"step {step}, the newest readable one (the unreadable ones moved to {aside})")
                (self.log or (lambda m: print(m, file=sys.stderr, flush=True)))(msg)
                self._set_aside([s for s, _ in failed])
            return step, state, data
        if failed:
            raise CheckpointError(f"no checkpoint in {self.directory} reads back: "
                                  + ", ".join(f"step {s} ({_short(e)})" for s, e in failed))
        return None

    def _set_aside(self, steps) -> None:
        """Move unreadable step folders to UNREADABLE/ (kept for inspection; the run rewrites those steps)."""
        if jax.process_index() == 0:
            aside = self.directory / UNREADABLE
            aside.mkdir(parents=True, exist_ok=True)
            for s in steps:
                dst = aside / str(s)
                n = 1
                while dst.exists():
                    dst, n = aside / f"{s}.{n}", n + 1
                (self.directory / str(s)).rename(dst)
        _all_processes_ok(f"aside/{self.directory}/{'-'.join(map(str, steps))}", True)   # a barrier
        self.manager.reload()

    def is_saving(self) -> bool:
        return bool(self.manager.is_saving_in_progress())

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


# ----------------------------------------------------------------------------- starting weights
MODEL_CONFIG = "model_config.json"      # in a run's workdir: its ModelConfig.to_hf(), written by the loop


class InitFromError(Glm5Error):
    """A starting checkpoint is not one, or holds a different model than the run's."""


def _run_step_dir(path: str) -> str | None:
    """The step folder (holding state/) a run path names: a step folder itself, a Checkpointer folder
    (its latest step) or a workdir with checkpoints/; None when `path` is none of these."""
    if os.path.isdir(os.path.join(path, "state")):
        return path
    ckdir = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    steps = [int(n) for n in os.listdir(ckdir) if n.isdigit() and os.path.isdir(os.path.join(ckdir, n, "state"))] \
        if os.path.isdir(ckdir) else []
    return os.path.join(ckdir, str(max(steps))) if steps else None


def _run_config_file(step_dir: str) -> str:
    file = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(step_dir))), MODEL_CONFIG)
    if not os.path.exists(file):
        raise InitFromError(f"training checkpoint {step_dir} has no {file} (written by glm5_jax.train.loop.train "
                            f"into the workdir), so its model is unknown")
    return file


def checkpoint_kind(path) -> str:
    """"hf" (config.json + safetensors), "params" (config.json + orbax params/) or "run" (a training
    run's workdir, checkpoints/ or step folder); InitFromError otherwise."""
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, "config.json")):
        if os.path.isdir(path) and _run_step_dir(path) is not None:
            return "run"
        raise InitFromError(f"{path} is not a checkpoint: it has no config.json (expected a Hugging Face folder "
                            f"with config.json + *.safetensors, tools.convert_hf's config.json + params/, or a "
                            f"training run's workdir / checkpoints folder)")
    if os.path.isdir(os.path.join(path, "params")):
        return "params"
    if os.path.exists(os.path.join(path, "model.safetensors")) or \
            os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        return "hf"
    raise InitFromError(f"{path} has config.json but neither model.safetensors / model.safetensors.index.json "
                        f"(Hugging Face) nor params/ (orbax, tools.convert_hf)")


def checkpoint_config(path):
    """The ModelConfig of the checkpoint at `path` (either kind)."""
    from glm5_jax import hf
    from glm5_jax.config import ModelConfig
    kind = checkpoint_kind(path)
    if kind == "hf":
        return hf.checkpoint_config(path)
    raw = hf.read_hf_config(_run_config_file(_run_step_dir(os.fspath(path))) if kind == "run" else path)
    return ModelConfig.from_hf(raw, param_dtype=hf.checkpoint_dtype(raw))


def check_compatible(model_cfg, ckpt_cfg, path) -> None:
    """Raise InitFromError unless the run's model is the checkpoint's (same parameters, same function;
    ModelConfig.same_weights_fields() such as dtypes, remat or scan_layers may differ), naming each differing field."""
    free = model_cfg.same_weights_fields()
    diff = {f.name: (getattr(model_cfg, f.name), getattr(ckpt_cfg, f.name)) for f in dataclasses.fields(model_cfg)
            if f.name not in free and getattr(model_cfg, f.name) != getattr(ckpt_cfg, f.name)}
    mine = jax.tree_util.tree_map(lambda a: a.shape, abstract_param_shapes(model_cfg))
    theirs = jax.tree_util.tree_map(lambda a: a.shape, abstract_param_shapes(ckpt_cfg))
    if diff or mine != theirs:
        sets = " ".join(f"--set model.{k}={_cli(v[1])}" for k, v in diff.items())
        raise InitFromError(f"the run's model differs from the checkpoint at {path}: "
                            + (", ".join(f"{k}={v[0]!r} (checkpoint: {v[1]!r})" for k, v in diff.items())
                               or "parameter shapes differ (mtp_depth / mtp_share?)")
                            + (f"; run with {sets}" if sets else ""))


def abstract_param_shapes(model_cfg):
    """The unboxed abstract parameter tree of `model_cfg` (shapes and dtypes, nothing allocated; also
    glm5_jax.train.state.abstract_param_shapes)."""
    import flax.linen as nn
    from glm5_jax.model import abstract_params
    return nn.unbox(abstract_params(model_cfg))


def _cli(v) -> str:
    if isinstance(v, tuple):
        return ",".join(str(x) for x in v)
    return "none" if v is None else str(v)


def load_params(path, model_cfg, mesh=None, rules=None):
    """The params of `model_cfg` (its dtypes) read from the checkpoint at `path`, laid out on `mesh`'s
    parameter shardings by `rules` (default the training layout, LOGICAL_RULES; SERVE_RULES for serving;
    default mesh one device); each device reads only its shard. Raises InitFromError
    when the checkpoint holds another model (check_compatible)."""
    from glm5_jax import hf
    from glm5_jax.sharding import LOGICAL_RULES, param_shardings, single_device_mesh
    path = os.fspath(path)
    rules = LOGICAL_RULES if rules is None else rules
    check_compatible(model_cfg, checkpoint_config(path), path)
    mesh = single_device_mesh() if mesh is None else mesh
    kind = checkpoint_kind(path)
    if kind == "hf":
        return hf.read_params(path, model_cfg, mesh, rules)
    target = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                    abstract_param_shapes(model_cfg), param_shardings(model_cfg, mesh, rules))
    if kind == "run":                      # only the params of the run's state (no optimizer state)
        item = {"params": target}
        with ocp.PyTreeCheckpointer() as ckptr:
            return ckptr.restore(os.path.join(os.path.abspath(_run_step_dir(path)), "state"), args=ocp.args.PyTreeRestore(
                item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))["params"]
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.join(os.path.abspath(path), "params"), target)


def save_params(path, model_cfg, params) -> str:
    """Write a params checkpoint: `path`/params (orbax, each process its own shards) and
    `path`/config.json (model_cfg.to_hf()). Refuses to overwrite an existing one."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(os.path.join(path, "params")):
        raise FileExistsError(f"{path}/params already exists; choose another folder (nothing was overwritten)")
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), params)
    if jax.process_index() == 0:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(model_cfg.to_hf(), f, indent=2)
    return path
