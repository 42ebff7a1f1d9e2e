"""Learning-rate schedules (glm5_jax.optim.schedules) against their closed forms, TrainConfig's choice of
schedule (cosine by default, unchanged; wsd = warmup-stable-decay) and its validation, and the optimizer
the train state builds following TrainConfig.schedule() (AdamW's first update on a known gradient)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.optim.schedules import lr_schedule, warmup_cosine, warmup_stable_decay
from glm5_jax.train import TrainConfig
from glm5_jax.train.state import abstract_param_shapes, build_optimizer


def _wsd_reference(s, peak, w, total, frac, r):
    d0 = max(total - round(frac * total), w)
    if s < w:
        return peak * (s + 1) / w
    if s < d0 or d0 >= total:                 # no decay steps: the peak is held
        return peak
    return peak * (1 - (1 - r) * min((s + 1 - d0) / (total - d0), 1.0))


def _cosine_reference(s, peak, w, total, r):
    """The closed form the project computed itself before issue 60 (now optax's schedules)."""
    if s < w:
        return peak * (s + 1) / w
    if total is None:
        return peak
    prog = min(max((s - w) / max(total - w, 1), 0.0), 1.0)
    return peak * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * prog)))


# float32 rounding: optax's linear warm-up is (init - end) * frac + end, not peak * (s + 1) / w
RTOL = 2e-5


@pytest.mark.parametrize("w,total,frac,r", [(3, 20, 0.25, 0.1), (0, 10, 1.0, 0.0), (4, 12, 0.0, 0.1),
                                            (2, 9, 0.5, 0.3), (5, 5, 0.5, 0.1), (1, 7, 0.2, 0.1),
                                            (10, 300, 0.2, 0.1), (0, 1, 1.0, 0.1), (3, 10, 0.1, 0.0)])
def test_warmup_stable_decay_matches_closed_form(w, total, frac, r):
    f = jax.jit(warmup_stable_decay(2.0, w, total, frac, r))
    got = [float(f(s)) for s in range(total + 3)]
    want = [_wsd_reference(s, 2.0, w, total, frac, r) for s in range(total + 3)]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=2e-6)


@pytest.mark.parametrize("peak,w,total,r", [(1e-3, 0, 60, 0.1), (3e-3, 1, 50, 0.1), (1e-3, 5, 5, 0.1),
                                            (2.0, 4, 14, 0.1), (6e-4, 10, 300, 0.0), (1e-2, 100, 1000, 0.2),
                                            (1.0, 3, None, 0.1), (1.0, 0, None, 0.1), (5e-4, 20, 21, 0.1)])
def test_warmup_cosine_matches_closed_form(peak, w, total, r):
    """optax's join of a linear warm-up and a cosine decay gives the old closed form at every step
    (before, during and after warm-up and decay), jitted and on a batch of steps alike."""
    f = warmup_cosine(peak, w, total, r)
    steps = np.arange((total or 40) + 3)
    want = [_cosine_reference(int(s), peak, w, total, r) for s in steps]
    tol = dict(rtol=RTOL, atol=1e-6 * peak)     # 1 + cos(pi) near the end cancels in float32 (before, too)
    np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(f))(jnp.asarray(steps))), want, **tol)
    np.testing.assert_allclose([float(f(int(s))) for s in steps[:8]], want[:8], **tol)


def test_wsd_holds_the_peak_then_decays_to_the_minimum():
    f = warmup_stable_decay(1.0, 2, 10, 0.3, 0.1)
    assert [float(f(s)) for s in (0, 1)] == [0.5, 1.0]
    assert all(float(f(s)) == 1.0 for s in range(2, 7))           # stable until the last 3 steps
    assert 0.1 < float(f(8)) < float(f(7)) < 1.0 and math.isclose(float(f(9)), 0.1, rel_tol=1e-6)


def test_train_config_schedule_default_is_the_cosine():
    tc = TrainConfig(steps=30, warmup_steps=4, learning_rate=1e-2, min_lr_ratio=0.2)
    ref = warmup_cosine(1e-2, 4, 30, 0.2)
    np.testing.assert_allclose([float(tc.schedule()(s)) for s in range(32)], [float(ref(s)) for s in range(32)])
    wsd = tc.replace(lr_schedule="wsd", decay_fraction=0.5)
    want = warmup_stable_decay(1e-2, 4, 30, 0.5, 0.2)
    np.testing.assert_allclose([float(wsd.schedule()(s)) for s in range(32)], [float(want(s)) for s in range(32)])
    # warmup longer than the run is clipped to it, as before
    short = TrainConfig(steps=3, warmup_steps=10, lr_schedule="wsd")
    np.testing.assert_allclose(float(short.schedule()(2)), short.learning_rate)


@pytest.mark.parametrize("kw,match", [
    ({"lr_schedule": "linear"}, r"lr_schedule='linear' is invalid: allowed: cosine, wsd"),
    ({"decay_fraction": 1.5}, r"decay_fraction=1.5 is invalid: must be in \[0, 1\]"),
    ({"decay_fraction": -0.1}, r"decay_fraction=-0.1 is invalid"),
    ({"min_lr_ratio": 2.0}, r"min_lr_ratio=2.0 is invalid"),
])
def test_bad_schedule_settings_are_refused_by_name(kw, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**kw)
    with pytest.raises(ValueError, match="allowed: cosine, wsd"):
        lr_schedule("step", 1.0, 0, 10)


def test_the_optimizer_follows_the_configured_schedule():
    """AdamW's update of a parameter with a constant gradient is -lr(s) (bias-corrected moments of a constant
    are the constant; weight decay 0): the updates of 8 steps trace the wsd schedule, not the cosine."""
    model = ModelConfig(vocab_size=320, d_model=8, num_layers=1, num_heads=1, num_kv_heads=1, attention="mha",
                        num_experts=0, mtp_depth=0, ffn_dim=8)
    tc = TrainConfig(steps=8, warmup_steps=2, learning_rate=0.1, lr_schedule="wsd", decay_fraction=0.5,
                     min_lr_ratio=0.0, weight_decay=0.0, grad_clip=0.0)
    params = jax.tree.map(lambda x: jnp.ones(x.shape, jnp.float32), abstract_param_shapes(model))
    tx, _ = build_optimizer(model, tc, params)
    state = tx.init(params)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
    steps = []
    for _ in range(8):
        upd, state = tx.update(grads, state, params)
        steps.append(-float(jax.tree.leaves(upd)[0].reshape(-1)[0]))
    want = [float(warmup_stable_decay(0.1, 2, 8, 0.5, 0.0)(s)) for s in range(8)]
    np.testing.assert_allclose(steps, want, rtol=1e-4)
