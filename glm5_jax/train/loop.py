"""The training loop: periodic eval, progress (step time, tokens/s, MFU, ETA), metrics.jsonl and
TensorBoard scalars, orbax checkpoints, exact resume (state + data iterator + PRNG), and a clean stop on
a non-finite loss. The same loop runs in one process or in many (one per host).

The state is created on the mesh (glm5_jax.train.state.init_train_state) and stepped by the one step
(glm5_jax.train.step.make_train_step). The host reads step k's metrics only after step k+1 has been
dispatched, so it does not wait on the device every step; steps that checkpoint, evaluate, monitor
or end the run read their metrics at once. A checkpoint is saved only after its step's loss is known
to be finite, so the last checkpoint is always a good one even though a NaN may be seen a step late.

Multi-process: every process runs this loop with the same arguments. Each reads only the rows of every
global batch that its devices hold (`local_rows`; the iterator's select_rows) and the loop assembles the
global batch with jax.make_array_from_process_local_data. Each process checkpoints its own shards and
its own iterator state; only process 0 writes metrics.jsonl and TensorBoard events. An iterator with
`data_metrics()` (a mixture of sources) adds its per-source counts after each step's batch to that
step's row (`data_tokens/NAME`, `data_sequences/NAME`: cumulative over the run, restored on resume). The workdir is an
etils.epath path, so it may be a URL (gs://...) as well as a local folder.

Hooks (`train(..., hooks=[Hook(fn, every=N, at_end=True, params=True)])`) run at their steps with a read-only
StepContext (step, params, the metrics row so far, step time, workdir, name, log); what they return joins
that step's row. eval_fn is the first hook (every tcfg.eval_every steps and at the end). Evaluation goes
through glm5_jax.eval (`evaluate` here is its LM-loss metric).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from etils import epath

from glm5_jax.config import ModelConfig
from glm5_jax.eval.evaluator import LMLoss, evaluate as run_eval
from glm5_jax.eval.placement import global_batch, local_rows
from glm5_jax.optim import optimizer_table
from glm5_jax.parallel.distributed import check_shared_workdir
from glm5_jax.sharding import single_device_mesh
from glm5_jax.train.checkpoint import MODEL_CONFIG, Checkpointer
from glm5_jax.train.config import TrainConfig
from glm5_jax.train.observe import RunObserver
from glm5_jax.train.preempt import PREEMPTED_EXIT_CODE, Preempted, PreemptionWatch, agree
from glm5_jax.train.state import abstract_param_shapes, abstract_state, build_optimizer, init_train_state
from glm5_jax.train.step import make_monitor_fn, make_train_step


class TrainingDiverged(RuntimeError):
    """A step's loss, gradient or update became NaN/inf (it was not applied); the last good checkpoint is kept."""


def evaluate(model_cfg: ModelConfig, params, batches: Iterable[dict], eval_step=None) -> dict:
    """Token-mean eval loss over `batches` (full host batches, the same on every process) and top-1
    accuracy on masked positions: glm5_jax.eval.evaluate with its LM-loss metric (params on a mesh get each
    batch split over its batch axes, also when they span several processes). eval_step: accepted for
    older callers and unused (the evaluator compiles one forward per model)."""
    del eval_step
    return run_eval(model_cfg, params, batches, [LMLoss()])


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a hook sees at a step (read-only): the step, the total steps, the params after that step's update
    (None for a hook with params=False: it runs when the row is recorded, without holding a step back), the
    step's metrics row so far (a read-only mapping: the loop's metrics and the outputs of the hooks before this
    one), the step's wall time (s), the run's workdir, name and log."""
    step: int
    total_steps: int
    params: Any
    row: Mapping
    step_seconds: float
    workdir: epath.Path
    name: str
    log: Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Hook:
    """fn(StepContext) -> dict | None, run every `every` steps (0: never periodically) and at the run's last
    step (tcfg.steps) when at_end. A dict it returns is added to that step's metrics row (metrics.jsonl).
    params=True (default): a step where the hook is due is read at once (the next step waits), so the hook sees
    that step's params; params=False: it runs when the row is recorded (one step late while the loop keeps a
    step in flight) and sees no params (timing, progress, bookkeeping). Hooks never change the training
    computation (the step, the data order and the checkpoints are the same with or without them)."""
    fn: Callable[[StepContext], dict | None]
    every: int = 0
    at_end: bool = True
    params: bool = True

    def due(self, step: int, total: int) -> bool:
        return bool(self.every and step % self.every == 0) or (self.at_end and step == total)


def _read_metrics(path: epath.Path, upto: int | None, log=None) -> list[dict]:
    """The rows of metrics.jsonl up to step `upto`. A last line cut short by a crash mid-write is
    dropped (with a warning through `log`); a damaged line elsewhere raises, naming it."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i != len(lines) - 1:
                raise ValueError(f"{path} line {i + 1} is not JSON ({e}); only a partial last line is dropped") from None
            if log is not None:
                log(f"[metrics] WARNING: dropped the partial last line of {path} ({len(line)} characters)")
    return [r for r in rows if upto is None or r["step"] <= upto]


class _MetricsFile:
    """metrics.jsonl, written by the primary process only. A local file is appended to row by row; an
    object store (gs://) has no append, so there the whole file is rewritten at each flush (log,
    checkpoint and final steps), which is what survives a crash."""

    def __init__(self, path: epath.Path, rows: list[dict], enabled: bool):
        self.path, self.enabled = path, enabled
        self.local = "://" not in str(path)
        self.rows, self._f = list(rows), None
        if enabled:
            self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))   # drops rows past a resume
            if self.local:
                self._f = self.path.open("a")

    def write(self, row: dict, flush: bool) -> None:
        self.rows.append(row)
        if not self.enabled:
            return
        if self._f is not None:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()
        elif flush:
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))

    def close(self) -> None:
        if self.enabled and self._f is None:
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        if self._f is not None:
            self._f.close()
            self._f = None


# the optimizer tables this process has logged: a run's first phase logs its table, every later phase (6 in
# a dsa_vs_mla smoke run) one line of totals (issue 60); each phase's table is in its workdir
_LOGGED_TABLES: set[str] = set()
OPTIMIZER_TABLE = "optimizer.txt"


def train(model_cfg: ModelConfig, tcfg: TrainConfig, train_iter, workdir, *,
          init_params=None, eval_fn: Callable[[object], dict] | None = None, log=None,
          name: str = "train", stop_after: int | None = None, mesh=None, loss_fn=None,
          hooks: Sequence[Hook] = ()) -> dict:
    """Train for tcfg.steps steps in `workdir` (a path or URL), resuming from its latest checkpoint if any.

    train_iter: an iterator of numpy batch dicts of the global batch (tcfg.batch_size rows) with
    get_state()/set_state() (glm5_jax.data). With select_rows(rows) (glm5_jax.data.TrainIterator) it is
    told the rows this process holds and yields only those; without it, a multi-process run reads full
    batches and keeps its rows.
    eval_fn(params) -> dict of eval metrics, run every eval_every steps and at the end (the first hook).
    hooks: Hook(fn, every, at_end, params) run at their steps (Hook); their dicts join the metrics rows.
    mesh: where the state lives and the step runs (default: one device); a checkpoint written on any
    mesh is resharded onto it. loss_fn: plugged into the step (default: the LM loss, make_loss_fn).
    Returns {"params", "history" (metrics rows), "final" (last eval row), "labels"}.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    mesh = single_device_mesh() if mesh is None else mesh
    primary = jax.process_index() == 0
    workdir = epath.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if jax.process_count() > 1:
        check_shared_workdir(workdir)                  # every host must see the one workdir
    ckpt = Checkpointer(workdir / "checkpoints", keep=tcfg.keep_checkpoints, async_save=tcfg.async_checkpoints,
                        keep_period=tcfg.keep_period or None, log=log if primary else None)
    if primary:        # the checkpoints' model, so they can start other runs / be exported (--init_from, export_hf)
        (workdir / MODEL_CONFIG).write_text(json.dumps(model_cfg.to_hf(), indent=2))
    shapes = abstract_param_shapes(model_cfg)
    tx, labels = build_optimizer(model_cfg, tcfg, shapes)
    if primary:
        table = optimizer_table(shapes, labels, model_cfg if tcfg.optimizer == "muon_split" else None)
        (workdir / OPTIMIZER_TABLE).write_text(table + "\n")
        if _LOGGED_TABLES:      # a later phase of the run: its totals in one line, the table in its workdir
            totals = "; ".join(" ".join(ln.split()) for ln in table.rsplit("\n\n", 1)[-1].splitlines())
            same = " (same as an earlier phase)" if table in _LOGGED_TABLES else ""
            log(f"[{name}] optimizer {tcfg.optimizer}{same}: {totals}; table: {workdir / OPTIMIZER_TABLE}")
        else:
            log(f"[{name}] optimizer {tcfg.optimizer}:\n" + table)
        _LOGGED_TABLES.add(table)
    step_fn = make_train_step(model_cfg, tcfg, tx, mesh, loss_fn=loss_fn)
    bsh = step_fn.batch_sharding
    batch_size = tcfg.batch_size
    rows = local_rows(bsh, batch_size)
    select = getattr(train_iter, "select_rows", None)
    if select is not None:
        select(rows)                                   # this process reads only its rows
        take = None
    else:
        take = None if len(rows) == batch_size else rows
    start = 0
    found = ckpt.restore_latest(abstract_state(model_cfg, tcfg, mesh, tx)[0]) if ckpt.all_steps() else None
    latest = None if found is None else found[0]
    if found is not None:
        _, state, data_state = found
        train_iter.set_state(data_state)
        start = int(state["step"])
        if primary:
            log(f"[{name}] resumed from step {start} ({ckpt.directory})")
    else:
        state, _ = init_train_state(model_cfg, tcfg, mesh, tx=tx, params=init_params)
    # only the primary reads the file back (it rewrites it at once); the others' history starts here
    done = _read_metrics(workdir / "metrics.jsonl", start if latest is not None else 0, log) if primary else []
    metrics_file = _MetricsFile(workdir / "metrics.jsonl", done, primary)
    history = metrics_file.rows
    obs = RunObserver(str(workdir), model_cfg=model_cfg, tcfg=tcfg, mesh=mesh, profile_steps=tcfg.profile_steps)

    monitor_fn = make_monitor_fn(model_cfg) if tcfg.monitor_every else None
    clock = {"last": time.perf_counter(), "saved": time.monotonic()}
    last_good = latest
    final = None
    hooks = list(hooks)
    if eval_fn is not None:
        def eval_hook(ctx):
            nonlocal final
            final = {"step": ctx.step, **eval_fn(ctx.params)}
            return final
        hooks.insert(0, Hook(eval_hook, every=tcfg.eval_every, at_end=True))

    def context(step, params, row, seconds):
        return StepContext(step, tcfg.steps, params, MappingProxyType(dict(row)), seconds, workdir, name, log)
    end = tcfg.steps if stop_after is None else min(tcfg.steps, stop_after)
    # skipped (non-finite) steps: the run's total (in each row, read back on resume) and the current streak
    skips = {"total": int(done[-1].get("skipped_steps", 0)) if done else 0, "streak": 0,
             "spikes": int(done[-1].get("spike_steps", 0)) if done else 0}
    watch = PreemptionWatch().__enter__()

    def close_all():
        watch.close()
        obs.close()
        metrics_file.close()
        ckpt.close()

    def stop(msg):
        close_all()
        raise TrainingDiverged(msg)

    def record(step, metrics, data=None, extra=None) -> None:
        """Read `step`'s metrics (waits for that step), stop on a skipped (non-finite) step unless
        tcfg.nonfinite == "skip", write and log the row. The step's time is the wall time since the
        previous step's metrics were read (the loop keeps one step in flight, so this is the device time
        per step once it runs steadily)."""
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        seconds = max(now - clock["last"], 1e-9)
        nonfinite, spike = metrics.get("skipped", 0.0) > 0, metrics.get("spike", 0.0) > 0
        if nonfinite or spike:       # the step was not applied: a NaN/inf, or a finite spike (never a stop)
            kind = "total" if nonfinite else "spikes"
            skips[kind] += 1
            skips["streak"] += 1
            if nonfinite:
                what = (f"loss is {metrics['loss']} at step {step} (grad_norm {metrics.get('grad_norm')}, "
                        f"update_norm {metrics.get('update_norm')}; the step was not applied)")
            else:
                what = (f"step {step}: loss {metrics['loss']:.6g} / grad_norm {metrics.get('grad_norm'):.6g} beyond "
                        f"mean + {tcfg.spike_k:g} std of the last {tcfg.spike_window} steps (a spike; the step was not "
                        "applied)")
            good = (f"The last good checkpoint is step {last_good} in {ckpt.directory}" if last_good is not None
                    else f"No checkpoint was written yet ({ckpt.directory})")
            if nonfinite and tcfg.nonfinite == "stop":
                stop(f"[{name}] {what}; stopped. {good} (lower learning_rate or enable grad_clip; "
                     "train.nonfinite=skip skips such steps)")
            if skips["streak"] > tcfg.max_skipped_steps:
                stop(f"[{name}] {what}; {skips['streak']} steps in a row skipped (max_skipped_steps="
                     f"{tcfg.max_skipped_steps}); stopped. {good}")
            if primary:
                log(f"[{name}] {what}; skipped ({skips[kind]} {'skipped' if nonfinite else 'spikes'} so far)")
        else:
            skips["streak"] = 0
        row = {"step": step, **metrics, "skipped_steps": skips["total"], **(data or {})}
        if extra is not None:
            row.update(extra(row, seconds))
        for h in hooks:                                # the hooks that need no params: when the row is read
            if not h.params and h.due(step, tcfg.steps):
                row.update(h.fn(context(step, None, row, seconds)) or {})
        if tcfg.spike_window:
            row["spike_steps"] = skips["spikes"]
        obs.record(step, row, step_seconds=seconds)
        show = step % tcfg.log_every == 0 or step == end or "eval_loss" in row
        metrics_file.write(row, flush=show or step % tcfg.ckpt_every == 0)
        if show and primary:
            log(f"[{name}] " + obs.progress(step, tcfg.steps, row))

    def next_batch():
        local = next(train_iter)
        if take is not None:
            local = {k: np.asarray(v)[take] for k, v in local.items()}
        return global_batch(bsh, local, batch_size)

    try:
        data_metrics = getattr(train_iter, "data_metrics", None)   # a mixture's per-source counts, if any
        pending = None                                     # (step, its metrics still on device, its data counts)
        for step in range(start + 1, end + 1):
            obs.step_started(step)
            batch = next_batch()
            data_row = data_metrics() if data_metrics is not None else None
            state, metrics = step_fn(state, batch)
            preempted = watch.reached(step)                # SIGTERM / the hosts' preemption sync point
            timed = bool(tcfg.ckpt_every_minutes) and agree(
                "ckpt_time", step, time.monotonic() - clock["saved"] >= 60.0 * tcfg.ckpt_every_minutes)
            if pending is not None:                        # the previous step's metrics, while this one runs
                record(*pending)
                clock["last"] = time.perf_counter()
                pending = None
            do_ckpt = step % tcfg.ckpt_every == 0 or step == tcfg.steps or preempted or timed
            due = [h for h in hooks if h.params and h.due(step, tcfg.steps)]     # eval first (eval_fn)
            do_mon = monitor_fn is not None and (step % tcfg.monitor_every == 0 or step == tcfg.steps)
            if not (do_ckpt or due or do_mon or step == end):
                pending = (step, metrics, data_row)
                continue

            def extra(row, seconds, step=step, batch=batch, due=due, do_mon=do_mon):
                out = {}
                if do_mon:         # after the update, on this step's batch: a separate forward, no gradients
                    out.update({k: float(v) for k, v in jax.device_get(monitor_fn(state["params"], batch)).items()})
                for h in due:      # this step's params (the next step is not dispatched before they ran)
                    out.update(h.fn(context(step, state["params"], {**row, **out}, seconds)) or {})
                return out

            record(step, metrics, data_row, extra)         # before the save: only a finite step is checkpointed
            if do_ckpt:
                ckpt.save(step, state, train_iter.get_state())
                last_good = step
                clock["saved"] = time.monotonic()
            if preempted:
                close_all()                                # waits for the checkpoint write to end
                msg = (f"[{name}] preempted ({watch.signal_name}): checkpoint of step {step} written to "
                       f"{ckpt.directory}; exiting with code {PREEMPTED_EXIT_CODE}; re-run the same "
                       "command to continue from it")
                if primary:
                    log(msg)
                raise Preempted(msg, step)
            clock["last"] = time.perf_counter()            # eval / monitor / save time is not step time
    finally:
        watch.close()                                  # SIGTERM is the process's again
    close_all()
    if final is None and eval_fn is not None:
        final = {"step": int(state["step"]), **eval_fn(state["params"])}
    return {"params": state["params"], "history": history, "final": final, "labels": labels}
