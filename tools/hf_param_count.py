"""Reference parameter count of the HF ``GlmMoeDsaForCausalLM`` at the GLM-5 defaults.

Usage::

    python -m tools.hf_param_count [--json]

Instantiates ``GlmMoeDsaConfig()`` (defaults = zai-org/GLM-5: 78 layers, d=6144, 256 routed
experts, top-8, 1 shared expert, vocab 154880, untied embeddings) on the ``meta`` device (no
memory is allocated) and counts parameters by walking ``named_parameters``. The MTP layer is NOT
part of the HF model (its keys ``model.layers.78.*`` are ignored on load), so it is not counted.

Active parameters per token (convention used here):
  * everything that is not a routed expert counts fully: embeddings (input table, counted in full
    although only one row is gathered), ``lm_head``, all norms, all attention weights (MLA + DSA
    indexer), routers (``gate.weight``), dense MLPs of the first 3 layers and the shared experts;
  * of the routed experts, ``num_experts_per_tok`` (8) of ``n_routed_experts`` (256) per MoE layer;
  * buffers (``e_score_correction_bias``, rotary ``inv_freq``) are not parameters and not counted.
``active_excl_embed`` additionally drops the input embedding table (lm_head kept).
torch / transformers are only needed here (reference tooling), never by the ``glm5_jax`` package.
"""

from __future__ import annotations

import json
import re

from absl import flags

from glm5_jax.cli import run


def count(config=None):
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = config if config is not None else GlmMoeDsaConfig()
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(cfg)

    groups = {
        "embed_tokens": 0,
        "lm_head": 0,
        "norms": 0,
        "attention_mla": 0,
        "attention_indexer": 0,
        "dense_mlp": 0,
        "router": 0,
        "shared_experts": 0,
        "routed_experts": 0,
    }
    for name, p in model.named_parameters():
        n = p.numel()
        if name == "model.embed_tokens.weight":
            groups["embed_tokens"] += n
        elif name == "lm_head.weight":
            groups["lm_head"] += n
        elif ".self_attn.indexer." in name:
            groups["attention_indexer"] += n  # includes indexer k_norm (LayerNorm)
        elif re.search(r"(layernorm|norm)\.weight$", name):
            groups["norms"] += n
        elif ".self_attn." in name:
            groups["attention_mla"] += n
        elif ".mlp.experts." in name:
            groups["routed_experts"] += n
        elif ".mlp.shared_experts." in name:
            groups["shared_experts"] += n
        elif ".mlp.gate." in name:
            groups["router"] += n
        elif ".mlp." in name:
            groups["dense_mlp"] += n
        else:
            raise ValueError(f"unclassified parameter {name}")

    total = sum(groups.values())
    assert total == sum(p.numel() for p in model.parameters())
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    n_moe = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    assert groups["routed_experts"] == n_moe * cfg.n_routed_experts * per_expert
    active_routed = n_moe * cfg.num_experts_per_tok * per_expert
    active = total - groups["routed_experts"] + active_routed
    return dict(
        total=total,
        active=active,
        active_excl_embed=active - groups["embed_tokens"],
        total_excl_embed_and_head=total - groups["embed_tokens"] - groups["lm_head"],
        num_hidden_layers=cfg.num_hidden_layers,
        moe_layers=n_moe,
        dense_layers=cfg.num_hidden_layers - n_moe,
        params_per_routed_expert=per_expert,
        active_routed_experts=active_routed,
        groups=groups,
        buffers_not_counted=dict(
            e_score_correction_bias=n_moe * cfg.n_routed_experts,
        ),
        mtp_counted=False,
    )


FLAGS = flags.FLAGS


def define_flags() -> None:
    """This CLI's flags (defined only when run as a program, so importing the module has no side effect)."""
    flags.DEFINE_bool("json", False, "print JSON only")


def main(argv):
    del argv
    r = count()
    if FLAGS.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"total parameters (no MTP):        {r['total']:>16,d}  ({r['total'] / 1e9:.2f}B)")
    print(f"active parameters per token:     {r['active']:>16,d}  ({r['active'] / 1e9:.2f}B)")
    print(f"active excl. input embedding:    {r['active_excl_embed']:>16,d}  ({r['active_excl_embed'] / 1e9:.2f}B)")
    print(f"total excl. embedding + lm_head: {r['total_excl_embed_and_head']:>16,d}")
    print(f"layers: {r['num_hidden_layers']} ({r['dense_layers']} dense, {r['moe_layers']} MoE); "
          f"params per routed expert: {r['params_per_routed_expert']:,d}")
    for k, v in r["groups"].items():
        print(f"  {k:<18s} {v:>16,d}")
    return 0


if __name__ == "__main__":
    run(main, define_flags)
