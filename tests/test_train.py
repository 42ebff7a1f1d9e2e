"""Training system: indexer KL vs NumPy, frozen parameters, exact SIGKILL resume, NaN stop, bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from glm5_jax.attention.indexer import indexer_kl_dense, indexer_kl_sparse
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.model import init_params
from glm5_jax.train import TrainConfig, TrainingDiverged, train
from glm5_jax.sharding import single_device_mesh
from glm5_jax.train.checkpoint import Checkpointer
from glm5_jax.train.state import abstract_state
from glm5_jax.train.step import build_optimizer, make_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def _np_kl_rows(q, k, scale, qi, ki, w, keys_of):
    """Per-query KL(p || softmax(I)) over the key set keys_of(b, t), p = head-summed attention, L1-normed."""
    b_, t_, h_, _ = q.shape
    out = []
    for b in range(b_):
        for t in range(t_):
            ks = keys_of(b, t)
            logits = np.stack([q[b, t, h] @ k[b, ks, h].T for h in range(h_)]) * scale
            p = _softmax(logits).sum(0)
            p = p / p.sum()
            scores = np.array([sum(w[b, t, j] * max(0.0, qi[b, t, j] @ ki[b, s]) for j in range(qi.shape[2])) for s in ks])
            lq = np.log(_softmax(scores))
            out.append(np.sum(p * (np.log(p) - lq)))
    return np.array(out)


def test_indexer_kl_matches_numpy_formula():
    rng = np.random.default_rng(0)
    b, t, h, d, hi, di = 2, 9, 3, 4, 2, 5
    q, k = rng.normal(size=(b, t, h, d)), rng.normal(size=(b, t, h, d))
    qi, ki, w = rng.normal(size=(b, t, hi, di)), rng.normal(size=(b, t, di)), rng.normal(size=(b, t, hi))
    f32 = lambda *a: [jnp.asarray(x, jnp.float32) for x in a]
    kl, recall = indexer_kl_dense(*f32(q, k), 0.5, *f32(qi, ki, w), topk=3, chunk=3)
    want = _np_kl_rows(q, k, 0.5, qi, ki, w, lambda bb, tt: list(range(tt + 1)))
    np.testing.assert_allclose(float(kl), want.mean(), rtol=1e-4)
    assert 0.0 <= float(recall) <= 1.0
    idx = np.full((b, t, 4), -1, np.int32)
    for bb in range(b):
        for tt in range(t):
            sel = rng.permutation(tt + 1)[:4]
            idx[bb, tt, :len(sel)] = sel
    kl_s = indexer_kl_sparse(*f32(q, k), 0.5, *f32(qi, ki, w), jnp.asarray(idx), chunk=3)
    want_s = _np_kl_rows(q, k, 0.5, qi, ki, w, lambda bb, tt: [s for s in idx[bb, tt] if s >= 0])
    np.testing.assert_allclose(float(kl_s), want_s.mean(), rtol=1e-4)


def _batch(cfg, b=2, t=24, seed=0):
    tok = jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, cfg.vocab_size)
    return {"tokens": tok, "targets": jnp.roll(tok, -1, 1), "loss_mask": jnp.ones((b, t), jnp.float32),
            "segment_ids": jnp.ones((b, t), jnp.int32), "positions": jnp.broadcast_to(jnp.arange(t), (b, t))}


@pytest.mark.slow  # one of the slowest default tests (suite budget: 15 min on 2 cores)
def test_frozen_parameters_unchanged_and_indexer_trains():
    cfg = ModelConfig(index_topk=4, mtp_depth=1)
    tc = TrainConfig(steps=3, batch_size=2, seq_len=24, indexer_loss="dense", trainable_pattern="indexer",
                     learning_rate=1e-2, warmup_steps=0)
    params = init_params(cfg, jax.random.PRNGKey(0))
    tx, _ = build_optimizer(cfg, tc, params)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32), "rng": jax.random.PRNGKey(1)}
    before = traverse_util.flatten_dict(jax.tree_util.tree_map(np.asarray, params))
    state, metrics = make_train_step(cfg, tc, tx)(state, _batch(cfg))
    after = traverse_util.flatten_dict(jax.tree_util.tree_map(np.asarray, state["params"]))
    changed = {"/".join(k) for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all("indexer" in p for p in changed)
    assert any("wq_b" in p for p in changed) and any("wk" in p for p in changed)
    assert np.isfinite(float(metrics["indexer_kl"])) and 0 <= float(metrics["indexer_recall"]) <= 1


@pytest.mark.slow  # minutes on 2 cores (the default suite stays under 15 min); run with -m slow
def test_full_training_updates_router_bias_and_reduces_loss():
    cfg = ModelConfig(index_topk=4, mtp_depth=1)
    tc = TrainConfig(steps=8, batch_size=2, seq_len=24, learning_rate=1e-2, warmup_steps=0, indexer_loss="sparse")
    params = init_params(cfg, jax.random.PRNGKey(0))
    tx, _ = build_optimizer(cfg, tc, params)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32), "rng": jax.random.PRNGKey(1)}
    step = make_train_step(cfg, tc, tx)
    batch = _batch(cfg)
    losses = []
    for _ in range(8):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0]
    biases = [v for k, v in traverse_util.flatten_dict(state["params"]).items() if k[-1] == "e_score_correction_bias"]
    assert biases and all(np.any(np.asarray(b) != 0) for b in biases)
    assert {"ce", "mtp_loss", "indexer_kl", "grad_norm", "update_norm", "expert_load_max_over_mean"} <= set(m)


def _worker(workdir, steps, delay, cache):
    return [sys.executable, os.path.join(ROOT, "tests", "resume_worker.py"), str(workdir), str(steps), str(delay), str(cache)]


def _rows(workdir):
    return [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl")) if l.strip()]


@pytest.mark.slow  # one of the slowest default tests (suite budget: 15 min on 2 cores)
def test_sigkill_resume_equals_uninterrupted(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    cache = tmp_path / "cache"
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_worker(full, 12, 0.0, cache), env=env, check=True, capture_output=True, timeout=300)
    proc = subprocess.Popen(_worker(killed, 12, 0.4, cache), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline:
        path = killed / "metrics.jsonl"
        if path.exists() and len([l for l in open(path) if l.strip()]) >= 7:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(_rows(killed)) < 12
    subprocess.run(_worker(killed, 12, 0.0, cache), env=env, check=True, capture_output=True, timeout=300)
    a, b = _rows(full), _rows(killed)
    assert [r["step"] for r in b] == list(range(1, 13))
    assert a == b                                   # bitwise: every metric of every step
    assert a[-1]["loss"] < a[0]["loss"]


class _NaNAt:
    def __init__(self, it, bad_step):
        self.it, self.bad, self.n = it, bad_step, 0

    def __next__(self):
        self.n += 1
        b = dict(next(self.it))
        if self.n == self.bad:
            b["loss_mask"] = np.full(b["loss_mask"].shape, np.nan, np.float32)
        return b

    def get_state(self):
        return {"n": self.n}

    def set_state(self, s):
        self.n = s["n"]


class _Random:
    def __init__(self, cfg):
        self.cfg, self.i = cfg, 0

    def __next__(self):
        self.i += 1
        return {k: np.asarray(v) for k, v in _batch(self.cfg, seed=self.i).items()}


# slow: the default suite checks the same stop-and-name-the-last-good-checkpoint path in
# tests/test_train_faults.py (test_nan_gradient_with_finite_loss_is_never_checkpointed and the lr-overflow test)
@pytest.mark.parametrize("ckpt_every,bad,good", [pytest.param(1, 4, 3, marks=pytest.mark.slow),
                                                 pytest.param(2, 5, 4, marks=pytest.mark.slow)])
def test_nan_loss_stops_with_clear_message_and_keeps_last_checkpoint(tmp_path, ckpt_every, bad, good):
    """ckpt_every=2, NaN at step 5: step 5's metrics are read one step late (after step 6 is dispatched
    on the NaN state), yet the run stops at 5 and the last checkpoint (4) holds finite parameters."""
    cfg = ModelConfig(index_topk=4, mtp_depth=0, num_layers=2)
    tc = TrainConfig(steps=8, batch_size=2, seq_len=24, ckpt_every=ckpt_every, async_checkpoints=False, log_every=1,
                     profile_steps=(2, 3))
    lines = []
    with pytest.raises(TrainingDiverged, match=rf"loss is nan at step {bad}.*last good checkpoint is step {good}"):
        train(cfg, tc, _NaNAt(_Random(cfg), bad), str(tmp_path), log=lines.append)
    assert [r["step"] for r in _rows(tmp_path)] == list(range(1, bad))
    # the observer: a progress line per step with step time, tok/s, MFU (n/a on CPU) and ETA; TensorBoard
    # events beside metrics.jsonl; the requested steps' profiler trace (closed on the way out)
    progress = [l for l in lines if " s/step " in l]
    assert len(progress) == bad - 1 and all("tok/s MFU n/a ETA" in l for l in progress)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())[-1] == good
    state, _ = Checkpointer(str(tmp_path / "checkpoints")).restore(good, abstract_state(cfg, tc, single_device_mesh())[0])
    assert int(state["step"]) == good
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(state["params"]))


@pytest.mark.parametrize("kw,msg", [(dict(steps=0), "TrainConfig.steps=0"),
                                    (dict(optimizer="sgd"), "allowed: adamw, muon, muon_split"),
                                    (dict(indexer_loss="kl"), "allowed: None, dense, sparse"),
                                    (dict(warmup_steps=-5), "warmup_steps=-5"),
                                    (dict(learning_rate=-1.0), "learning_rate")])
def test_bad_train_config(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        TrainConfig(**kw)


def test_experiment_cli_errors_list_valid_choices():
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    run = lambda *a: subprocess.run([sys.executable, "-m", "experiments.run", *a], env=env, cwd=ROOT,
                                    capture_output=True, text=True, timeout=120)
    r = run("--config=nope")
    assert r.returncode == 2 and "unknown experiment 'nope'" in r.stderr and "dsa_vs_mla" in r.stderr
    # a bad --set key / value: test_registry.py's test_cli_bad_key_exits_2_naming_it_and_valid_keys (CLI)
    # and test_bad_value_names_field_value_and_type (the parser)
    r = run("--config=dsa_vs_mla", "--preset=huge")
    assert r.returncode == 2 and "allowed: tiny, small" in r.stderr
    r = run("--list")
    assert r.returncode == 0 and "dsa_vs_mla" in r.stdout
    r = run("--config=dsa_vs_mla", "--num_processes=2", "--process_id=0")
    assert r.returncode == 2 and "needs a coordinator address host:port" in r.stderr
    r = run("--config=dsa_vs_mla", "--profile_steps=3,1", "--show")
    assert r.returncode == 2 and "TrainConfig.profile_steps=(3, 1) is invalid" in r.stderr
    r = run("--config=dsa_vs_mla", "--profile_steps=2,3", "--set", "train.grad_accum=2", "--show")
    assert r.returncode == 0 and "train.profile_steps = [2, 3]" in r.stdout and "train.grad_accum = 2" in r.stdout


def _accum_runs(cfg, tc_kw, batch, ks, loss_fn=None, params=None):
    from glm5_jax.train.state import abstract_param_shapes, init_train_state
    mesh = single_device_mesh()
    out = {}
    for k in ks:
        tc = TrainConfig(grad_accum=k, **tc_kw)
        tx, _ = build_optimizer(cfg, tc, abstract_param_shapes(cfg) if params is None else params)
        if params is None:
            state, _ = init_train_state(cfg, tc, mesh, tx=tx)
        else:
            state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
                     "rng": jax.random.PRNGKey(0)}
        state, m = make_train_step(cfg, tc, tx, mesh, loss_fn=loss_fn)(state, batch)
        out[k] = ({n: float(v) for n, v in m.items()}, traverse_util.flatten_dict(jax.device_get(state["params"])))
    return out


@pytest.mark.slow   # two compiles of the LM step: 111 s on 2 busy cores (the regression test below is the fast check)
def test_grad_accum_gives_the_full_batch_update():
    """K=4 micro-batches (a scan, token-weighted by an uneven loss_mask) vs the whole batch at once, on
    the LM loss: the same loss, gradient norm, update norm and router-bias update (expert loads are
    summed over micro-batches). Elementwise params after AdamW's first step (g / (|g| + eps)) are not a
    fair comparison here (a ~1e-9 gradient entry with float32 rounding moves its weight by ~lr); the
    regression below checks params elementwise."""
    cfg = ModelConfig(index_topk=4, mtp_depth=0, num_layers=2)
    b, t = 8, 16
    batch = _batch(cfg, b, t)
    batch["loss_mask"] = (jax.random.uniform(jax.random.PRNGKey(1), (b, t)) > 0.3).astype(jnp.int32)
    out = _accum_runs(cfg, dict(steps=3, batch_size=b, seq_len=t, warmup_steps=0, learning_rate=1e-2), batch, (1, 4))
    (m1, p1), (m4, p4) = out[1], out[4]
    assert m1.keys() == m4.keys() and {"loss", "grad_norm", "update_norm", "expert_load_max_over_mean"} <= set(m1)
    for n in m1:
        assert m1[n] == pytest.approx(m4[n], rel=1e-5), n
    bias = [p for p in p1 if p[-1] == "e_score_correction_bias"]
    assert bias and all(np.array_equal(p1[p], p4[p]) for p in bias) and any(np.any(p1[p] != 0) for p in bias)


def test_grad_accum_matches_full_batch_params_elementwise():
    """The step's accumulation (accumulated_value_and_grad) on a token-weighted regression loss with an
    uneven loss_mask: for K = 2, 4 the loss, the gradient and the params after one AdamW update agree with
    the whole batch elementwise (rtol 1e-5), and the reported loads (token counts) are summed."""
    import optax
    from glm5_jax.train.step import accumulated_value_and_grad
    rng = np.random.default_rng(0)
    b, t, d = 8, 6, 5
    params = {"w": jnp.asarray(rng.normal(size=(d, 3)), jnp.float32), "v": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32), "y": jnp.asarray(rng.normal(size=(b, t, 3)), jnp.float32),
             "loss_mask": jnp.asarray(rng.random((b, t)) > 0.4, jnp.int32)}

    def loss_fn(p, bt):
        err = jnp.sum((jnp.tanh(bt["x"] @ p["w"]) * p["v"] - bt["y"]) ** 2, -1)
        m = bt["loss_mask"].astype(jnp.float32)
        loss = jnp.sum(err * m) / jnp.maximum(jnp.sum(m), 1.0)
        return loss, ({"loss": loss}, {("layer",): jnp.sum(bt["loss_mask"], 1)[:2]})

    tx = optax.adamw(1e-1, weight_decay=0.0)
    out = {}
    for k in (1, 2, 4):
        (loss, (_, loads)), g = jax.jit(accumulated_value_and_grad(loss_fn, k, single_device_mesh()))(params, batch)
        upd, _ = tx.update(g, tx.init(params), params)
        out[k] = (float(loss), g, optax.apply_updates(params, upd), loads[("layer",)])
    for k in (2, 4):
        assert out[k][0] == pytest.approx(out[1][0], rel=1e-5)
        for n in params:
            np.testing.assert_allclose(out[k][1][n], out[1][1][n], rtol=1e-5, err_msg=n)
            np.testing.assert_allclose(out[k][2][n], out[1][2][n], rtol=1e-5, err_msg=n)
        # each micro-batch reports the token counts of its first two rows; summed over the K micro-batches
        want = np.asarray(batch["loss_mask"]).reshape(b // k, k, t).swapaxes(0, 1)[:, :2].sum((0, 2))
        np.testing.assert_array_equal(out[k][3], want)
    assert not np.allclose(out[1][2]["w"], np.asarray(params["w"]))


@pytest.mark.parametrize("kw,msg", [(dict(batch_size=8, grad_accum=3), "batch_size=8 is not divisible by TrainConfig.grad_accum=3"),
                                    (dict(grad_accum=0), "grad_accum=0"),
                                    (dict(profile_steps=(4, 2)), "profile_steps")])
def test_bad_grad_accum_and_profile_steps(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        TrainConfig(**kw)


def test_metrics_file_without_append_rewrites_whole_file(tmp_path):
    """The object-store branch (gs:// has no append): rows are kept and the file rewritten at flushes;
    a resume's truncation and the final close leave exactly the rows recorded."""
    from etils import epath
    from glm5_jax.train.loop import _MetricsFile
    path = epath.Path(tmp_path) / "metrics.jsonl"
    mf = _MetricsFile(path, [{"step": 1}], enabled=True)
    mf.local, mf._f = False, mf._f.close()             # as for a URL
    mf.write({"step": 2}, flush=False)
    assert _rows(tmp_path) == [{"step": 1}]
    mf.write({"step": 3}, flush=True)
    mf.write({"step": 4}, flush=False)
    assert _rows(tmp_path) == [{"step": s} for s in (1, 2, 3)]
    mf.close()
    assert _rows(tmp_path) == [{"step": s} for s in (1, 2, 3, 4)]
    off = _MetricsFile(epath.Path(tmp_path) / "other.jsonl", [], enabled=False)   # a non-primary process
    off.write({"step": 1}, flush=True)
    off.close()
    assert not (tmp_path / "other.jsonl").exists() and off.rows == [{"step": 1}]
