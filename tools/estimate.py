"""Parameter counts and training FLOPs per token of a preset, from the real parameter tree.

    python -m tools.estimate --preset=glm5 [--seq_len=4096] [--json]

Counts come from `jax.eval_shape` of the model's init (nothing is allocated), so they follow the
code, not a formula. Active parameters count every non-routed parameter in full (embedding table and
output head included) plus experts_per_tok of the routed experts in each MoE layer.
"""

from __future__ import annotations

import json
import math

from absl import app, flags

from glm5_jax.config import ModelConfig, preset

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Define this CLI's flags (only when run as a program, so modules import side-effect free)."""
    flags.DEFINE_string("preset", "tiny", "Model preset: tiny | small | glm5.")
    flags.DEFINE_integer("seq_len", 4096, "Training sequence length for the attention FLOPs.")
    flags.DEFINE_bool("json", False, "Print JSON instead of a table.")


def _size(leaf) -> int:
    leaf = leaf.unbox() if hasattr(leaf, "unbox") else leaf
    return math.prod(leaf.shape)


def estimate(config: ModelConfig, seq_len: int = 4096) -> dict:
    from flax import traverse_util

    from glm5_jax.model import abstract_params

    flat = traverse_util.flatten_dict(abstract_params(config))
    mtp = sum(_size(v) for p, v in flat.items() if p[0].startswith("mtp_"))
    main = {p: v for p, v in flat.items() if not p[0].startswith("mtp_")}
    total = sum(_size(v) for v in main.values())
    routed = sum(_size(v) for p, v in main.items() if "experts" in p and "shared_experts" not in p)
    n_moe = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    active = total - (routed * (config.num_experts - config.experts_per_tok) // config.num_experts if config.num_experts else 0)
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
    return {"total_params": total, "active_params": active,
            "mtp_params": mtp, "routed_expert_params": routed, "moe_layers": n_moe,
            "train_flops_per_token": float(flops), "seq_len": seq_len,
            "attention_flops_per_token_fwd": float(attn_fwd), "indexer_flops_per_token_fwd": float(index_fwd)}


def main(argv):
    del argv
    r = estimate(preset(FLAGS.preset), FLAGS.seq_len)
    r["preset"] = FLAGS.preset
    if FLAGS.json:
        print(json.dumps(r))
        return
    print(f"preset {FLAGS.preset}: total {r['total_params']:,} ({r['total_params'] / 1e9:.2f}B) parameters without MTP, "
          f"active {r['active_params']:,} ({r['active_params'] / 1e9:.2f}B) per token")
    print(f"  MTP layer(s): {r['mtp_params']:,} ({r['mtp_params'] / 1e9:.2f}B), reported apart")
    print(f"  training FLOPs per token at seq_len {r['seq_len']}: {r['train_flops_per_token']:.3e} "
          f"(attention fwd {r['attention_flops_per_token_fwd']:.3e}, indexer fwd {r['indexer_flops_per_token_fwd']:.3e})")


if __name__ == "__main__":
    define_flags()
    app.run(main)
