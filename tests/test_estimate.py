"""tools.estimate against a hand count (tiny) and the reference model's 743.9B (glm5)."""

import json
import subprocess
import sys

from glm5_jax.config import preset
from tools.estimate import estimate


def hand_count(c):
    d, h = c.d_model, c.num_heads
    attn = (d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * (c.qk_nope_head_dim + c.qk_rope_head_dim)
            + d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
            + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) + h * c.v_head_dim * d)
    indexer = c.q_lora_rank * c.index_n_heads * c.index_head_dim + d * c.index_head_dim + 2 * c.index_head_dim + d * c.index_n_heads
    dense = 3 * d * c.ffn_dim
    moe = d * c.num_experts + c.num_experts + 3 * c.num_experts * d * c.moe_ffn_dim + 3 * d * c.moe_ffn_dim * c.num_shared_experts
    layers = sum(attn + indexer + 2 * d + (moe if c.is_moe_layer(i) else dense) for i in range(c.num_layers))
    return 2 * c.vocab_size * d + d + layers


def test_tiny_counts_match_hand_count():
    c = preset("tiny")
    r = estimate(c)
    assert r["total_params"] == hand_count(c)
    per_expert = 3 * c.d_model * c.moe_ffn_dim
    n_moe = c.num_layers - c.first_k_dense
    assert r["active_params"] == hand_count(c) - n_moe * (c.num_experts - c.experts_per_tok) * per_expert


def test_glm5_total_matches_reference_count_cli():
    out = subprocess.run([sys.executable, "-m", "tools.estimate", "--preset=glm5", "--json"],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    reference = 743_911_199_232          # transformers GlmMoeDsaForCausalLM on the meta device, no MTP
    assert abs(r["total_params"] - reference) / reference < 1e-3
    assert 39e9 < r["active_params"] < 43e9 and r["mtp_params"] > 0
    assert r["train_flops_per_token"] > 6 * 39e9


def test_mtp_flops_are_each_depths_block_and_head_by_hand():
    """train_flops_per_token = the main model's + mtp_depth x (6 x (the MTP block's active matmul params:
    eh_proj, its MLA + indexer matrices, router, shared and top-k routed experts; + the output head) +
    one layer's attention x 3 + its indexer scores), counted by hand for the tiny preset at 3 shared
    depths (GLM-5's MTP), and 0 extra without MTP."""
    import dataclasses
    c = dataclasses.replace(preset("tiny"), mtp_depth=3, mtp_share=True)
    seq = 64
    r = estimate(c, seq)
    d, h = c.d_model, c.num_heads
    attn_mats = (d * c.q_lora_rank + c.q_lora_rank * h * (c.qk_nope_head_dim + c.qk_rope_head_dim)
                 + d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
                 + h * c.v_head_dim * d)
    indexer_mats = c.q_lora_rank * c.index_n_heads * c.index_head_dim + d * c.index_head_dim + d * c.index_n_heads
    moe_active = d * c.num_experts + 3 * (c.experts_per_tok + c.num_shared_experts) * d * c.moe_ffn_dim
    block = 2 * d * d + attn_mats + indexer_mats + moe_active
    avg_keys = (seq + 1) / 2
    attn_layer = 2 * h * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * min(c.index_topk, avg_keys)
    index = 2 * c.index_n_heads * c.index_head_dim * avg_keys
    want = 3 * (6 * (block + c.vocab_size * d) + 3 * attn_layer + index)
    assert c.attention == "dsa" and c.is_moe_layer(c.num_layers - 1)
    assert abs(r["mtp_train_flops_per_token"] - want) <= 1e-9 * want, (r["mtp_train_flops_per_token"], want)
    assert r["train_flops_per_token"] == r["main_train_flops_per_token"] + r["mtp_train_flops_per_token"]
    none = estimate(dataclasses.replace(c, mtp_depth=0), seq)
    assert none["mtp_train_flops_per_token"] == 0 and none["train_flops_per_token"] == none["main_train_flops_per_token"]
    assert none["main_train_flops_per_token"] == r["main_train_flops_per_token"]
