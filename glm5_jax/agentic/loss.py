"""The agentic RL loss of the GLM-5 report (asynchronous RL, GLM5_SPEC.md section 3).

It uses the rollout engine's log-probs directly (no recomputed "old" policy: with asynchronous
rollouts the behaviour policy is a mix of versions the trainer no longer holds)::

    r_t  = exp(logp_theta - logp_rollout)                         (stop-gradient)
    f(r) = r  if 1 - eps_low < r < 1 + eps_high  else 0            (double-sided: token masked)
    loss = -mean_b (1/|y_b|) sum_t f(r_t) * A_b * logp_theta_t

The gradient is f(r) A grad logp = A grad r inside the band: the importance-weighted policy gradient,
with tokens whose ratio left the band dropped entirely (no clipped constant, no gradient). ``mask`` is
1 only on policy-generated tokens, so prompt and tool/observation tokens never enter. Same signature
as ``glm5_jax.rl.losses`` (``old_logp`` is accepted and ignored), so it plugs into the one train
step. It is not an IcePop mode: IcePop's ratio is train-old vs inference with a PPO clip on top.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["agentic_loss", "group_centered_advantages"]


def agentic_loss(logp, old_logp, infer_logp, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.28):
    del old_logp
    logp = jnp.asarray(logp, jnp.float32)
    m = jnp.asarray(mask).astype(bool)
    sg = jax.lax.stop_gradient
    infer = sg(jnp.asarray(infer_logp, jnp.float32))
    adv = sg(jnp.asarray(advantages, jnp.float32))
    if adv.ndim == 1:
        adv = adv[:, None]
    adv = jnp.broadcast_to(adv, logp.shape)
    # zero the log-ratio on masked positions before exp: padding log-probs never produce inf/NaN
    log_r = jnp.where(m, sg(logp) - infer, 0.0)
    r = jnp.exp(log_r)
    inside = (r > 1.0 - eps_low) & (r < 1.0 + eps_high) & m
    f = jnp.where(inside, r, 0.0)
    per_tok = jnp.where(m, f * adv * jnp.where(m, logp, 0.0), 0.0)
    mf = m.astype(jnp.float32)
    count = jnp.sum(mf, axis=-1)
    loss = -jnp.mean(jnp.sum(per_tok, axis=-1) / jnp.maximum(count, 1.0))
    total = jnp.maximum(jnp.sum(mf), 1.0)
    metrics = {"masked_frac": jnp.sum(mf * (~inside)) / total, "ratio_mean": jnp.sum(r * mf) / total,
               "abs_logratio": jnp.sum(jnp.abs(log_r)) / total, "tokens": jnp.sum(mf)}
    return loss, metrics


def group_centered_advantages(rewards, group_size: int):
    """A = R - mean over the group (the report's agentic advantage; no std normalisation).
    ``rewards`` [N * G] with consecutive groups -> [N * G]."""
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 1 or r.shape[0] % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries; got {r.shape}")
    g = r.reshape(-1, group_size)
    return (g - g.mean(axis=1, keepdims=True)).reshape(-1)
