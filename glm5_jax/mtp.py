"""Multi-token prediction (MTP), all of it: the shifted inputs and targets of each depth, the MTP loss,
and the MTP block. The model (glm5_jax.model) runs the blocks; the train step (glm5_jax.train.step)
builds the batch's shifted leaves (`mtp_batch`, before the context layout) and scores them.

Depth k (1-based) at position i reads the token k steps ahead (`shift_left(tokens, k)`) and predicts
token i + k + 1 (`mtp_targets`: the targets shifted left by k, masked where that target leaves the
document or the window).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from glm5_jax.config import ModelConfig
from glm5_jax.layers.common import Dense, RMSNorm, dtype_of
from glm5_jax.layers.decoder import DecoderLayer
from glm5_jax.losses import cross_entropy


def shift_left(x, k: int, fill=0):
    """x [B, T] -> x[:, k:] padded with `fill` on the right (the token k steps ahead)."""
    return jnp.concatenate([x[:, k:], jnp.full((x.shape[0], k), fill, x.dtype)], axis=1) if k else x


def mtp_targets(targets, mask, segment_ids, depth: int):
    """Targets and mask for MTP depth k (1-based): position i predicts token i + k + 1, i.e.
    `targets` shifted left by k; positions whose target leaves the document (or the window) are masked."""
    t = shift_left(targets, depth)
    m = shift_left(mask, depth) * mask
    if segment_ids is not None:
        m = m * (shift_left(segment_ids, depth) == segment_ids)
    return t, m


def mtp_batch(batch: dict, depth: int) -> dict:
    """`batch` ({tokens, targets, loss_mask, segment_ids, ...}, [B, T], natural order) plus what each MTP
    depth k needs from k tokens ahead: "mtp_tokens" [depth, B, T] (the input token k steps ahead) and
    "mtp_targets" / "mtp_mask" [depth, B, T] (mtp_targets). Built before the context layout
    (glm5_jax.attention.context.layout_batch), where shifting the permuted sequence would be wrong."""
    out = dict(batch)
    seg = batch.get("segment_ids")
    tm = [mtp_targets(batch["targets"], batch["loss_mask"], seg, k) for k in range(1, depth + 1)]
    out["mtp_tokens"] = jnp.stack([shift_left(batch["tokens"], k) for k in range(1, depth + 1)])
    out["mtp_targets"] = jnp.stack([a for a, _ in tm])
    out["mtp_mask"] = jnp.stack([m for _, m in tm]).astype(batch["loss_mask"].dtype)
    return out


def mtp_depth_targets(targets, mask, segment_ids, k: int, shifted=None):
    """(targets, mask) of the k-th MTP depth (0-based): `shifted`'s [k] when the caller built them
    (context parallelism: mtp_batch), else mtp_targets(..., k + 1)."""
    return mtp_targets(targets, mask, segment_ids, k + 1) if shifted is None else (shifted[0][k], shifted[1][k])


def mtp_loss(mtp_logits, targets, mask, segment_ids=None, shifted=None):
    """Mean over depths of the masked cross-entropy; mtp_logits [depth, B, T, V]. shifted: the
    per-depth (targets, mask) [depth, B, T] already built (context parallelism: mtp_batch), instead of
    mtp_targets here."""
    losses = []
    for k in range(mtp_logits.shape[0]):
        t, m = mtp_depth_targets(targets, mask, segment_ids, k, shifted)
        losses.append(cross_entropy(mtp_logits[k], t, m)[1])
    return jnp.mean(jnp.stack(losses)), losses


class MTPBlock(nn.Module):
    """h' = eh_proj([RMSNorm(embed(next token)) ; RMSNorm(h_prev)]) -> decoder layer -> RMSNorm.

    The concatenation order (embedding first) follows the released DeepSeek-V3-style checkpoints.
    """
    cfg: ModelConfig

    @nn.compact
    def __call__(self, h_prev, emb, cos, sin, segment_ids=None, indexer_loss=None, *, positions=None, cache=None,
                 write_positions=None):
        """-> (h [B, T, D], final-normed h, new cache or None). indexer_loss as GLM5: the MTP layer's DSA
        indexer learns from the same KL as the trunk's (sown at mtp_<k>/layer/attn/indexer_kl)."""
        c = self.cfg
        pdt, dt = dtype_of(c.param_dtype), dtype_of(c.dtype)
        e = RMSNorm(c.rms_norm_eps, pdt, name="enorm")(emb)
        hp = RMSNorm(c.rms_norm_eps, pdt, name="hnorm")(h_prev)
        h = Dense(c.d_model, ("mtp_in", "embed"), c.initializer_range, dt, pdt, name="eh_proj")(
            jnp.concatenate([e, hp], axis=-1))
        idx_type = "full" if c.attention == "dsa" else None
        h, _, cache = DecoderLayer(c, c.num_experts > 0, idx_type, name="layer")(
            h, cos, sin, segment_ids, None, indexer_loss, positions=positions, cache=cache,
            write_positions=write_positions)
        return h, RMSNorm(c.rms_norm_eps, pdt, name="final_norm")(h), cache


__all__ = ["MTPBlock", "mtp_batch", "mtp_depth_targets", "mtp_loss", "mtp_targets", "shift_left"]
