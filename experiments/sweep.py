"""Run an ablation sweep over one setting and write a comparison table.

    python -m experiments.sweep --config=NAME --sweep section.field=v1,v2,... [--workdir DIR]
                                [--preset tiny] [--steps N] [--set section.field=value ...]
                                [--mesh AXIS:N,... over data, fsdp, expert, context, tensor]
                                [--init_from PATH]

e.g. --sweep model.index_topk=32,64. The key is any dotted key `--set` accepts (values are split on
commas, so a tuple-valued field cannot be swept). Every value is validated before the first run.
Each value runs in <workdir>/<key>=<value>/; sweep.md and sweep.json compare every arm's final
numbers from the runs' report.json files.
"""

from __future__ import annotations

import json
import os

from absl import app, flags, logging
from etils import epath

from experiments import registry
from experiments.report import md_table
from experiments.run import define_flags as run_flags
from experiments.run import check_init_from, check_mesh, is_primary, make_mesh, run_experiment, start_from_flags
from glm5_jax import hugepages
from glm5_jax.cli import main_wrapper, run as run_cli

FLAGS = flags.FLAGS   # --config, --workdir, --preset, --steps, --set, --mesh, --init_from come from experiments.run


def define_flags() -> None:
    """Define this CLI's flags (only when run as a program, so modules import side-effect free): its own
    --sweep and the ones it borrows from experiments.run."""
    run_flags()
    flags.DEFINE_string("sweep", None, "section.field=v1,v2,... : the config key to sweep and its values.")


def flatten_report(report: dict) -> dict[str, float]:
    out = {}
    for arm, vals in (report.get("arms") or {}).items():
        for k, v in vals.items():
            if isinstance(v, (int, float)):
                out[f"{arm}.{k}"] = v
    for k, v in report.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
    return out


def sweep(name: str, sweep_spec: str, workdir: str, scale: str, fixed=(), steps=None, mesh=None,
          init_from: str | None = None) -> dict:
    """Every arm runs like experiments.run (init_from: each arm starts from those weights)."""
    exp = registry.get(name)
    if "=" not in sweep_spec:
        raise registry.ExperimentError(f"--sweep expects key=v1,v2,..., got {sweep_spec!r}")
    key, values = sweep_spec.split("=", 1)
    key = key.strip()
    values = [v.strip() for v in values.split(",") if v.strip()]
    if not values:
        raise registry.ExperimentError(f"--sweep {key}= has no values")
    for v in values:                                     # validate every arm before the first compile
        arm = registry.resolve_config(exp, scale, [*fixed, f"{key}={v}"], steps)
        if init_from:
            check_init_from(init_from, arm)
    if isinstance(mesh, str):
        mesh = make_mesh(mesh, registry.resolve_config(exp, scale, fixed, steps))
    if mesh is not None:                                 # each arm on that mesh (e.g. a train.seq_len sweep
        for v in values:                                 # against 2*context), before the first compile
            check_mesh(mesh, registry.resolve_config(exp, scale, [*fixed, f"{key}={v}"], steps))
    results = {}
    for v in values:
        report = run_experiment(name, os.path.join(workdir, f"{key}={v}"), scale, [*fixed, f"{key}={v}"], steps,
                                mesh, init_from)
        results[v] = flatten_report(report)
    cols = sorted({c for r in results.values() for c in r})
    table = md_table([key] + cols, [[v] + [results[v].get(c, "") for c in cols] for v in values])
    if is_primary():                                     # every process runs the arms; process 0 writes
        out = epath.Path(workdir)
        (out / "sweep.json").write_text(json.dumps({"experiment": name, "key": key, "results": results}, indent=2))
        (out / "sweep.md").write_text(f"# Sweep of {name} over {key}\n\n{table}\n")
        print(table)
    return results


@main_wrapper      # a Glm5Error -> one line on stderr, exit status 2 (glm5_jax.cli)
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if not FLAGS.config or not FLAGS.sweep:
        raise app.UsageError("--config and --sweep are required")
    key = FLAGS.sweep.split("=", 1)[0]
    start_from_flags()
    sweep(FLAGS.config, FLAGS.sweep, FLAGS.workdir or os.path.join("runs", f"sweep_{FLAGS.config}_{key}"),
          FLAGS.preset, FLAGS.set, FLAGS.steps, FLAGS.mesh, FLAGS.init_from)


if __name__ == "__main__":
    hugepages.ensure()
    run_cli(main, define_flags)
