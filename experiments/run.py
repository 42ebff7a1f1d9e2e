"""Run one registered experiment end to end and write its report.

    python -m experiments.run --config=dsa_vs_mla [--workdir DIR] [--preset tiny|small]
                              [--steps N] [--set key=value ...]
    python -m experiments.run --list

Every run writes settings.json, metrics.jsonl (per phase), report.json, report.md and PNG plots into
its workdir (default runs/<config>). Re-running the same command resumes from the checkpoints there.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags, logging

from experiments import registry

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Define this CLI's flags (only when run as a program, so modules import side-effect free)."""
    flags.DEFINE_string("config", None, "Experiment name (see --list).")
    flags.DEFINE_string("workdir", None, "Output folder (default runs/<config>).")
    flags.DEFINE_string("preset", "tiny", "Scale: tiny (CPU default) or small (one accelerator).")
    flags.DEFINE_integer("steps", None, "Override the experiment's main step count.")
    flags.DEFINE_multi_string("set", [], "Override a setting: --set key=value (repeatable).")
    flags.DEFINE_bool("list", False, "List the registered experiments and exit.")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_experiment(name: str, workdir: str, scale: str = "tiny", overrides=(), steps=None) -> dict:
    exp = registry.get(name)
    settings = registry.resolve_settings(exp, scale, overrides, steps)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "settings.json"), "w") as f:
        json.dump({"experiment": name, "scale": scale, **settings}, f, indent=2)
    t0 = time.time()
    log(f"== {name} ({scale}) -> {workdir}")
    report = exp.run(settings, workdir, log)
    log(f"== {name} finished in {time.time() - t0:.0f} s; report: {os.path.join(workdir, 'report.md')}")
    return report


def main(argv):
    logging.set_verbosity(logging.WARNING)        # orbax logs every save at INFO
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.list:
        for name, exp in sorted(registry.load_all().items()):
            print(f"{name:14s} {exp.description}")
        return
    if not FLAGS.config:
        raise app.UsageError("--config is required; registered: " + ", ".join(sorted(registry.load_all())))
    try:
        run_experiment(FLAGS.config, FLAGS.workdir or os.path.join("runs", FLAGS.config), FLAGS.preset,
                       FLAGS.set, FLAGS.steps)
    except registry.ExperimentError as e:
        log(f"error: {e}")
        sys.exit(2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
