"""The training loop: periodic eval, progress with rate and ETA, metrics.jsonl, orbax checkpoints,
exact resume (state + data iterator + PRNG), and a clean stop on a non-finite loss.

The state is created on the mesh (glm5_jax.train.state.init_train_state) and stepped by the one step
(glm5_jax.train.step.make_train_step). The host reads step k's metrics only after step k+1 has been
dispatched, so it does not wait on the device every step; steps that checkpoint, evaluate, monitor
or end the run read their metrics at once. A checkpoint is saved only after its step's loss is known
to be finite, so the last checkpoint is always a good one even though a NaN may be seen a step late.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.config import ModelConfig
from glm5_jax.optim import optimizer_table
from glm5_jax.sharding import single_device_mesh
from glm5_jax.train.checkpoint import Checkpointer
from glm5_jax.train.config import TrainConfig
from glm5_jax.train.state import abstract_param_shapes, abstract_state, build_optimizer, init_train_state
from glm5_jax.train.step import make_eval_step, make_monitor_fn, make_train_step


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the last good checkpoint is kept."""


def evaluate(model_cfg: ModelConfig, params, batches: Iterable[dict], eval_step=None) -> dict:
    """Token-mean eval loss over `batches` and top-1 accuracy on masked positions."""
    eval_step = eval_step or make_eval_step(model_cfg)
    tot, n, correct = 0.0, 0.0, 0.0
    for batch in batches:
        s, c, pred = eval_step(params, {k: jnp.asarray(v) for k, v in batch.items()})
        tot, n = tot + float(s), n + float(c)
        correct += float(np.sum((np.asarray(pred) == batch["targets"]) * batch["loss_mask"]))
    return {"eval_loss": tot / max(n, 1.0), "eval_accuracy": correct / max(n, 1.0)}


def _read_metrics(path: str, upto: int | None) -> list[dict]:
    if not os.path.exists(path):
        return []
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [r for r in rows if upto is None or r["step"] <= upto]


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def train(model_cfg: ModelConfig, tcfg: TrainConfig, train_iter, workdir: str, *,
          init_params=None, eval_fn: Callable[[object], dict] | None = None, log=None,
          name: str = "train", stop_after: int | None = None, mesh=None, loss_fn=None) -> dict:
    """Train for tcfg.steps steps in `workdir`, resuming from its latest checkpoint if any.

    train_iter: an iterator of numpy batch dicts with get_state()/set_state() (glm5_jax.data).
    eval_fn(params) -> dict of eval metrics, run every eval_every steps and at the end.
    mesh: where the state lives and the step runs (default: one device); a checkpoint written on any
    mesh is resharded onto it. loss_fn: plugged into the step (default: the LM loss, make_loss_fn).
    Returns {"params", "history" (metrics rows), "final" (last eval row), "labels"}.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    mesh = single_device_mesh() if mesh is None else mesh
    os.makedirs(workdir, exist_ok=True)
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=tcfg.keep_checkpoints,
                        async_save=tcfg.async_checkpoints)
    shapes = abstract_param_shapes(model_cfg)
    tx, labels = build_optimizer(model_cfg, tcfg, shapes)
    log(f"[{name}] optimizer {tcfg.optimizer}:\n" + optimizer_table(
        shapes, labels, model_cfg if tcfg.optimizer == "muon_split" else None))
    start = 0
    latest = ckpt.latest_step()
    if latest is not None:
        state, data_state = ckpt.restore(latest, abstract_state(model_cfg, tcfg, mesh, tx)[0])
        train_iter.set_state(data_state)
        start = int(state["step"])
        log(f"[{name}] resumed from step {start} ({ckpt.directory})")
    else:
        state, _ = init_train_state(model_cfg, tcfg, mesh, tx=tx, params=init_params)
    history = _read_metrics(metrics_path, start if latest is not None else 0)
    with open(metrics_path, "w") as f:                 # drop rows logged after the restored step
        f.writelines(json.dumps(r) + "\n" for r in history)

    step_fn = make_train_step(model_cfg, tcfg, tx, mesh, loss_fn=loss_fn)
    monitor_fn = make_monitor_fn(model_cfg) if tcfg.monitor_every else None
    tokens_per_step = tcfg.batch_size * tcfg.seq_len
    clock = {"t0": time.time(), "last_t": time.time(), "last_step": start}
    last_good = latest
    final = None
    end = tcfg.steps if stop_after is None else min(tcfg.steps, stop_after)

    def record(mf, step, metrics, extra=None) -> None:
        """Read `step`'s metrics (waits for that step), stop on a non-finite loss, write and log the row."""
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not math.isfinite(metrics["loss"]):
            ckpt.close()
            raise TrainingDiverged(
                f"[{name}] loss is {metrics['loss']} at step {step}; stopped. The last good checkpoint is "
                f"step {last_good} in {ckpt.directory} (lower learning_rate or enable grad_clip)")
        row = {"step": step, **metrics, **(extra() if extra else {})}
        history.append(row)
        mf.write(json.dumps(row) + "\n")
        mf.flush()
        if step % tcfg.log_every == 0 or step == end or "eval_loss" in row:
            now = time.time()
            rate = (step - clock["last_step"]) * tokens_per_step / max(now - clock["last_t"], 1e-9)
            eta = (tcfg.steps - step) * (now - clock["t0"]) / max(step - start, 1)
            ev = f" eval_loss {row['eval_loss']:.4f}" if "eval_loss" in row else ""
            ev += f" max_attn_logit {row['max_attn_logit']:.2f}" if "max_attn_logit" in row else ""
            log(f"[{name}] step {step}/{tcfg.steps} loss {metrics['loss']:.4f}{ev} "
                f"{rate:,.0f} tok/s ETA {_fmt_eta(eta)}")
            clock["last_t"], clock["last_step"] = now, step

    pending = None                                     # (step, its metrics still on device)
    with open(metrics_path, "a") as mf:
        for step in range(start + 1, end + 1):
            batch = jax.device_put(next(train_iter), step_fn.batch_sharding)
            state, metrics = step_fn(state, batch)
            if pending is not None:                    # the previous step's metrics, while this one runs
                record(mf, *pending)
                pending = None
            do_ckpt = step % tcfg.ckpt_every == 0 or step == tcfg.steps
            do_eval = eval_fn is not None and (step % tcfg.eval_every == 0 or step == tcfg.steps)
            do_mon = monitor_fn is not None and (step % tcfg.monitor_every == 0 or step == tcfg.steps)
            if not (do_ckpt or do_eval or do_mon or step == end):
                pending = (step, metrics)
                continue

            def extra(step=step, batch=batch, do_eval=do_eval, do_mon=do_mon):
                nonlocal final
                out = {}
                if do_mon:     # after the update, on this step's batch: a separate forward, no gradients
                    out.update({k: float(v) for k, v in jax.device_get(monitor_fn(state["params"], batch)).items()})
                if do_eval:
                    final = {"step": step, **eval_fn(state["params"])}
                    out.update(final)
                return out

            record(mf, step, metrics, extra)           # before the save: only a finite step is checkpointed
            if do_ckpt:
                ckpt.save(step, state, train_iter.get_state())
                last_good = step
    ckpt.close()
    if final is None and eval_fn is not None:
        final = {"step": int(state["step"]), **eval_fn(state["params"])}
    return {"params": state["params"], "history": history, "final": final, "labels": labels}
