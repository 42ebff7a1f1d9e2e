"""Run one registered experiment end to end and write its report.

    python -m experiments.run --config=dsa_vs_mla [--workdir DIR] [--preset tiny|small] [--steps N]
                              [--set model.index_topk=32 --set train.learning_rate=1e-3 ...]
                              [--mesh data:2,fsdp:2,expert:2]
    python -m experiments.run --list
    python -m experiments.run --config=dsa_vs_mla --show        # print every settable key and its value

`--set` takes a dotted key into the experiment's typed config (model.*, train.*, data.* and the
experiment's own knobs); the value is parsed by the field's type (none for Optional, comma lists or
JSON for tuples). A bad key, value or combination exits with status 2 before anything compiles.
`--mesh` builds a device mesh (glm5_jax.parallel.distributed.build_mesh) that every training call uses.

Every run writes settings.json (the full resolved config), metrics.jsonl (per phase), report.json
(with the resolved config under "config"), report.md and PNG plots into its workdir (default
runs/<config>). Re-running the same command resumes from the checkpoints there.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags, logging

from experiments import registry
from experiments.overrides import OverrideError, as_dict, flat_items
from glm5_jax.config import ConfigError

FLAGS = flags.FLAGS
USAGE_ERRORS = (registry.ExperimentError, OverrideError, ConfigError)


def define_flags() -> None:
    """Define this CLI's flags (only when run as a program, so modules import side-effect free)."""
    flags.DEFINE_string("config", None, "Experiment name (see --list).")
    flags.DEFINE_string("workdir", None, "Output folder (default runs/<config>).")
    flags.DEFINE_string("preset", "tiny", "Scale: tiny (CPU default) or small (one accelerator).")
    flags.DEFINE_integer("steps", None, "Override the experiment's main step count.")
    flags.DEFINE_multi_string("set", [], "Override a config field: --set section.field=value (repeatable).")
    flags.DEFINE_string("mesh", None, "Device mesh AXIS:N,... over data, fsdp, expert, tensor (-1 fills).")
    flags.DEFINE_bool("list", False, "List the registered experiments and exit.")
    flags.DEFINE_bool("show", False, "Print the resolved config (every settable key) and exit.")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_mesh(spec: str | None, cfg):
    """The mesh for `spec` (None: no mesh, the single-device default), checked against the config's
    model and batch size. Raises glm5_jax.sharding.MeshError on a bad spec."""
    if not spec:
        return None
    from glm5_jax.parallel.distributed import build_mesh
    model = getattr(cfg, "model", None)
    train = getattr(cfg, "train", None)
    return build_mesh(spec, model_cfg=model, batch_size=getattr(train, "batch_size", None))


def run_experiment(name: str, workdir: str, scale: str = "tiny", overrides=(), steps=None, mesh=None) -> dict:
    """Resolve (and validate) the config, write settings.json, run, and add the config to report.json.
    `mesh`: None, a spec string ("data:2,fsdp:2,expert:2") or a jax Mesh."""
    exp = registry.get(name)
    cfg = registry.resolve_config(exp, scale, overrides, steps)
    mesh_spec = mesh if isinstance(mesh, str) or mesh is None else dict(mesh.shape)
    if isinstance(mesh, str):
        mesh = make_mesh(mesh, cfg)
    resolved = as_dict(cfg)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "settings.json"), "w") as f:
        json.dump({"experiment": name, "scale": scale, "mesh": mesh_spec, "config": resolved}, f, indent=2)
    t0 = time.time()
    log(f"== {name} ({scale}) -> {workdir}" + (f" on mesh {mesh_spec}" if mesh is not None else ""))
    report = exp.run(cfg, workdir, log, mesh=mesh)
    report["config"] = resolved
    path = os.path.join(workdir, "report.json")
    on_disk = json.load(open(path)) if os.path.exists(path) else dict(report)
    on_disk["config"] = resolved
    with open(path, "w") as f:
        json.dump(on_disk, f, indent=2, sort_keys=True)
    log(f"== {name} finished in {time.time() - t0:.0f} s; report: {os.path.join(workdir, 'report.md')}")
    return report


def main(argv):
    logging.set_verbosity(logging.WARNING)        # orbax logs every save at INFO
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.list:
        for name, exp in sorted(registry.load_all().items()):
            print(f"{name:14s} {exp.description}  (scales: {', '.join(exp.scales)})")
        return
    if not FLAGS.config:
        raise app.UsageError("--config is required; registered: " + ", ".join(sorted(registry.load_all())))
    from glm5_jax.sharding import MeshError
    try:
        if FLAGS.show:
            cfg = registry.resolve_config(registry.get(FLAGS.config), FLAGS.preset, FLAGS.set, FLAGS.steps)
            for key, value in flat_items(cfg):
                print(f"{key} = {json.dumps(value, default=str)}")
            return
        run_experiment(FLAGS.config, FLAGS.workdir or os.path.join("runs", FLAGS.config), FLAGS.preset,
                       FLAGS.set, FLAGS.steps, FLAGS.mesh)
    except USAGE_ERRORS + (MeshError,) as e:
        log(f"error: {e}")
        sys.exit(2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
