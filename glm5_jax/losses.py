"""Language-model losses: masked cross-entropy with optional z-loss, and the MTP loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits, targets, mask, *, z_loss: float = 0.0):
    """Mean masked token cross-entropy. logits [..., V] float32, targets/mask [...].

    Returns (loss, ce) where loss adds z_loss * mean(logsumexp^2) (PaLM-style logit drift penalty).
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(mask), 1.0)
    ce = jnp.sum((lse - tgt) * mask) / denom
    loss = ce + (z_loss * jnp.sum(jnp.square(lse) * mask) / denom if z_loss else 0.0)
    return loss, ce


def mtp_targets(targets, mask, segment_ids, depth: int):
    """Targets and mask for MTP depth k (1-based): position i predicts token i + k + 1, i.e.
    `targets` shifted left by k; positions whose target leaves the document (or the window) are masked."""
    from glm5_jax.model import shift_left
    t = shift_left(targets, depth)
    m = shift_left(mask, depth) * mask
    if segment_ids is not None:
        m = m * (shift_left(segment_ids, depth) == segment_ids)
    return t, m


def mtp_loss(mtp_logits, targets, mask, segment_ids=None):
    """Mean over depths of the masked cross-entropy; mtp_logits [depth, B, T, V]."""
    losses = []
    for k in range(mtp_logits.shape[0]):
        t, m = mtp_targets(targets, mask, segment_ids, k + 1)
        losses.append(cross_entropy(mtp_logits[k], t, m)[1])
    return jnp.mean(jnp.stack(losses)), losses
