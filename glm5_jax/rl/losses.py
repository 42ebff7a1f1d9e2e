"""GRPO policy-gradient losses with train/inference mismatch correction (IcePop).

All losses share one signature::

    loss_fn(logp, old_logp, infer_logp, advantages, mask, **kwargs) -> (loss, metrics)

* ``logp``       [B, T]  log-probs of the sampled tokens under the policy being trained
                         (the only argument that carries gradient).
* ``old_logp``   [B, T]  log-probs under the training engine's copy of the behaviour
                         policy (the parameters that generated the rollout, recomputed by
                         the trainer).
* ``infer_logp`` [B, T]  log-probs reported by the inference engine that actually sampled
                         the tokens (differs from ``old_logp`` by numerics / kernels / MoE
                         routing).
* ``advantages`` [B] (per sequence) or [B, T] (per token).
* ``mask``       [B, T]  1 on completion tokens that are trained, 0 elsewhere (prompt,
                         padding).

Per-token objective (IcePop, the one used by GLM-5's RL stage)::

    rho = exp(old_logp - infer_logp)                       (stop-gradient)
    pop = rho  if 1/beta <= rho <= beta  else 0            (token is "popped": weight 0)
    r   = exp(logp - old_logp)
    j   = pop * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)

then a mean over each sequence's masked tokens (a row with no masked token contributes 0),
then a mean over the B sequences; ``loss = -objective``.

Masked positions are zeroed *before* any ``exp`` (``jnp.where``), so garbage values
(e.g. -inf log-probs on padding) never produce NaN values or NaN gradients.

Metrics (all over masked tokens only, 0 when there are none):

* ``pop_frac``    fraction of tokens whose correction weight was zeroed (IcePop: rho outside
                  [1/beta, beta]; TIS: rho > cap, i.e. truncated; none: always 0).
* ``clip_frac``   fraction of tokens where the PPO clip is active, i.e. the clipped branch is
                  strictly smaller than the unclipped one (r > 1+eps_high with A > 0, or
                  r < 1-eps_low with A < 0).
* ``mismatch_kl`` k3 estimate of KL(pi_infer || pi_old): mean of ``rho - 1 - log rho``.
                  Tokens are sampled from the inference engine, so with log-ratio
                  ``log(pi_old/pi_infer) = log rho`` the k3 estimator is unbiased for
                  KL(pi_infer || pi_old) and always >= 0.
* ``mismatch_abs_logratio`` mean |old_logp - infer_logp|.
* ``ratio_mean``  mean of r = exp(logp - old_logp).
* ``rho_mean``    mean of rho.
* ``weight_mean`` mean of the correction weight actually applied.
* ``tokens``      number of masked tokens.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import jax
import jax.numpy as jnp

from glm5_jax.agentic.loss import agentic_loss

Array = jax.Array
Metrics = Dict[str, Array]

__all__ = [
    "grpo_icepop_loss",
    "truncated_is_loss",
    "no_correction_loss",
    "group_advantages",
    "LOSSES",
    "get_loss",
]


def _prepare(logp, old_logp, infer_logp, advantages, mask):
    logp = jnp.asarray(logp)
    dtype = jnp.promote_types(logp.dtype, jnp.float32)
    logp = logp.astype(dtype)
    old_logp = jax.lax.stop_gradient(jnp.asarray(old_logp, dtype))
    infer_logp = jax.lax.stop_gradient(jnp.asarray(infer_logp, dtype))
    adv = jax.lax.stop_gradient(jnp.asarray(advantages, dtype))
    if adv.ndim == 1:
        adv = adv[:, None]
    adv = jnp.broadcast_to(adv, logp.shape)
    m = jnp.asarray(mask).astype(bool)
    zero = jnp.zeros((), dtype)
    # Zero every log-ratio on masked positions before exponentiating (no inf/NaN leaks).
    log_r = jnp.where(m, logp - old_logp, zero)
    log_rho = jnp.where(m, old_logp - infer_logp, zero)
    adv = jnp.where(m, adv, zero)
    return log_r, log_rho, adv, m, dtype


def _masked_mean_all(x, m):
    mf = m.astype(x.dtype)
    return jnp.sum(x * mf) / jnp.maximum(jnp.sum(mf), 1.0)


def _clipped_pg(weight, weight_zeroed, log_r, log_rho, adv, m, dtype, eps_low, eps_high):
    """Shared body: weight (stop-gradient) * PPO clipped surrogate, seq-mean then batch-mean."""
    weight = jax.lax.stop_gradient(weight)
    r = jnp.exp(log_r)
    surr1 = r * adv
    surr2 = jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_tok = weight * jnp.minimum(surr1, surr2)
    mf = m.astype(dtype)
    per_tok = per_tok * mf
    count = jnp.sum(mf, axis=-1)
    seq_obj = jnp.sum(per_tok, axis=-1) / jnp.maximum(count, 1.0)
    objective = jnp.mean(seq_obj)
    loss = -objective

    rho = jnp.exp(log_rho)
    clipped = ((r > 1.0 + eps_high) & (adv > 0)) | ((r < 1.0 - eps_low) & (adv < 0))
    sg = jax.lax.stop_gradient
    metrics = {
        "pop_frac": _masked_mean_all(weight_zeroed.astype(dtype), m),
        "clip_frac": _masked_mean_all(sg(clipped).astype(dtype), m),
        "mismatch_kl": _masked_mean_all(rho - 1.0 - log_rho, m),
        "mismatch_abs_logratio": _masked_mean_all(jnp.abs(log_rho), m),
        "ratio_mean": _masked_mean_all(sg(r), m),
        "rho_mean": _masked_mean_all(rho, m),
        "weight_mean": _masked_mean_all(weight, m),
        "tokens": jnp.sum(mf),
    }
    return loss, metrics


def grpo_icepop_loss(
    logp,
    old_logp,
    infer_logp,
    advantages,
    mask,
    *,
    beta: float = 2.0,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> Tuple[Array, Metrics]:
    """IcePop GRPO loss: tokens with train/infer ratio outside [1/beta, beta] get weight 0."""
    log_r, log_rho, adv, m, dtype = _prepare(logp, old_logp, infer_logp, advantages, mask)
    rho = jnp.exp(log_rho)
    inside = (rho >= 1.0 / beta) & (rho <= beta)
    weight = jnp.where(inside, rho, jnp.zeros((), dtype))
    return _clipped_pg(weight, ~inside, log_r, log_rho, adv, m, dtype, eps_low, eps_high)


def truncated_is_loss(
    logp,
    old_logp,
    infer_logp,
    advantages,
    mask,
    *,
    cap: float = 2.0,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> Tuple[Array, Metrics]:
    """Token-level truncated importance sampling: weight min(rho, cap) (stop-gradient).

    ``pop_frac`` reports the fraction of tokens whose weight was truncated (rho > cap).
    """
    log_r, log_rho, adv, m, dtype = _prepare(logp, old_logp, infer_logp, advantages, mask)
    rho = jnp.exp(log_rho)
    weight = jnp.minimum(rho, cap)
    return _clipped_pg(weight, rho > cap, log_r, log_rho, adv, m, dtype, eps_low, eps_high)


def no_correction_loss(
    logp,
    old_logp,
    infer_logp,
    advantages,
    mask,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> Tuple[Array, Metrics]:
    """Plain GRPO clipped objective; ``infer_logp`` only feeds the mismatch metrics."""
    log_r, log_rho, adv, m, dtype = _prepare(logp, old_logp, infer_logp, advantages, mask)
    weight = jnp.ones_like(log_r)
    return _clipped_pg(
        weight, jnp.zeros_like(m), log_r, log_rho, adv, m, dtype, eps_low, eps_high
    )


LOSSES: Dict[str, Callable[..., Tuple[Array, Metrics]]] = {
    "icepop": grpo_icepop_loss,
    "tis": truncated_is_loss,
    "none": no_correction_loss,
    "agentic": agentic_loss,     # asynchronous agentic RL: double-sided mask on the rollout ratio
}


def get_loss(name: str) -> Callable[..., Tuple[Array, Metrics]]:
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown RL loss {name!r}; choose from {sorted(LOSSES)}") from None


def group_advantages(rewards, group_size: int, eps: float = 1e-6) -> Array:
    """GRPO group-normalised advantages.

    ``rewards`` is [N * G] (consecutive blocks of ``group_size`` samples share a prompt) or
    [N, G]; the result has the same shape. A = (R - mean_g) / (std_g + eps) with the
    population std (ddof = 0). A group whose rewards are all equal gets exactly zero
    advantages (decided by max == min, so float round-off in the mean cannot leak through).
    ``group_size`` must be a Python int (static under jit).
    """
    r = jnp.asarray(rewards)
    r = r.astype(jnp.promote_types(r.dtype, jnp.float32))
    shape = r.shape
    if r.ndim == 1:
        if shape[0] % group_size:
            raise ValueError(f"{shape[0]} rewards not divisible by group_size={group_size}")
        g = r.reshape(-1, group_size)
    elif r.ndim == 2:
        if shape[1] != group_size:
            raise ValueError(f"rewards shape {shape} does not match group_size={group_size}")
        g = r
    else:
        raise ValueError(f"rewards must be 1-D or 2-D, got shape {shape}")
    mean = jnp.mean(g, axis=1, keepdims=True)
    std = jnp.std(g, axis=1, keepdims=True)
    flat = jnp.max(g, axis=1, keepdims=True) == jnp.min(g, axis=1, keepdims=True)
    adv = jnp.where(flat, 0.0, (g - mean) / (std + eps))
    return adv.reshape(shape)
