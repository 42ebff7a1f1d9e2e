"""Run observability: TensorBoard scalars, a profiler trace on request, step time, tokens/s and MFU.

    obs = RunObserver(workdir, model_cfg=cfg, tcfg=tcfg, mesh=mesh, profile_steps=(5, 7))
    for step in range(start + 1, end + 1):
        obs.step_started(step)                      # starts / stops the jax.profiler trace
        ...                                         # run the step, time it
        perf = obs.record(step, metrics, step_seconds=dt)
        if step % tcfg.log_every == 0:
            log(obs.progress(step, tcfg.steps, metrics, perf))
    obs.close()

Only the primary process (jax.process_index() == 0 unless `primary` says otherwise) writes: TensorBoard
event files into WORKDIR/tensorboard (tensorboardX, the maintained writer; `tensorboard --logdir
WORKDIR/tensorboard`), and the trace of steps profile_steps[0]..profile_steps[1] into WORKDIR/profile
(open with TensorBoard's profile plugin / xprof). Every process returns the same figures.

MFU = model FLOPs per token (glm5_jax.flops: 6 x active matmul params + attention) x tokens/s
      / (devices in the mesh x per-device peak bf16 FLOP/s of jax's device_kind);
None where the peak is unknown (CPU, an unlisted chip).
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from glm5_jax.chips import chip_for_device_kind
from glm5_jax.flops import train_flops_per_token

def peak_flops(device_kind: str) -> float | None:
    """Per-device dense bf16 peak FLOP/s for a jax device_kind (glm5_jax.chips), or None when not listed ("cpu")."""
    chip = chip_for_device_kind(device_kind)
    return chip.peak_flops if chip else None


def fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _scalar(value) -> float | None:
    """A float for a Python/numpy/jax scalar (or one-element array); None for anything else."""
    if isinstance(value, (bool, str)) or value is None:
        return None
    try:
        arr = np.asarray(jax.device_get(value))
    except (TypeError, ValueError):
        return None
    if arr.size != 1 or not np.issubdtype(arr.dtype, np.number):
        return None
    return float(arr.reshape(()))


class RunObserver:
    """TensorBoard scalars, an optional profiler trace and throughput/MFU figures for one training run.

    mesh: the mesh the step runs on (its device count and kind set the MFU denominator); None means
    the loop's single-device default. profile_steps: (first, last) steps to trace, inclusive.
    device_kind: overrides the mesh's device kind (for hardware jax names unusually, and tests).
    """

    def __init__(self, workdir: str, *, model_cfg, tcfg, mesh=None, profile_steps: tuple[int, int] | None = None,
                 primary: bool | None = None, device_kind: str | None = None):
        if profile_steps is not None:
            ok = (isinstance(profile_steps, (tuple, list)) and len(profile_steps) == 2
                  and all(isinstance(s, int) and not isinstance(s, bool) for s in profile_steps)
                  and 1 <= profile_steps[0] <= profile_steps[1])
            if not ok:
                raise ValueError(f"profile_steps={profile_steps!r} is invalid: expected (first, last) step "
                                 "numbers with 1 <= first <= last, or None")
            profile_steps = (int(profile_steps[0]), int(profile_steps[1]))
        self.workdir = workdir
        self.primary = jax.process_index() == 0 if primary is None else bool(primary)
        self.profile_steps = profile_steps
        self.tensorboard_dir = os.path.join(workdir, "tensorboard")
        self.profile_dir = os.path.join(workdir, "profile")
        devices = list(np.asarray(mesh.devices).flat) if mesh is not None else jax.local_devices()[:1]
        self.num_devices = len(devices)
        self.device_kind = device_kind if device_kind is not None else devices[0].device_kind
        self.peak_flops_per_device = peak_flops(self.device_kind)
        self.tokens_per_step = tcfg.batch_size * tcfg.seq_len
        self.flops_per_token = train_flops_per_token(model_cfg, tcfg.seq_len)
        self._writer = None                  # created at the first record (its step purges stale events)
        self._tracing = False
        self._last = {"step_time_s": None, "tokens_per_s": None, "mfu": None}
        self._run = [0, 0.0]                 # steps, seconds since the first recorded step (for the ETA)
        self._window = [0, 0.0]              # steps, seconds since the last progress line
        self._first_recorded = None

    # ------------------------------------------------------------------ profiler
    def step_started(self, step: int) -> None:
        """Start the trace as step profile_steps[0] starts; stop it as step profile_steps[1] + 1 starts
        (or at close()), so the trace holds the requested steps' dispatch and device work."""
        if not self.primary or self.profile_steps is None:
            return
        first, last = self.profile_steps
        if step == first and not self._tracing:
            jax.profiler.start_trace(self.profile_dir)
            self._tracing = True
        elif step > last and self._tracing:
            self._stop_trace()

    def _stop_trace(self) -> None:
        jax.profiler.stop_trace()
        self._tracing = False

    # ------------------------------------------------------------------ figures
    def throughput(self, step_seconds: float) -> dict:
        """{"step_time_s", "tokens_per_s", "mfu"} for one optimizer step of `step_seconds`."""
        if not (isinstance(step_seconds, (int, float)) and step_seconds > 0 and math.isfinite(step_seconds)):
            raise ValueError(f"step_seconds={step_seconds!r} is invalid: must be a finite number > 0")
        tokens_per_s = self.tokens_per_step / step_seconds
        mfu = None
        if self.peak_flops_per_device is not None:
            mfu = self.flops_per_token * tokens_per_s / (self.num_devices * self.peak_flops_per_device)
        return {"step_time_s": float(step_seconds), "tokens_per_s": tokens_per_s, "mfu": mfu}

    def record(self, step: int, metrics: dict, *, step_seconds: float) -> dict:
        """Figures for `step`; the primary writes every scalar of metrics and the figures to TensorBoard."""
        perf = self.throughput(step_seconds)
        self._last = perf
        if self._first_recorded is None:
            self._first_recorded = step      # its time includes compilation: kept out of the ETA
        else:
            self._run[0] += 1
            self._run[1] += step_seconds
        self._window[0] += 1
        self._window[1] += step_seconds
        if self.primary:
            if self._writer is None:
                from tensorboardX import SummaryWriter
                # purge_step: after a resume TensorBoard hides the events a crashed run logged past it.
                self._writer = SummaryWriter(self.tensorboard_dir, purge_step=step, flush_secs=30)
            for key, value in {**metrics, **perf}.items():
                v = None if key == "step" else _scalar(value)      # a metrics row may carry its step
                if v is not None:
                    self._writer.add_scalar(key, v, global_step=step)
        return perf

    def progress(self, step: int, total: int, metrics: dict, extra: dict | None = None) -> str:
        """One progress line: loss (and eval_loss / max_attn_logit when in metrics or extra), step time,
        tokens/s and MFU averaged over the steps recorded since the previous line, and the ETA from the
        mean step time of this run (the first recorded step, which compiles, left out)."""
        row = {**metrics, **(extra or {})}
        parts = [f"step {step}/{total}"]
        for key, fmt in (("loss", ".4f"), ("eval_loss", ".4f"), ("max_attn_logit", ".2f")):
            v = _scalar(row.get(key))
            if v is not None:
                parts.append(f"{key} {v:{fmt}}")
        n, secs = self._window
        perf = self.throughput(secs / n) if n else self._last
        self._window = [0, 0.0]
        if perf["step_time_s"] is None:
            parts.append("step time n/a")
        else:
            mfu = "n/a" if perf["mfu"] is None else f"{perf['mfu']:.1%}"
            parts.append(f"{perf['step_time_s']:.3f} s/step {perf['tokens_per_s']:,.0f} tok/s MFU {mfu}")
        run_n, run_secs = self._run
        mean = run_secs / run_n if run_n else perf["step_time_s"]
        parts.append("ETA " + ("n/a" if mean is None else fmt_eta((total - step) * mean)))
        return " ".join(parts)

    def close(self) -> None:
        if self._tracing:
            self._stop_trace()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ScalarLog:
    """TensorBoard scalars of a phase outside the train loop (an RL or distillation stage): every numeric
    field of each row at the row's step, into `logdir` (primary process only). purge_step: a resumed
    stage's first step, so TensorBoard hides what a crashed run logged past it."""

    def __init__(self, logdir: str, *, purge_step: int | None = None, primary: bool | None = None):
        self.logdir, self.purge_step = logdir, purge_step
        self.primary = jax.process_index() == 0 if primary is None else bool(primary)
        self._writer = None

    def write(self, row: dict, step: int | None = None) -> None:
        if not self.primary:
            return
        step = int(row["step"] if step is None else step)
        if self._writer is None:
            from tensorboardX import SummaryWriter
            self._writer = SummaryWriter(self.logdir, purge_step=self.purge_step, flush_secs=30)
        for key, value in row.items():
            v = None if key == "step" else _scalar(value)
            if v is not None:
                self._writer.add_scalar(key, v, global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def write_scalars(logdir: str, rows) -> None:
    """A finished phase's per-step rows (each with its "step") as TensorBoard scalars in `logdir`
    (primary process only): for a stage that hands back its history instead of writing as it runs."""
    log = ScalarLog(logdir)
    for row in rows:
        log.write(row)
    log.close()


def has_events(logdir: str) -> bool:
    """Whether `logdir` holds a TensorBoard event file (directly, not in a subfolder)."""
    return os.path.isdir(logdir) and any(n.startswith("events.out.tfevents") for n in os.listdir(logdir))


def phase_logdir(jsonl_path: str) -> str:
    """Where a phase's TensorBoard events go: the train loop's DIR/tensorboard for DIR/metrics.jsonl, and
    DIR/tensorboard/NAME for another phase's DIR/NAME.jsonl (an RL stage's rl_b.jsonl)."""
    d, name = os.path.split(jsonl_path)
    stem = name[:-len(".jsonl")] if name.endswith(".jsonl") else name
    return os.path.join(d, "tensorboard") if stem == "metrics" else os.path.join(d, "tensorboard", stem)


def export_phases(workdir: str) -> list[str]:
    """TensorBoard events for every phase of a run that wrote per-step rows (a *.jsonl whose rows carry a
    numeric "step") but no events of its own (an agentic stage that writes its history at the end):
    -> the log dirs written. Files whose first row has no step (corpora, dropped documents) are skipped."""
    import json
    written = []
    for root, dirs, files in os.walk(workdir):
        dirs[:] = [x for x in dirs if x not in ("tensorboard", "jax_cache", "checkpoints", "profile")]
        for name in sorted(files):
            if not name.endswith(".jsonl"):
                continue
            path = os.path.join(root, name)
            logdir = phase_logdir(path)
            if has_events(logdir):
                continue
            rows = []
            with open(path) as f:
                for i, line in enumerate(f):
                    try:
                        row = json.loads(line)
                    except ValueError:
                        break                     # a line cut short by a crash: the rows before it
                    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                        break
                    rows.append(row)
            if rows:
                write_scalars(logdir, rows)
                written.append(logdir)
    return written
