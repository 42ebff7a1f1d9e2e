"""Run one registered experiment end to end and write its report.

    python -m experiments.run --config=dsa_vs_mla [--workdir DIR] [--preset tiny|small] [--steps N]
                              [--set model.index_topk=32 --set train.learning_rate=1e-3 ...]
                              [--mesh data:2,fsdp:2,expert:2 | --mesh fsdp:2,context:4 ...]
    python -m experiments.run --list
    python -m experiments.run --config=dsa_vs_mla --show        # print every settable key and its value

Many processes (one per host, or several on one machine): start the same command in each with
`--num_processes=N --process_id=I --coordinator_address=HOST:PORT` (or GLM5_NUM_PROCESSES /
GLM5_PROCESS_ID / GLM5_COORDINATOR_ADDRESS; GLM5_DISTRIBUTED=auto on a TPU pod). `jax.distributed` is
initialised before anything touches a device, the mesh spans every process's devices, each process
reads only its rows of every global batch, checkpoints hold every process's shards and iterator state,
and only process 0 writes settings, metrics and reports. `--workdir` may be a URL (gs://bucket/run).
`--profile_steps=FIRST,LAST` traces those steps (jax.profiler, WORKDIR/.../profile); it is the
override train.profile_steps.

`--set` takes a dotted key into the experiment's typed config (model.*, train.*, data.* and the
experiment's own knobs); the value is parsed by the field's type (none for Optional, comma lists or
JSON for tuples). A bad key, value or combination exits with status 2 before anything compiles.
`--mesh` builds a device mesh (glm5_jax.parallel.distributed.build_mesh) that every training call uses:
AXIS:N,... over data, fsdp, expert, context, tensor (docs/scaleout.md); `context` splits each sequence
(train.seq_len must divide by 2*context), the batch goes over data*fsdp*expert.
`--init_from=PATH` starts the experiment from the weights at PATH: a Hugging Face folder (config.json +
safetensors, e.g. GLM-5, bf16 or FP8) or a params checkpoint (tools.convert_hf). It sets init_from on every
TrainConfig of the experiment's config (`with_init_from`), so every fresh train state the experiment creates
from them (glm5_jax.train.state.init_train_state) is read from it onto the mesh, shard by shard; the
experiment's model must be the checkpoint's (else exit 2 naming the `--set model.*` to add).

Every run writes settings.json (the full resolved config), metrics.jsonl (per phase), report.json
(with the resolved config under "config"), report.md and PNG plots into its workdir (default
runs/<config>), run.log (everything the run printed on stdout and stderr, appended by each invocation) and
TensorBoard events for every phase (`tensorboard --logdir WORKDIR`): the train loop's in PHASE/tensorboard,
an RL or distillation stage's in tensorboard/STAGE as it runs, and any other phase that wrote per-step rows
(NAME.jsonl) exported to tensorboard/NAME when the run ends (glm5_jax.train.observe). `--list` prints every
experiment with its CPU-default wall time and headline figure as last measured (docs/results.md, the one
place those figures live). Re-running the same command resumes from the checkpoints there. Compiled programs go
to JAX's persistent cache in WORKDIR/jax_cache (`--compile_cache=DIR|none`), so seeds and resumed
runs do not compile the same step again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from absl import app, flags, logging
from etils import epath

from experiments import registry
from glm5_jax.overrides import as_dict, flat_items
from glm5_jax import hugepages
from glm5_jax.progress import run_log
from glm5_jax.cli import main_wrapper, run as run_cli

FLAGS = flags.FLAGS

def define_flags() -> None:
    """Define this CLI's flags (only when run as a program, so modules import side-effect free)."""
    flags.DEFINE_string("config", None, "Experiment name (see --list).")
    flags.DEFINE_string("workdir", None, "Output folder (default runs/<config>).")
    flags.DEFINE_string("preset", "tiny", "Scale: tiny (CPU default) or small (one accelerator).")
    flags.DEFINE_integer("steps", None, "Override the experiment's main step count.")
    flags.DEFINE_multi_string("set", [], "Override a config field: --set section.field=value (repeatable).")
    flags.DEFINE_string("mesh", None, "Device mesh AXIS:N,... over data, fsdp, expert, context, tensor (-1 fills; "
                        "context splits each sequence: train.seq_len must divide by 2*context).")
    flags.DEFINE_string("profile_steps", None, "FIRST,LAST: trace these steps with jax.profiler "
                        "(= --set train.profile_steps=FIRST,LAST).")
    flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 (multi-process; or $GLM5_COORDINATOR_ADDRESS).")
    flags.DEFINE_integer("num_processes", None, "Processes in the run (or $GLM5_NUM_PROCESSES; 1 = no jax.distributed).")
    flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes) (or $GLM5_PROCESS_ID).")
    flags.DEFINE_string("init_from", None, "Start from these weights: a Hugging Face folder (config.json + "
                        "safetensors) or a tools.convert_hf params checkpoint.")
    flags.DEFINE_string("compile_cache", "", "JAX persistent compilation cache: a directory, 'none' (off), or empty "
                        "(default: WORKDIR/jax_cache for a local workdir; JAX_COMPILATION_CACHE_DIR wins).")
    flags.DEFINE_bool("list", False, "List the registered experiments and exit.")
    flags.DEFINE_bool("show", False, "Print the resolved config (every settable key) and exit.")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measured() -> dict[str, dict[str, str]]:
    """{experiment: {"wall", "headline", "source"}} from the table of docs/results.md (the one place the
    CPU-default wall times and headline figures live); {} where the docs are not beside the code."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results.md")
    if not os.path.exists(path):
        return {}
    out, inside = {}, False
    with open(path) as f:
        for line in f:
            if line.startswith("<!-- experiments table"):
                inside = True
            elif line.startswith("<!-- end experiments table"):
                break
            elif inside and line.startswith("| `"):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                out[cells[0].strip("`")] = {"wall": cells[1], "headline": cells[2], "source": cells[3]}
    return out


def list_table() -> str:
    """`--list`: every registered experiment, its CPU-default wall time and headline figure as last measured."""
    from experiments.report import md_table
    got = measured()
    rows = []
    for name, exp in sorted(registry.load_all().items()):
        m = got.get(name, {})
        rows.append([name, m.get("wall", "not measured"), m.get("headline", "-"), exp.description])
    return (md_table(["experiment", "CPU default wall", "headline (last measured)", "what it runs"], rows)
            + "\n\nFigures: docs/results.md (command, commit and machine of each); scales: "
            + ", ".join(sorted({s for e in registry.load_all().values() for s in e.scales})))


def start_distributed(coordinator: str | None = None, num_processes: int | None = None,
                      process_id: int | None = None) -> bool:
    """jax.distributed start-up from the flags, else the GLM5_* environment (nothing for one process).
    Must run before anything touches a device. Returns whether several processes were joined."""
    from glm5_jax.parallel.distributed import maybe_initialize
    return maybe_initialize(coordinator, num_processes, process_id)


def start_from_flags() -> None:
    """start_distributed from --coordinator_address/--num_processes/--process_id (else GLM5_*), before
    anything touches a device; a bad setting raises DistributedConfigError (a Glm5Error: exit status 2)."""
    start_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)


def is_primary() -> bool:
    """Process 0 writes the run's files (settings, reports); every process trains."""
    import jax
    return jax.process_index() == 0


def make_mesh(spec: str | None, cfg):
    """The mesh for `spec` (None: no mesh, the single-device default), checked against the config's
    model, batch size and sequence length. Raises glm5_jax.sharding.MeshError on a bad spec."""
    if not spec:
        return None
    from glm5_jax.parallel.distributed import build_mesh
    model = getattr(cfg, "model", None)
    train = getattr(cfg, "train", None)
    mesh = build_mesh(spec, model_cfg=model, batch_size=getattr(train, "batch_size", None))
    check_mesh(mesh, cfg)
    return mesh


def check_mesh(mesh, cfg) -> None:
    """MeshError unless `mesh` (a jax Mesh) fits the config's model, batch size and sequence length
    (a `context` axis splits each sequence into 2*context chunks: train.seq_len must divide)."""
    from glm5_jax.config import ModelConfig
    from glm5_jax.sharding import check_model_fits_mesh
    model = getattr(cfg, "model", None)
    train = getattr(cfg, "train", None)
    if isinstance(model, ModelConfig):
        check_model_fits_mesh(model, dict(mesh.shape), getattr(train, "batch_size", None),
                              getattr(train, "seq_len", None))


def check_init_from(path: str, cfg) -> None:
    """Fail before anything compiles when `path` is not a checkpoint or (for a config with a `model`)
    holds another model (glm5_jax.train.checkpoint.InitFromError)."""
    from glm5_jax.config import ModelConfig
    from glm5_jax.train.checkpoint import check_compatible, checkpoint_config
    ckpt_cfg = checkpoint_config(path)
    model = getattr(cfg, "model", None)
    if isinstance(model, ModelConfig):
        check_compatible(model, ckpt_cfg, path)


def with_init_from(cfg, path: str):
    """(cfg with TrainConfig.init_from = path on every TrainConfig in its tree, how many there were)."""
    from glm5_jax.train.config import TrainConfig
    if isinstance(cfg, TrainConfig):
        return cfg.replace(init_from=path), 1
    if not dataclasses.is_dataclass(cfg):
        return cfg, 0
    new, count = {}, 0
    for f in dataclasses.fields(cfg):
        v, n = with_init_from(getattr(cfg, f.name), path)
        if n:
            new[f.name], count = v, count + n
    return (dataclasses.replace(cfg, **new) if new else cfg), count


def run_experiment(name: str, workdir: str, scale: str = "tiny", overrides=(), steps=None, mesh=None,
                   init_from: str | None = None) -> dict:
    """Resolve (and validate) the config, write settings.json, run, and add the config to report.json.
    `mesh`: None, a spec string ("data:2,fsdp:2,expert:2") or a jax Mesh. `init_from`: a checkpoint
    every fresh train state of the run starts from (with_init_from: TrainConfig.init_from)."""
    exp = registry.get(name)
    cfg = registry.resolve_config(exp, scale, overrides, steps)
    from glm5_jax.rl.sandbox import require_isolation_for
    require_isolation_for(cfg)      # an RL config's reward path runs code: fail closed here (issue 66)
    takers = 0
    if init_from:
        check_init_from(init_from, cfg)
        cfg, takers = with_init_from(cfg, init_from)
    mesh_spec = mesh if isinstance(mesh, str) or mesh is None else dict(mesh.shape)
    if isinstance(mesh, str):
        mesh = make_mesh(mesh, cfg)
    resolved = as_dict(cfg)
    primary = is_primary()
    root = epath.Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    if primary:
        (root / "settings.json").write_text(json.dumps(
            {"experiment": name, "scale": scale, "mesh": mesh_spec, "init_from": init_from, "config": resolved},
            indent=2))
    with run_log(workdir, primary):      # what the run prints also goes to WORKDIR/run.log
        t0 = time.time()
        say = log if primary else (lambda msg: None)      # one process tells the story
        say(f"== {name} ({scale}) -> {workdir}" + (f" on mesh {mesh_spec}" if mesh is not None else ""))
        if init_from:
            say(f"== starting from the weights at {init_from}")
        if init_from and not takers:
            say(f"warning: {name}'s config holds no TrainConfig, so --init_from {init_from} is not used")
        report = exp.run(cfg, workdir, say, mesh=mesh)
        if primary and "://" not in workdir:
            from glm5_jax.train.observe import export_phases
            for d in export_phases(workdir):
                say(f"== TensorBoard events of {os.path.relpath(d, workdir)} written from its per-step rows")
        report["config"] = resolved
        if init_from:
            report["init_from"] = init_from
        if primary:
            path = root / "report.json"
            on_disk = json.loads(path.read_text()) if path.exists() else dict(report)
            on_disk["config"] = resolved
            if init_from:
                on_disk["init_from"] = init_from
            path.write_text(json.dumps(on_disk, indent=2, sort_keys=True))
        say(f"== {name} finished in {time.time() - t0:.0f} s; report: {root / 'report.md'}")
    return report


def use_compile_cache(spec: str, workdir: str) -> str | None:
    """JAX's persistent compilation cache for this run: `spec` "" -> WORKDIR/jax_cache (local workdirs
    only), "none" -> off, else that directory; an already set JAX_COMPILATION_CACHE_DIR wins. An
    experiment compiles the same programs once per seed and per resumed run; with the cache each is
    compiled once (CPU compiles of the tiny configs take seconds each). Returns the directory used."""
    import jax
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or spec == "none" or (not spec and "://" in workdir):
        return os.environ.get("JAX_COMPILATION_CACHE_DIR")
    path = spec or os.path.join(workdir, "jax_cache")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


@main_wrapper      # a Glm5Error (bad experiment, --set, mesh, --init_from, ...) -> one line on stderr, exit 2
def main(argv):
    logging.set_verbosity(logging.WARNING)        # orbax logs every save at INFO
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    start_from_flags()
    if FLAGS.list:
        print(list_table())
        return
    if not FLAGS.config:
        raise app.UsageError("--config is required; registered: " + ", ".join(sorted(registry.load_all())))
    overrides = list(FLAGS.set)
    if FLAGS.profile_steps:
        overrides.append(f"train.profile_steps={FLAGS.profile_steps}")
    if FLAGS.show:
        cfg = registry.resolve_config(registry.get(FLAGS.config), FLAGS.preset, overrides, FLAGS.steps)
        for key, value in flat_items(cfg):
            print(f"{key} = {json.dumps(value, default=str)}")
        return
    workdir = FLAGS.workdir or os.path.join("runs", FLAGS.config)
    use_compile_cache(FLAGS.compile_cache, workdir)
    run_experiment(FLAGS.config, workdir, FLAGS.preset, overrides, FLAGS.steps, FLAGS.mesh, FLAGS.init_from)


if __name__ == "__main__":
    hugepages.ensure()   # glibc large allocations as transparent huge pages (glm5_jax.hugepages)
    run_cli(main, define_flags)
