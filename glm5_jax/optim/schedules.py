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
