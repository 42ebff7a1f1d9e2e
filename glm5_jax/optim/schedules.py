"""Learning-rate schedules, assembled from optax's (`linear_schedule`, `cosine_decay_schedule`,
`join_schedules`); the docstrings give each one's closed form, which tests/test_schedules.py checks.

The values equal the closed forms to float32 rounding, not bit for bit: optax evaluates the linear
warm-up as `(init - end) * (1 - count / T) + end` and the cosine as `cos(pi * count / T)`, where the
project's own versions (before issue 60) computed `peak * (s + 1) / w` and `cos(pi * progress)`.
"""
from __future__ import annotations

from typing import Optional

import optax

LR_SCHEDULES = ("cosine", "wsd")


def _warmup(peak: float, w: int) -> optax.Schedule:
    """peak * (s + 1) / w for s < w (the first update is non-zero, the w-th is at the peak); peak when w <= 1."""
    if w <= 1:
        return optax.constant_schedule(peak)
    return optax.linear_schedule(peak / w, peak, w - 1)


def warmup_cosine(peak_lr: float, warmup_steps: int = 0, total_steps: Optional[int] = None,
                  min_lr_ratio: float = 0.1) -> optax.Schedule:
    """Linear warmup then cosine decay to ``peak_lr * min_lr_ratio`` at ``total_steps``.

    step s (0-based count of updates already applied):
      s <  warmup_steps : peak * (s + 1) / warmup_steps     (first update is non-zero)
      s >= warmup_steps : peak * (r + (1 - r) * 0.5 * (1 + cos(pi * progress))),
                          progress = (s - warmup) / (total - warmup) clipped to [0, 1]
    ``total_steps=None`` keeps the peak after warmup.
    """
    peak, w, r = float(peak_lr), int(warmup_steps), float(min_lr_ratio)
    if total_steps is not None and total_steps < w:
        raise ValueError(f"total_steps {total_steps} < warmup_steps {w}")
    after = (optax.constant_schedule(peak) if total_steps is None
             else optax.cosine_decay_schedule(peak, max(int(total_steps) - w, 1), alpha=r))
    return optax.join_schedules([_warmup(peak, w), after], [w])


def warmup_stable_decay(peak_lr: float, warmup_steps: int = 0, total_steps: int = 1,
                        decay_fraction: float = 0.2, min_lr_ratio: float = 0.1) -> optax.Schedule:
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
    peak, w, r, total = float(peak_lr), int(warmup_steps), float(min_lr_ratio), int(total_steps)
    if not 0.0 <= float(decay_fraction) <= 1.0:
        raise ValueError(f"decay_fraction {decay_fraction} is invalid: must be in [0, 1]")
    if total < w:
        raise ValueError(f"total_steps {total} < warmup_steps {w}")
    d0 = max(total - int(round(float(decay_fraction) * total)), w)
    span = total - d0
    hold = optax.constant_schedule(peak)
    if span <= 0:
        return optax.join_schedules([_warmup(peak, w), hold], [w])
    # from d0 on: step d0 is already one decay step in (progress 1 / span), the last (total - 1) at r * peak
    decay = optax.linear_schedule(peak * (1.0 - (1.0 - r) / span), peak * r, span - 1) if span > 1 \
        else optax.constant_schedule(peak * r)
    return optax.join_schedules([_warmup(peak, w), hold, decay], [w, d0])


def lr_schedule(kind: str, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1,
                decay_fraction: float = 0.2) -> optax.Schedule:
    """The schedule named `kind`: "cosine" (warmup_cosine) or "wsd" (warmup_stable_decay)."""
    if kind == "cosine":
        return warmup_cosine(peak_lr, warmup_steps, total_steps, min_lr_ratio)
    if kind == "wsd":
        return warmup_stable_decay(peak_lr, warmup_steps, total_steps, decay_fraction, min_lr_ratio)
    raise ValueError(f"lr schedule {kind!r} is invalid; allowed: {', '.join(LR_SCHEDULES)}")
