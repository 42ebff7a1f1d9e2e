"""Training faults (issue 44): non-finite steps are never applied or checkpointed, SIGTERM checkpoints the
step reached and resumes bitwise, a damaged latest checkpoint / a partial metrics line fall back to the
previous step with equal losses, time-based checkpoints and keep_period."""

import json
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.sharding import single_device_mesh
from glm5_jax.train import TrainConfig, TrainingDiverged, train
from glm5_jax.train.checkpoint import Checkpointer
from glm5_jax.train.preempt import PREEMPTED_EXIT_CODE, Preempted
from glm5_jax.train.state import abstract_state, init_train_state
from glm5_jax.train.step import make_loss_fn

CFG = ModelConfig(index_topk=4, mtp_depth=0, num_layers=2)


def _batch(seed, b=2, t=24):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32)
    return {"tokens": tok, "targets": np.roll(tok, -1, 1), "loss_mask": np.ones((b, t), np.float32),
            "segment_ids": np.ones((b, t), np.int32), "positions": np.broadcast_to(np.arange(t), (b, t)).astype(np.int32)}


class Data:
    """Seeded batches with exact get_state/set_state; `poison` steps carry poison=1 (a NaN gradient);
    `on_step` is called with the step number before it is returned (e.g. to send a signal)."""

    def __init__(self, poison=(), on_step=None):
        self.i, self.poison, self.on_step = 0, set(poison), on_step

    def __next__(self):
        self.i += 1
        b = _batch(self.i)
        b["poison"] = np.full((2,), float(self.i in self.poison), np.float32)
        if self.on_step is not None:
            self.on_step(self.i)
        return b

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = s["i"]


@jax.custom_vjp
def _poison_grad(x, flag):
    return x


def _pg_fwd(x, flag):
    return x, flag


def _pg_bwd(flag, g):
    return g * jnp.where(jnp.max(flag) > 0, jnp.nan, 1.0).astype(g.dtype), jnp.zeros_like(flag)


_poison_grad.defvjp(_pg_fwd, _pg_bwd)


def _loss_with_poison(tc):
    """The LM loss; on a batch with poison=1 its value is unchanged (finite) but every gradient is NaN."""
    base = make_loss_fn(CFG, tc)

    def loss_fn(params, batch):
        params = jax.tree_util.tree_map(lambda p: _poison_grad(p, batch["poison"]), params)
        return base(params, {k: v for k, v in batch.items() if k != "poison"})

    return loss_fn


def _rows(workdir):
    return [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl")) if l.strip()]


def _steps(workdir):
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def _restore(workdir, tc, step):
    state, _ = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False).restore(
        step, abstract_state(CFG, tc, single_device_mesh())[0])
    return jax.device_get(state)


def _finite(tree):
    return all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(tree)
               if np.issubdtype(np.asarray(x).dtype, np.floating))


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


BASE = dict(batch_size=2, seq_len=24, async_checkpoints=False, log_every=1, warmup_steps=0, eval_every=100)


@pytest.mark.slow   # three runs, each compiling the step: ~60 s (the NaN-gradient test below is the fast check)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_overflowing_learning_rate_is_never_applied_or_checkpointed(tmp_path):
    """lr 1e39: step 1's loss is finite but its update is inf. Stop mode ends at step 1 with no checkpoint
    (before: the inf params were saved as step 1 and named 'the last good checkpoint'); skip mode runs on,
    every step skipped, and every checkpoint holds the initial (finite) params and optimizer state."""
    tc = TrainConfig(steps=3, ckpt_every=1, keep_checkpoints=3, learning_rate=1e39, **BASE)
    with pytest.raises(TrainingDiverged, match=r"at step 1 .*update_norm (nan|inf); the step was not applied.*No checkpoint"):
        train(CFG, tc, Data(), str(tmp_path / "stop"), log=lambda m: None)
    assert _steps(tmp_path / "stop") == []
    skip = tc.replace(nonfinite="skip")
    lines = []
    out = train(CFG, skip, Data(), str(tmp_path / "skip"), log=lines.append)
    rows = _rows(tmp_path / "skip")
    assert [r["skipped_steps"] for r in rows] == [1, 2, 3] and all(r["skipped"] == 1.0 for r in rows)
    assert all(np.isfinite(r["loss"]) for r in rows) and sum("skipped (" in l for l in lines) == 3
    init, _ = init_train_state(CFG, skip, single_device_mesh())
    init = jax.device_get(init)
    assert _steps(tmp_path / "skip") == [1, 2, 3]
    for s in (1, 2, 3):
        st = _restore(tmp_path / "skip", skip, s)
        assert _finite(st) and int(st["step"]) == s
        assert _same(st["params"], init["params"]) and _same(st["opt_state"], init["opt_state"])
    assert _same(jax.device_get(out["params"]), init["params"])
    # a run that only skips stops after max_skipped_steps in a row
    with pytest.raises(TrainingDiverged, match=r"3 steps in a row skipped \(max_skipped_steps=2\)"):
        train(CFG, skip.replace(max_skipped_steps=2), Data(), str(tmp_path / "streak"), log=lambda m: None)


def test_nan_gradient_with_finite_loss_is_never_checkpointed(tmp_path):
    """A NaN gradient at step 2 with a finite loss: stop mode ends at step 2 naming checkpoint 1 (finite);
    skip mode leaves step 2's params exactly as step 1's, trains on, every checkpoint finite."""
    tc = TrainConfig(steps=4, ckpt_every=1, keep_checkpoints=4, learning_rate=1e-2, **BASE)
    loss_fn = _loss_with_poison(tc)
    with pytest.raises(TrainingDiverged, match=r"loss is [0-9.]+ at step 2 \(grad_norm nan.*last good checkpoint is step 1"):
        train(CFG, tc, Data(poison={2}), str(tmp_path / "stop"), log=lambda m: None, loss_fn=loss_fn)
    assert _steps(tmp_path / "stop") == [1] and _finite(_restore(tmp_path / "stop", tc, 1))
    skip = tc.replace(nonfinite="skip")
    train(CFG, skip, Data(poison={2}), str(tmp_path / "skip"), log=lambda m: None, loss_fn=loss_fn)
    rows = _rows(tmp_path / "skip")
    assert [r["skipped"] for r in rows] == [0.0, 1.0, 0.0, 0.0] and rows[-1]["skipped_steps"] == 1
    states = {s: _restore(tmp_path / "skip", skip, s) for s in (1, 2, 3, 4)}
    assert all(_finite(st) for st in states.values())
    assert _same(states[2]["params"], states[1]["params"]) and _same(states[2]["opt_state"], states[1]["opt_state"])
    assert not _same(states[3]["params"], states[2]["params"])


def _loss_scaled_on_poison(tc, scale=1000.0):
    """The LM loss, multiplied by `scale` on a batch with poison=1: a finite gradient spike (the metrics'
    loss is the unscaled LM loss)."""
    base = make_loss_fn(CFG, tc)

    def loss_fn(params, batch):
        loss, aux = base(params, {k: v for k, v in batch.items() if k != "poison"})
        return loss * jnp.where(jnp.max(batch["poison"]) > 0, scale, 1.0), aux

    return loss_fn


@pytest.mark.slow   # three runs, each compiling the step: ~45 s; spike skipping is off by default
def test_spike_is_skipped_once_the_window_is_full_and_resumes_exactly(tmp_path):
    """spike_window=3, spike_k=20: a 1000x gradient (finite) at step 2 is applied (the window is not full yet);
    the same at step 7 is skipped: spike = 1, skipped = 0 (not a non-finite step, no stop in the default
    stop mode), step 7's params and optimizer state equal step 6's, step 8 trains on; spike_steps counts it.
    A run stopped after step 7 and resumed gives the rows of the uninterrupted run (the window is in the
    checkpoint)."""
    tc = TrainConfig(steps=9, ckpt_every=1, keep_checkpoints=9, learning_rate=1e-3, spike_window=3, spike_k=20.0,
                     **BASE)
    loss_fn = _loss_scaled_on_poison(tc)
    lines = []
    train(CFG, tc, Data(poison={2, 7}), str(tmp_path / "full"), log=lines.append, loss_fn=loss_fn)
    rows = _rows(tmp_path / "full")
    assert [r["spike"] for r in rows] == [0.0] * 6 + [1.0, 0.0, 0.0], [(r["loss"], r["grad_norm"]) for r in rows]
    assert all(r["skipped"] == 0.0 for r in rows) and rows[-1]["spike_steps"] == 1
    assert rows[1]["grad_norm"] > 100 * rows[0]["grad_norm"] and rows[6]["grad_norm"] > 100 * rows[5]["grad_norm"]
    assert sum("a spike" in l for l in lines) == 1
    st = {s: _restore(tmp_path / "full", tc, s) for s in (6, 7, 8)}
    assert _same(st[7]["params"], st[6]["params"]) and _same(st[7]["opt_state"], st[6]["opt_state"])
    assert not _same(st[8]["params"], st[7]["params"]) and int(st[7]["step"]) == 7
    assert int(st[6]["spike"]["count"]) == 6 and int(st[7]["spike"]["count"]) == 6   # a skipped step is not recorded
    train(CFG, tc, Data(poison={2, 7}), str(tmp_path / "cut"), log=lambda m: None, loss_fn=loss_fn, stop_after=7)
    train(CFG, tc, Data(poison={2, 7}), str(tmp_path / "cut"), log=lambda m: None, loss_fn=loss_fn)
    assert _rows(tmp_path / "cut") == rows


def test_sigterm_checkpoints_the_step_reached_and_resumes_bitwise(tmp_path):
    """SIGTERM during step 3's batch: the loop finishes step 3, checkpoints it (not a ckpt_every step),
    logs one line and raises Preempted (exit code 143); the same call again continues to the same rows as
    an uninterrupted run, bitwise. The previous SIGTERM handler is back afterwards."""
    tc = TrainConfig(steps=5, ckpt_every=100, learning_rate=1e-2, **BASE)
    train(CFG, tc, Data(), str(tmp_path / "full"), log=lambda m: None)
    before = signal.getsignal(signal.SIGTERM)
    kill = lambda i: os.kill(os.getpid(), signal.SIGTERM) if i == 3 else None
    lines = []
    with pytest.raises(Preempted) as info:
        train(CFG, tc, Data(on_step=kill), str(tmp_path / "cut"), log=lines.append)
    assert info.value.code == PREEMPTED_EXIT_CODE == 143 and info.value.step == 3
    assert signal.getsignal(signal.SIGTERM) is before
    pre = [l for l in lines if "preempted" in l]
    assert len(pre) == 1 and "checkpoint of step 3" in pre[0] and "code 143" in pre[0], lines
    assert _steps(tmp_path / "cut") == [3] and [r["step"] for r in _rows(tmp_path / "cut")] == [1, 2, 3]
    train(CFG, tc, Data(), str(tmp_path / "cut"), log=lambda m: None)
    assert _rows(tmp_path / "cut") == _rows(tmp_path / "full")


@pytest.mark.slow   # ~27 s: two runs compiling the step (the SIGTERM and NaN tests stay in the default run)
def test_damaged_latest_checkpoint_and_partial_metrics_line_resume_from_previous_step(tmp_path):
    """Checkpoints 2 and 4 kept; step 4's state files are damaged and metrics.jsonl ends in a half-written
    line: the resume warns naming step 4 and step 2, recomputes steps 3-4 to the same losses and goes on.
    Also: a time-based checkpoint (ckpt_every_minutes) lands between the step-based ones, keep_period
    keeps its multiples beside the rolling window."""
    wd = tmp_path / "run"
    tc = TrainConfig(steps=6, ckpt_every=2, keep_checkpoints=2, learning_rate=1e-2, **BASE)
    train(CFG, tc, Data(), str(wd), log=lambda m: None, stop_after=4)
    first = _rows(wd)
    assert _steps(wd) == [2, 4]
    for root, _, files in os.walk(wd / "checkpoints" / "4" / "state"):
        for f in files:
            if not f.startswith("_"):
                with open(os.path.join(root, f), "wb") as fh:
                    fh.write(b"\0garbage")
    with open(wd / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 3.')
    lines = []
    train(CFG, tc, Data(), str(wd), log=lines.append)
    warn = [l for l in lines if "unreadable checkpoint" in l]
    assert len(warn) == 1 and "step 4" in warn[0] and "resuming from step 2" in warn[0], lines
    assert any("partial last line" in l for l in lines)
    rows = _rows(wd)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["loss"] for r in rows[:4]] == [r["loss"] for r in first]
    # every checkpoint unreadable: one error naming them
    for s in _steps(wd):
        shutil.rmtree(wd / "checkpoints" / str(s) / "state")
        os.makedirs(wd / "checkpoints" / str(s) / "state")
    from glm5_jax.train.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="no checkpoint in .* reads back: step 6 .*step 4"):
        train(CFG, tc.replace(steps=8), Data(), str(wd), log=lambda m: None)


def test_time_based_checkpoints_and_keep_period(tmp_path):
    """ckpt_every_minutes tiny: every step is a time-based checkpoint; keep 1 + keep_period 2 leaves the
    even steps and the newest one."""
    tc = TrainConfig(steps=5, ckpt_every=100, keep_checkpoints=1, keep_period=2, ckpt_every_minutes=1e-9,
                     learning_rate=1e-2, **BASE)
    train(CFG, tc, Data(), str(tmp_path), log=lambda m: None)
    assert _steps(tmp_path) == [2, 4, 5]


@pytest.mark.parametrize("kw,msg", [(dict(nonfinite="ignore"), "allowed: stop, skip"),
                                    (dict(keep_period=-1), "keep_period=-1"),
                                    (dict(ckpt_every_minutes=-1.0), "ckpt_every_minutes=-1.0"),
                                    (dict(max_skipped_steps=1.5), "max_skipped_steps=1.5"),
                                    (dict(spike_window=1), "spike_window=1 is invalid: must be 0 .off. or an integer >= 2"),
                                    (dict(spike_k=0.0), "spike_k=0.0 is invalid")])
def test_bad_fault_settings(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        TrainConfig(**kw)


@pytest.mark.slow   # three 2-process launches, each compiling the step: minutes on 2 busy cores
def test_sigterm_to_one_of_two_processes_checkpoints_both_and_resumes_bitwise(tmp_path):
    """jax.distributed on CPU, 2 processes x 2 devices (tests/mp_worker.py): SIGTERM to process 1 only.
    jax's preemption notice reaches both; they agree on one step, both checkpoint it, log one line and
    exit 143; the same command again ends with the rows of an uninterrupted 2-process run, bitwise."""
    import time
    from tests.test_multiprocess import _finish, _launch
    from tests.test_multiprocess import _rows as mp_rows
    cache, full, cut = tmp_path / "data_cache", tmp_path / "full", tmp_path / "cut"
    _finish(_launch(full, 0.0, cache, 2, tmp_path))
    ref = mp_rows(full)
    procs = _launch(cut, 0.6, cache, 2, tmp_path)
    deadline = time.time() + 600
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if (cut / "metrics.jsonl").exists() and len(mp_rows(cut)) >= 2:
            break
        time.sleep(0.1)
    t0 = time.time()
    procs[1].send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(timeout=300)
    took = time.time() - t0
    logs = []
    for p in procs:
        p.log.seek(0)
        logs.append(p.log.read())
    assert [p.returncode for p in procs] == [PREEMPTED_EXIT_CODE] * 2, [l[-2000:] for l in logs]
    rows = mp_rows(cut)
    reached = rows[-1]["step"]
    assert 2 <= reached < 8 and _steps(cut)[-1] == reached, (reached, _steps(cut))
    assert sum("preempted" in l for l in logs[0].splitlines()) == 1     # the primary logs one line
    assert took < 120, took
    _finish(_launch(cut, 0.0, cache, 2, tmp_path))
    assert mp_rows(cut) == ref
