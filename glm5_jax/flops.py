"""Parameter counts and training FLOPs per token of a model config, from the real parameter tree.

    from glm5_jax.flops import estimate, train_flops_per_token
    estimate(preset("glm5"), seq_len=4096)["active_params"]
    train_flops_per_token(cfg, seq_len)      # what MFU (glm5_jax.train.observe) divides by

Counts come from `jax.eval_shape` of the model's init (nothing is allocated), so they follow the
code, not a formula. Active parameters count every non-routed parameter in full (embedding table and
output head included) plus experts_per_tok of the routed experts in each MoE layer. The MTP layers
are counted apart (mtp_params, not in active_params). Their FLOPs are in train_flops_per_token: every
training token runs the MTP block (eh_proj, its decoder layer with experts_per_tok routed experts, and
the shared output head) once per depth (mtp_depth; GLM-5 shares one layer over 3 depths), and the MTP
loss is part of the training objective, so those FLOPs are model FLOPs (MaxText 0.2.5's
calculate_tflops_training_per_device counts its MTP layers likewise; it leaves out their output head,
which we count: the head runs once per depth). main_train_flops_per_token is the figure without MTP
(what this module reported before issue 42). `python -m tools.estimate` prints these.
"""

from __future__ import annotations

import math

from glm5_jax.config import ModelConfig


def _size(leaf) -> int:
    leaf = leaf.unbox() if hasattr(leaf, "unbox") else leaf
    return math.prod(leaf.shape)


def _routed(params: dict) -> int:
    return sum(_size(v) for p, v in params.items() if "experts" in p and "shared_experts" not in p)


def _active(config: ModelConfig, params: dict) -> int:
    """Parameters a token uses: all of `params` but the routed experts it is not sent to."""
    inactive = _routed(params) * (config.num_experts - config.experts_per_tok) // config.num_experts if config.num_experts else 0
    return sum(_size(v) for v in params.values()) - inactive


def estimate(config: ModelConfig, seq_len: int = 4096) -> dict:
    """Parameter counts and training FLOPs per token at `seq_len` (forward + backward)."""
    from flax import traverse_util

    from glm5_jax.model import abstract_params

    flat = traverse_util.flatten_dict(abstract_params(config))
    mtp = sum(_size(v) for p, v in flat.items() if p[0].startswith("mtp_"))
    main = {p: v for p, v in flat.items() if not p[0].startswith("mtp_")}
    total = sum(_size(v) for v in main.values())
    routed = _routed(main)
    n_moe = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    active = _active(config, main)
    embed = config.vocab_size * config.d_model
    matmul_active = active - embed            # the embedding lookup is not a matmul
    # Attention score + value FLOPs per token (forward): 2 * heads * (qk + v) * keys attended.
    avg_keys = (seq_len + 1) / 2
    keys = min(config.index_topk, avg_keys) if config.attention == "dsa" else avg_keys
    v_dim = config.v_head_dim if config.is_mla else config.head_dim
    attn_fwd = 2 * config.num_heads * (config.qk_head_dim + v_dim) * keys * config.num_layers
    index_fwd = (2 * config.index_n_heads * config.index_head_dim * avg_keys * sum(
        t == "full" for t in config.layer_indexer_types)) if config.attention == "dsa" else 0
    flops = 6 * matmul_active + 3 * attn_fwd + index_fwd
    mtp_flops = _mtp_flops(config, flat, attn_fwd, avg_keys)
    return {"total_params": total, "active_params": active,
            "mtp_params": mtp, "routed_expert_params": routed, "moe_layers": n_moe,
            "train_flops_per_token": float(flops + mtp_flops), "main_train_flops_per_token": float(flops),
            "mtp_train_flops_per_token": float(mtp_flops), "seq_len": seq_len,
            "attention_flops_per_token_fwd": float(attn_fwd), "indexer_flops_per_token_fwd": float(index_fwd)}


def _mtp_flops(config: ModelConfig, flat: dict, attn_fwd: float, avg_keys: float) -> float:
    """Training FLOPs a token spends in the MTP blocks: per depth 6 x (the block's active matmul params +
    the shared output head) + its attention (one layer's share of attn_fwd, x3) + its indexer scores."""
    if not config.mtp_depth:
        return 0.0
    blocks = {p[0] for p in flat if p[0].startswith("mtp_")}
    if not blocks:
        return 0.0
    mats = {p: v for p, v in flat.items() if p[0].startswith("mtp_") and len((v.unbox() if hasattr(v, "unbox") else v).shape) >= 2}
    active_per_depth = _active(config, mats) / len(blocks)        # mtp_share: one block run mtp_depth times; else one per depth
    head = config.vocab_size * config.d_model
    index = (2 * config.index_n_heads * config.index_head_dim * avg_keys
             if config.attention == "dsa" and any("indexer" in p for p in mats) else 0.0)
    per_depth = 6 * (active_per_depth + head) + 3 * attn_fwd / config.num_layers + index
    return float(config.mtp_depth * per_depth)


def train_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (6 x active matmul params + attention), as estimate() counts."""
    return estimate(config, seq_len)["train_flops_per_token"]


def relative_cost(steps: int, batch: int, seq_len: int) -> float:
    """A rough relative cost of `steps` training steps of [batch, seq_len] (tokens x (1 + seq_len / 1024): the
    attention term grows with the length), for weighting a program's phases (train.stages.PhaseProgress)."""
    return steps * batch * seq_len * (1.0 + seq_len / 1024.0)
