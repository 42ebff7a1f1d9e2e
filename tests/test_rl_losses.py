"""GRPO / IcePop losses against an independent NumPy transcription of the formula."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.rl.losses import (
    LOSSES,
    group_advantages,
    grpo_icepop_loss,
    no_correction_loss,
    truncated_is_loss,
)


def np_objective(logp, old, inf, adv, mask, weight_fn, eps_low=0.2, eps_high=0.28):
    B, T = logp.shape
    seq = np.zeros(B)
    for b in range(B):
        tot, n = 0.0, 0
        for t in range(T):
            if not mask[b, t]:
                continue
            rho = math.exp(old[b, t] - inf[b, t])
            w = weight_fn(rho)
            r = math.exp(logp[b, t] - old[b, t])
            a = adv[b]
            rc = min(max(r, 1 - eps_low), 1 + eps_high)
            tot += w * min(r * a, rc * a)
            n += 1
        seq[b] = tot / n if n else 0.0
    return -seq.mean()


def icepop_w(beta):
    return lambda rho: rho if (1 / beta <= rho <= beta) else 0.0


def make_batch(seed, B=6, T=9):
    rng = np.random.default_rng(seed)
    old = rng.normal(-2.0, 0.5, (B, T))
    # mismatch spread so that rho lands both inside and outside [1/2, 2]
    inf = old + rng.normal(0.0, 0.8, (B, T))
    # ratios from ~0.5 to ~2: both clip branches are exercised
    logp = old + rng.normal(0.0, 0.4, (B, T))
    adv = rng.normal(0.0, 1.0, B)
    mask = rng.random((B, T)) < 0.7
    mask[0] = False  # an all-masked row
    mask[1] = True
    # garbage on masked positions must not matter
    logp = np.where(mask, logp, -np.inf)
    return logp, old, inf, adv, mask.astype(np.float32)


def test_icepop_matches_numpy_and_exercises_all_branches():
    for seed in range(3):
        logp, old, inf, adv, mask = make_batch(seed)
        loss, met = jax.jit(grpo_icepop_loss)(logp, old, inf, adv, mask)
        ref = np_objective(logp, old, inf, adv, mask, icepop_w(2.0))
        assert np.isfinite(float(loss))
        np.testing.assert_allclose(float(loss), ref, rtol=1e-5, atol=1e-6)
        m = mask.astype(bool)
        rho = np.exp(old - inf)[m]
        assert ((rho < 0.5) | (rho > 2)).any() and ((rho >= 0.5) & (rho <= 2)).any()
        r = np.exp(np.where(m, logp - old, 0))[m]
        assert (r > 1.28).any() and (r < 0.8).any()
        assert 0 < float(met["pop_frac"]) < 1 and 0 < float(met["clip_frac"]) < 1


def test_other_betas_and_eps():
    logp, old, inf, adv, mask = make_batch(7)
    loss, _ = grpo_icepop_loss(logp, old, inf, adv, mask, beta=1.5, eps_low=0.1, eps_high=0.15)
    ref = np_objective(logp, old, inf, adv, mask, icepop_w(1.5), 0.1, 0.15)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5, atol=1e-6)


def test_all_masked_batch_is_finite_zero():
    logp, old, inf, adv, mask = make_batch(1)
    mask = np.zeros_like(mask)
    for fn in LOSSES.values():
        loss, met = fn(logp, old, inf, adv, mask)
        assert float(loss) == 0.0
        assert all(np.isfinite(np.asarray(v)).all() for v in met.values())
        g = jax.grad(lambda lp: fn(lp, old, inf, adv, mask)[0])(jnp.asarray(logp))
        assert np.all(np.asarray(g) == 0.0)


def test_gradient_zero_on_popped_and_masked_tokens():
    logp, old, inf, adv, mask = make_batch(2)
    g = jax.jit(jax.grad(lambda lp: grpo_icepop_loss(lp, old, inf, adv, mask)[0]))(
        jnp.asarray(logp)
    )
    g = np.asarray(g)
    assert np.isfinite(g).all()
    m = mask.astype(bool)
    rho = np.exp(old - inf)
    popped = m & ((rho < 0.5) | (rho > 2.0))
    assert popped.any()
    assert np.all(g[popped] == 0.0)
    assert np.all(g[~m] == 0.0)
    # unpopped, unclipped tokens with nonzero advantage do get gradient
    r = np.exp(np.where(m, logp - old, 0))
    live = m & ~popped & (r > 0.8) & (r < 1.28) & (np.abs(adv)[:, None] > 1e-3)
    assert live.any() and np.all(g[live] != 0.0)


def test_gradient_matches_numpy_analytic():
    logp, old, inf, adv, mask = make_batch(3)
    g = np.asarray(jax.grad(lambda lp: grpo_icepop_loss(lp, old, inf, adv, mask)[0])(
        jnp.asarray(logp)))
    B, T = logp.shape
    ref = np.zeros((B, T))
    for b in range(B):
        n = mask[b].sum()
        for t in range(T):
            if not mask[b, t]:
                continue
            rho = math.exp(old[b, t] - inf[b, t])
            w = icepop_w(2.0)(rho)
            r = math.exp(logp[b, t] - old[b, t])
            a = adv[b]
            rc = min(max(r, 0.8), 1.28)
            # d/dlogp of min(rA, clip(r)A): unclipped branch active -> r*A, else 0
            # (inside the clip band both branches are r*A, so both give r*A)
            ref[b, t] = -(w * r * a if r * a <= rc * a else 0.0) / n / B
    np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-7)


def test_metrics_hand_case():
    # one row, 4 masked tokens + 1 padding token
    old = np.zeros((1, 5))
    inf = np.array([[0.0, math.log(0.25), math.log(3.0), 0.0, 0.0]])  # rho = 1, 4, 1/3, 1
    logp = np.array([[math.log(1.5), 0.0, 0.0, math.log(0.5), 9.0]])  # r = 1.5, 1, 1, .5
    mask = np.array([[1, 1, 1, 1, 0]], np.float32)
    adv = np.array([1.0])
    loss, met = grpo_icepop_loss(logp, old, inf, adv, mask)
    # rho for tok1 = exp(0 - log .25) = 4 -> popped; tok2 = 1/3 -> popped
    assert float(met["pop_frac"]) == pytest.approx(0.5)
    # r = 1.5 > 1.28 with A > 0 -> clipped; r = .5 < .8 with A > 0 -> not clipped (min picks r*A)
    assert float(met["clip_frac"]) == pytest.approx(0.25)
    assert float(met["ratio_mean"]) == pytest.approx((1.5 + 1 + 1 + 0.5) / 4)
    k3 = [0.0, 4 - 1 - math.log(4), 1 / 3 - 1 - math.log(1 / 3), 0.0]
    assert float(met["mismatch_kl"]) == pytest.approx(sum(k3) / 4, rel=1e-6)
    assert float(met["tokens"]) == 4
    # objective: tok0 = 1.28, tok1/2 popped, tok3 = 0.5  -> mean over 4 tokens
    assert float(loss) == pytest.approx(-(1.28 + 0.5) / 4, rel=1e-6)


def test_truncated_is_matches_numpy():
    logp, old, inf, adv, mask = make_batch(4)
    for cap in (2.0, 1.2):
        loss, met = truncated_is_loss(logp, old, inf, adv, mask, cap=cap)
        ref = np_objective(logp, old, inf, adv, mask, lambda rho: min(rho, cap))
        np.testing.assert_allclose(float(loss), ref, rtol=1e-5, atol=1e-6)
        m = mask.astype(bool)
        np.testing.assert_allclose(float(met["pop_frac"]), (np.exp(old - inf)[m] > cap).mean(),
                                   rtol=1e-6)
    # truncated gradient: weight min(rho, cap) is constant, grad never flows into infer/old
    g_old = jax.grad(lambda o: truncated_is_loss(logp, o, inf, adv, mask)[0])(jnp.asarray(old))
    assert np.all(np.asarray(g_old) == 0.0)


def test_none_variant():
    logp, old, inf, adv, mask = make_batch(5)
    loss, met = no_correction_loss(logp, old, inf, adv, mask)
    np.testing.assert_allclose(float(loss), np_objective(logp, old, inf, adv, mask, lambda r: 1.0),
                               rtol=1e-5, atol=1e-6)
    assert float(met["pop_frac"]) == 0.0
    # ignores infer_logp entirely (except metrics)
    loss2, _ = no_correction_loss(logp, old, inf + 1.0, adv, mask)
    assert float(loss2) == float(loss)
    # equals icepop with beta = inf when the engines agree (rho == 1)
    l_inf, _ = grpo_icepop_loss(logp, old, old, adv, mask, beta=float("inf"))
    np.testing.assert_allclose(float(l_inf), float(loss), rtol=1e-6)
    # icepop with beta = inf is untruncated IS == TIS with cap = inf
    l_ice, _ = grpo_icepop_loss(logp, old, inf, adv, mask, beta=float("inf"))
    l_tis, _ = truncated_is_loss(logp, old, inf, adv, mask, cap=float("inf"))
    np.testing.assert_allclose(float(l_ice), float(l_tis), rtol=1e-6)


def test_per_token_advantages_broadcast():
    logp, old, inf, adv, mask = make_batch(6)
    a = grpo_icepop_loss(logp, old, inf, adv, mask)[0]
    b = grpo_icepop_loss(logp, old, inf, np.repeat(adv[:, None], logp.shape[1], 1), mask)[0]
    assert float(a) == float(b)


def test_group_advantages_vs_numpy():
    rng = np.random.default_rng(0)
    r = rng.integers(0, 2, (5, 4)).astype(np.float32)
    r[0] = 1.0  # zero-variance groups
    r[1] = 0.0
    r[2] = [1, 0, 0, 0]
    r[3] = rng.normal(size=4)
    ref = np.zeros_like(r)
    for i in range(5):
        mu, sd = r[i].mean(), r[i].std()
        ref[i] = 0 if np.all(r[i] == r[i][0]) else (r[i] - mu) / (sd + 1e-6)
    out2 = np.asarray(jax.jit(group_advantages, static_argnums=1)(r, 4))
    out1 = np.asarray(group_advantages(r.reshape(-1), 4)).reshape(5, 4)
    np.testing.assert_allclose(out2, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out1, ref, rtol=1e-5, atol=1e-6)
    assert np.all(out2[0] == 0) and np.all(out2[1] == 0)
    # float values that are equal but whose mean rounds: still exactly zero, never NaN
    z = np.asarray(group_advantages(np.full((1, 3), 0.1, np.float32), 3))
    assert np.all(z == 0)
    with pytest.raises(ValueError):
        group_advantages(np.zeros(7), 4)
