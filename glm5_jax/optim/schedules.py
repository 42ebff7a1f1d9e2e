"""Learning-rate schedules."""
from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp


def warmup_cosine(peak_lr: float, warmup_steps: int = 0, total_steps: Optional[int] = None,
                  min_lr_ratio: float = 0.1):
    """Linear warmup then cosine decay to ``peak_lr * min_lr_ratio`` at ``total_steps``.

    step s (0-based count of updates already applied):
      s <  warmup_steps : peak * (s + 1) / warmup_steps     (first update is non-zero)
      s >= warmup_steps : peak * (r + (1 - r) * 0.5 * (1 + cos(pi * progress))),
                          progress = (s - warmup) / (total - warmup) clipped to [0, 1]
    ``total_steps=None`` keeps the peak after warmup.
    """
    peak = float(peak_lr)
    w = int(warmup_steps)
    r = float(min_lr_ratio)
    if total_steps is not None and total_steps < w:
        raise ValueError(f"total_steps {total_steps} < warmup_steps {w}")

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum((s + 1.0) / max(w, 1), 1.0) if w > 0 else jnp.full_like(s, peak)
        if total_steps is None:
            return warm
        span = max(int(total_steps) - w, 1)
        prog = jnp.clip((s - w) / span, 0.0, 1.0)
        decay = peak * (r + (1.0 - r) * 0.5 * (1.0 + jnp.cos(math.pi * prog)))
        return jnp.where(s < w, warm, decay)

    return schedule


LR_SCHEDULES = ("cosine", "wsd")


def warmup_stable_decay(peak_lr: float, warmup_steps: int = 0, total_steps: int = 1,
                        decay_fraction: float = 0.2, min_lr_ratio: float = 0.1):
    """Warmup-stable-decay (WSD): linear warmup, the peak held, then a linear decay to
    ``peak_lr * min_lr_ratio`` over the last ``decay_steps = round(decay_fraction * total_steps)`` steps.

    step s (0-based count of updates already applied), D = decay_steps, d0 = max(total - D, warmup):
      s <  warmup_steps : peak * (s + 1) / warmup_steps     (as warmup_cosine)
      s <  d0           : peak
      s >= d0           : peak * (1 - (1 - r) * progress),  progress = (s + 1 - d0) / (total - d0) clipped to [0, 1]
    so each of the decay steps is below the peak and the last update (s = total - 1) is at the minimum.
    decay_fraction 0 keeps the peak after warmup (a stage that an annealing stage continues); 1 decays
    from the end of warmup (an annealing stage of its own).
    """
    peak = float(peak_lr)
    w = int(warmup_steps)
    r = float(min_lr_ratio)
    total = int(total_steps)
    if not 0.0 <= float(decay_fraction) <= 1.0:
        raise ValueError(f"decay_fraction {decay_fraction} is invalid: must be in [0, 1]")
    if total < w:
        raise ValueError(f"total_steps {total} < warmup_steps {w}")
    d0 = max(total - int(round(float(decay_fraction) * total)), w)
    span = max(total - d0, 1)

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum((s + 1.0) / max(w, 1), 1.0) if w > 0 else jnp.full_like(s, peak)
        if d0 >= total:
            return warm
        prog = jnp.clip((s + 1.0 - d0) / span, 0.0, 1.0)
        return jnp.where(s < w, warm, peak * (1.0 - (1.0 - r) * prog))

    return schedule


def lr_schedule(kind: str, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1,
                decay_fraction: float = 0.2):
    """The schedule named `kind`: "cosine" (warmup_cosine) or "wsd" (warmup_stable_decay)."""
    if kind == "cosine":
        return warmup_cosine(peak_lr, warmup_steps, total_steps, min_lr_ratio)
    if kind == "wsd":
        return warmup_stable_decay(peak_lr, warmup_steps, total_steps, decay_fraction, min_lr_ratio)
    raise ValueError(f"lr schedule {kind!r} is invalid; allowed: {', '.join(LR_SCHEDULES)}")
