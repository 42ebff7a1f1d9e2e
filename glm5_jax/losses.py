"""Language-model losses: masked cross-entropy with optional z-loss (the MTP loss, built on it: glm5_jax.mtp)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.layers.common import constrain


@jax.custom_vjp
def token_logsumexp_and_target(logits, targets):
    """logits [..., V] float32, targets [...] int -> (logsumexp [...], logits at the target [...]).

    A custom VJP so that neither the forward nor the backward writes more than one [..., V] array:
    the forward keeps only (logits, lse) as residuals (autodiff of logsumexp also keeps
    exp(logits - max), and the gather's transpose is a scatter-add into a zeroed [..., V] buffer);
    the backward writes d logits = g_lse * softmax + g_tgt * onehot(target) in one elementwise
    pass. At the LM head of tools.bench_vs_hf ([4096, 8192] float32) every extra such array is
    ~0.1 s of CPU time, mostly page faults on fresh memory."""
    return _lse_and_target(logits, targets)


def _lse_and_target(logits, targets):
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lse, tgt


def _lse_and_target_fwd(logits, targets):
    lse, tgt = _lse_and_target(logits, targets)
    return (lse, tgt), (logits, targets, lse)


def _lse_and_target_bwd(res, g):
    logits, targets, lse = res
    g_lse, g_tgt = g
    onehot = jnp.arange(logits.shape[-1], dtype=jnp.int32) == targets[..., None].astype(jnp.int32)
    d = g_lse[..., None] * jnp.exp(logits - lse[..., None]) + jnp.where(onehot, g_tgt[..., None], 0.0)
    # targets are integers: their cotangent is float0 zeros (what jax's own integer inputs get)
    return d.astype(logits.dtype), np.zeros(targets.shape, jax.dtypes.float0)


token_logsumexp_and_target.defvjp(_lse_and_target_fwd, _lse_and_target_bwd)


def cross_entropy(logits, targets, mask, *, z_loss: float = 0.0):
    """Mean masked token cross-entropy. logits [..., V] float32, targets/mask [...].

    Returns (loss, ce) where loss adds z_loss * mean(logsumexp^2) (PaLM-style logit drift penalty).
    """
    lse, tgt = token_logsumexp_and_target(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(mask), 1.0)
    ce = jnp.sum((lse - tgt) * mask) / denom
    loss = ce + (z_loss * jnp.sum(jnp.square(lse) * mask) / denom if z_loss else 0.0)
    return loss, ce


def chunked_cross_entropy(head, hidden, targets, mask, *, chunk: int, shards: int = 1):
    """Per group g: (ce_g, z_g) = the masked token means of (logsumexp - target logit) and logsumexp^2 of
    head(hidden[g]), without ever holding a whole [B, T, V] logits array.

    head: [..., D] -> float32 logits [..., V]; hidden [G, B, T, D] (e.g. the main head's and each MTP
    depth's final hidden states); targets / mask [G, B, T]. Each of the `shards` sequence shards (the
    `context` axis: [B, T] -> [B, shards, T/shards] keeps every device's tokens on its own shard) is cut
    into chunks of <= `chunk` tokens; one lax.scan walks every (group, chunk), computing that chunk's
    logits, log-sum-exp and target logit, and jax.checkpoint makes the backward recompute them chunk
    by chunk, so one [B, shards, chunk, V] logits block (and its gradient) lives at once and the head
    weight's gradient is accumulated once for all groups. Same sums as cross_entropy, in another order.
    """
    g, b, t, d = hidden.shape
    if t % shards:
        raise ValueError(f"sequence length {t} is not divisible by {shards} shards")
    tl = t // shards
    c = max(x for x in range(1, min(chunk, tl) + 1) if tl % x == 0)
    m = tl // c

    def split(x):   # [G, B, T, ..] -> [G*m, B, shards, c, ..] (group-major)
        x = x.reshape(g, b, shards, m, c, *x.shape[3:])
        return jnp.moveaxis(x, 3, 1).reshape(g * m, b, shards, c, *x.shape[5:])

    act = ("activation_batch", "activation_seq", None)

    @jax.checkpoint
    def body(acc, xs):
        i, h, tg, mk = xs
        h = constrain(h, act + ("activation_embed",))
        lse, tgt = token_logsumexp_and_target(head(h).astype(jnp.float32), tg)
        mk = mk.astype(jnp.float32)
        return acc.at[i // m].add(jnp.stack([jnp.sum((lse - tgt) * mk), jnp.sum(jnp.square(lse) * mk)])), None

    sums, _ = jax.lax.scan(body, jnp.zeros((g, 2), jnp.float32),
                           (jnp.arange(g * m), split(hidden), split(targets), split(mask)))
    denom = jnp.maximum(jnp.sum(mask.astype(jnp.float32), axis=(1, 2)), 1.0)
    return sums[:, 0] / denom, sums[:, 1] / denom
