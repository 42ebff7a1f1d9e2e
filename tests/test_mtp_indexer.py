"""The MTP layer's DSA indexer trains by the same KL as the trunk's indexers, in both DSA stages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from glm5_jax.config import ModelConfig
from glm5_jax.model import init_params
from glm5_jax.train import TrainConfig
from glm5_jax.train.step import make_loss_fn


def _batch(cfg, b=1, t=16):
    tok = jax.random.randint(jax.random.PRNGKey(0), (b, t), 0, cfg.vocab_size)
    return {"tokens": tok, "targets": jnp.roll(tok, -1, 1), "loss_mask": jnp.ones((b, t), jnp.float32),
            "segment_ids": jnp.ones((b, t), jnp.int32), "positions": jnp.broadcast_to(jnp.arange(t), (b, t))}


@pytest.mark.parametrize("stage,remat", [("dense", "none"), ("sparse", "full")])
def test_mtp_and_trunk_indexers_get_gradients(stage, remat):
    # index_topk 4 < T: the sparse stage really selects; remat="full" wraps the MTP block in nn.remat
    # (indexer_loss is its static argument)
    cfg = ModelConfig(num_layers=1, first_k_dense=1, index_topk=4, mtp_depth=1, num_experts=0, remat=remat)
    tc = TrainConfig(steps=1, batch_size=1, seq_len=16, indexer_loss=stage, mtp_weight=0.3)
    params = init_params(cfg, jax.random.PRNGKey(0))
    loss_fn = make_loss_fn(cfg, tc)
    grads, (metrics, _) = jax.jit(jax.grad(loss_fn, has_aux=True))(params, _batch(cfg))
    flat = traverse_util.flatten_dict(grads)
    idx = {"/".join(k): np.abs(np.asarray(v)).max() for k, v in flat.items() if "indexer" in k}
    mtp = {k: v for k, v in idx.items() if k.startswith("mtp_")}
    trunk = {k: v for k, v in idx.items() if not k.startswith("mtp_")}
    assert mtp and trunk
    # every indexer projection (wq_b, wk, weights_proj; k_norm) moves, in the MTP layer and the trunk
    for group in (mtp, trunk):
        for name in ("wq_b", "wk", "weights_proj"):
            assert any(name in k and v > 0 for k, v in group.items()), (stage, name, group)
    assert np.isfinite(float(metrics["indexer_kl"])) and float(metrics["indexer_kl"]) > 0
