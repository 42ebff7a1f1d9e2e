"""Build golden-logit fixtures from the HuggingFace reference ``GlmMoeDsaForCausalLM``.

Usage::

    python -m tools.make_hf_fixtures [--out tests/fixtures] [--only hf_sparse,hf_shared]

For every fixture spec below this script

* builds a tiny random ``GlmMoeDsaConfig`` (float32, ``attn_implementation="eager"``),
* initialises the model under ``torch.manual_seed(seed)``,
* sets every router ``e_score_correction_bias`` buffer to non-zero values, and moves every norm
  weight away from 1 (indexer ``k_norm`` LayerNorm weight/bias away from 1/0),
* checks that no discrete decision (indexer top-k, router group top-k, router expert top-k) sits
  on a near-tie, so that a float32 re-implementation selects the same sets (if one does, the
  seed is bumped and the model rebuilt; the used seed goes into ``meta.json``),
* runs a forward pass on fixed random ``input_ids`` [2, T] and writes into ``<out>/<name>/``:
  ``model.safetensors`` + ``config.json`` (``save_pretrained(..., safe_serialization=True)``),
  ``input_ids.npy`` (int32 [2, T]), ``logits.npy`` (float32 [2, T, vocab]),
  ``indexer_topk.npz`` (per layer ``layer_{i}``: int32 [2, T, min(index_topk, T)] top-k key
  indices actually used by that layer, sorted ascending per row, for debugging) and ``meta.json``,
* reloads the directory with ``from_pretrained`` and asserts the logits are reproduced.

torch / transformers are only needed here (fixture generation), never by the ``glm5_jax`` package.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from absl import app, flags

from glm5_jax.cli import main_wrapper, run

# Keep the shared CPU machine usable.
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch
except ImportError:      # the `fixtures` extra: `--help` and the import work without it, main says what to install
    torch = None
else:
    torch.set_num_threads(1)

BATCH = 2
# Minimal tie margins accepted for discrete choices. Index scores are O(0.3) and router scores are
# sigmoids in (0, 1); a float32 re-implementation (HIGHEST matmul precision) differs by ~1e-7, so
# these margins leave >100x headroom. They do NOT survive bf16 / TF32 matmuls: compare at float32.
MIN_INDEX_GAP = 5e-5
MIN_ROUTER_GAP = 2e-5

_COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    index_head_dim=16,
    # 8 (not 4) indexer heads: with 4 heads a key scores exactly 0 whenever all 4 ReLUs are 0
    # (p ~ 1/16), which produced exact ties at the top-k boundary for almost every seed.
    index_n_heads=8,
    index_topk=8,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
)

FIXTURES = {
    "hf_sparse": dict(
        seed=1001,
        seq_len=40,
        config=dict(indexer_types=["full"] * 4),
        exercises=[
            "DSA sparse attention: T=40 is 5x index_topk=8, so every query past position 7 drops keys",
            "every layer runs its own indexer (indexer_types all 'full')",
            "dense MLP layer 0 (first_k_dense_replace=1) + MoE layers 1..3",
            "MoE: 4 routed experts, top-2, 1 shared expert, n_group=1, norm_topk_prob=True, scaling 2.5",
            "non-zero e_score_correction_bias (affects choice only, not weights)",
            "all RMSNorm weights != 1, indexer k_norm LayerNorm weight != 1 and bias != 0",
            "interleaved RoPE on the MLA rope slice and on the indexer rope slice",
        ],
    ),
    "hf_shared": dict(
        seed=2002,
        seq_len=32,
        config=dict(indexer_types=["full", "shared", "full", "shared"]),
        exercises=[
            "cross-layer top-k sharing: layers 1 and 3 are 'shared' (no indexer weights), reuse the "
            "top-k of the previous 'full' layer (0 and 2)",
            "DSA sparse attention: T=32 is 4x index_topk=8",
            "dense MLP layer 0 + MoE layers 1..3 (4 experts, top-2, 1 shared expert)",
            "non-zero e_score_correction_bias, norm weights != 1, k_norm weight/bias perturbed",
        ],
    ),
    "hf_grouped": dict(
        seed=3003,
        seq_len=24,
        config=dict(
            hidden_size=48,
            vocab_size=160,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=3,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            indexer_types=["full", "full", "full"],
        ),
        exercises=[
            "group-limited routing: 8 experts in n_group=4 groups of 2, topk_group=2 groups kept "
            "(group score = sum of top-2 biased scores in the group), then top-3 experts among the "
            "4 surviving ones",
            "DSA sparse attention: T=24 is 3x index_topk=8",
            "3 heads, hidden 48 (non power-of-two head count)",
            "dense MLP layer 0 + MoE layers 1..2; non-zero e_score_correction_bias; perturbed norms",
        ],
    ),
    "hf_dense_equiv": dict(
        seed=4004,
        seq_len=24,
        config=dict(
            index_topk=64,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            kv_lora_rank=32,
            indexer_types=["full", "shared", "full", "full"],
        ),
        exercises=[
            "index_topk=64 >= T=24: DSA selects every causal key, output equals dense MLA attention",
            "rope_theta=50000 (non-default)",
            "routed_scaling_factor=1.5 with norm_topk_prob=False (raw sigmoid weights, not renormalised)",
            "kv_lora_rank=32; one 'shared' indexer layer (layer 1)",
            "dense MLP layer 0 + MoE layers 1..3; non-zero e_score_correction_bias; perturbed norms",
        ],
    ),
    "hf_yarn": dict(
        seed=5005,
        seq_len=96,
        config=dict(
            qk_rope_head_dim=16,
            index_head_dim=32,
            max_position_embeddings=128,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 8.0,
                "beta_slow": 0.5,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
            indexer_types=["full", "shared", "full", "full"],
        ),
        exercises=[
            "YaRN RoPE (DeepSeek-V3 style): factor 4, original_max_position_embeddings=32, T=96 = 3x that",
            "non-default beta_fast=8 / beta_slow=0.5: the ramp blends pairs 1..2 of the 8 rope pairs "
            "(pair 0 keeps its frequency, pairs 3..7 are divided by 4)",
            "mscale=1.0 != mscale_all_dim=0.8: cos/sin scaled by mscale(4,1)/mscale(4,0.8) (MLA and "
            "indexer rope slices) and the MLA softmax scale by mscale(4,0.8)^2 (the indexer's not)",
            "qk_rope_head_dim=16 (rope slice), index_head_dim=32 (indexer rope on its first 16 dims)",
            "DSA sparse attention: T=96 is 12x index_topk=8; one 'shared' indexer layer (layer 1)",
        ],
    ),
}


def _build_config(spec):
    from transformers import GlmMoeDsaConfig

    kw = dict(_COMMON)
    kw.update(spec["config"])
    return GlmMoeDsaConfig(attn_implementation="eager", dtype="float32", **kw)


def _perturb(model, gen):
    """Non-trivial buffers/norms so the fixture exercises them."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, hf.GlmMoeDsaTopkRouter):
                b = torch.rand(mod.e_score_correction_bias.shape, generator=gen) * 0.2 - 0.1
                mod.e_score_correction_bias.copy_(b)
            elif isinstance(mod, hf.GlmMoeDsaRMSNorm):
                mod.weight.copy_(1.0 + 0.3 * torch.randn(mod.weight.shape, generator=gen))
            elif isinstance(mod, torch.nn.LayerNorm):
                mod.weight.copy_(1.0 + 0.3 * torch.randn(mod.weight.shape, generator=gen))
                mod.bias.copy_(0.1 * torch.randn(mod.bias.shape, generator=gen))


class _Recorder:
    """Forward hooks that re-derive the discrete choices and record their tie margins."""

    def __init__(self, model):
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

        self.hf = hf
        self.index_gaps = []  # min gap per full indexer layer
        self.group_gaps = []
        self.expert_gaps = []
        self.topk = {}
        self.handles = []
        for name, mod in model.named_modules():
            if isinstance(mod, hf.GlmMoeDsaIndexer):
                self.handles.append(mod.register_forward_hook(self._indexer_hook, with_kwargs=True))
            elif isinstance(mod, hf.GlmMoeDsaTopkRouter):
                self.handles.append(mod.register_forward_hook(self._router_hook))
            elif isinstance(mod, hf.GlmMoeDsaAttention):
                self.handles.append(mod.register_forward_hook(self._make_attn_hook(mod.layer_idx)))

    def close(self):
        for h in self.handles:
            h.remove()

    def _make_attn_hook(self, layer_idx):
        def hook(mod, args, out):
            idx = out[2].detach().long().sort(dim=-1).values
            self.topk[f"layer_{layer_idx}"] = idx.to(torch.int32).numpy()

        return hook

    def _indexer_hook(self, mod, args, kwargs, out):
        # Recompute the index scores exactly as the reference does, then measure the k-th gap.
        hidden_states, q_resid, (cos, sin), attention_mask = args[:4]
        b, s, _ = hidden_states.shape
        q = mod.wq_b(q_resid).view(b, s, mod.n_heads, mod.head_dim)
        r = mod.qk_rope_head_dim
        k = mod.k_norm(mod.wk(hidden_states)).unsqueeze(2)
        q_rot, k_rot = self.hf.apply_rotary_pos_emb_interleave(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., r:]], -1)
        k = torch.cat([k_rot, k[..., r:]], -1).squeeze(2)
        scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * mod.softmax_scale)
        w = mod.weights_proj(hidden_states).float() * (mod.n_heads**-0.5)
        idx_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # [B, S, T]
        kk = mod.index_topk
        gaps = []
        for i in range(s):
            if i + 1 <= kk:
                continue  # all causal keys are selected; no choice to make
            v = idx_scores[:, i, : i + 1].sort(dim=-1, descending=True).values
            gaps.append((v[:, kk - 1] - v[:, kk]).min().item())
        self.index_gaps.append(min(gaps) if gaps else float("inf"))

    def _router_hook(self, mod, args, out):
        x = args[0].reshape(-1, mod.hidden_dim).float()
        scores = torch.sigmoid(x @ mod.weight.float().t())
        choice = scores + mod.e_score_correction_bias
        e, g, tg, k = mod.num_experts, mod.num_group, mod.topk_group, mod.top_k
        gs = choice.view(-1, g, e // g).topk(2, dim=-1).values.sum(-1)
        if tg < g:
            v = gs.sort(dim=-1, descending=True).values
            self.group_gaps.append((v[:, tg - 1] - v[:, tg]).min().item())
        gidx = gs.topk(tg, dim=-1).indices
        gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0).bool()
        emask = gmask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e)
        masked = choice.masked_fill(~emask, float("-inf"))
        v = masked.sort(dim=-1, descending=True).values
        if k < tg * (e // g):
            self.expert_gaps.append((v[:, k - 1] - v[:, k]).min().item())


def _forward(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits.float()


def build_one(name, spec, out_dir, verbose=False):
    from transformers import GlmMoeDsaForCausalLM

    seed = spec["seed"]
    for attempt in range(60):
        torch.manual_seed(seed)
        cfg = _build_config(spec)
        model = GlmMoeDsaForCausalLM(cfg).eval()
        gen = torch.Generator().manual_seed(seed + 1)
        _perturb(model, gen)
        input_ids = torch.randint(0, cfg.vocab_size, (BATCH, spec["seq_len"]), generator=gen)
        rec = _Recorder(model)
        logits = _forward(model, input_ids)
        rec.close()
        ig = min(rec.index_gaps) if rec.index_gaps else float("inf")
        rg = min(rec.group_gaps + rec.expert_gaps) if (rec.group_gaps or rec.expert_gaps) else float("inf")
        if ig >= MIN_INDEX_GAP and rg >= MIN_ROUTER_GAP:
            break
        print(f"[{name}] seed {seed}: near-tie (index gap {ig:.2e}, router gap {rg:.2e}); retrying", flush=True)
        seed += 1
    else:
        raise RuntimeError(f"{name}: could not find a tie-free seed")

    assert model.config._attn_implementation == "eager"
    d = os.path.join(out_dir, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    model.save_pretrained(d, safe_serialization=True)
    gc_path = os.path.join(d, "generation_config.json")
    if os.path.exists(gc_path):
        os.remove(gc_path)  # not needed by the fixture

    from safetensors import safe_open

    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        keys = {k: list(f.get_slice(k).get_shape()) for k in sorted(f.keys())}
    # Released GLM-5 / DeepSeek-V3 checkpoints store one tensor per expert.
    moe_layers = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "sparse"]
    for i in moe_layers:
        assert f"model.layers.{i}.mlp.experts.0.gate_proj.weight" in keys, "expected per-expert keys"
        assert f"model.layers.{i}.mlp.gate.e_score_correction_bias" in keys
    assert not any("gate_up_proj" in k for k in keys), "packed expert keys written; convert them"

    np.save(os.path.join(d, "input_ids.npy"), input_ids.numpy().astype(np.int32))
    np.save(os.path.join(d, "logits.npy"), logits.numpy().astype(np.float32))
    np.savez(os.path.join(d, "indexer_topk.npz"), **rec.topk)

    # How much DSA matters: the same model with every indexer selecting all keys (dense MLA).
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    idx_mods = [m for m in model.modules() if isinstance(m, hf.GlmMoeDsaIndexer)]
    saved_k = [m.index_topk for m in idx_mods]
    for m in idx_mods:
        m.index_topk = 10**9
    dense_diff = (_forward(model, input_ids) - logits).abs().max().item()
    for m, k in zip(idx_mods, saved_k):
        m.index_topk = k

    # How much the RoPE scaling matters: the same weights under plain RoPE (same theta).
    rope_diff = None
    if cfg.rope_parameters.get("rope_type", "default") != "default":
        plain = _build_config({"config": {**spec["config"], "rope_parameters": {
            "rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"]}}})
        other = GlmMoeDsaForCausalLM(plain).eval()
        other.load_state_dict(model.state_dict())
        rope_diff = (_forward(other, input_ids) - logits).abs().max().item()

    # Sanity: the saved checkpoint reproduces the logits.
    re = GlmMoeDsaForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    for mod in re.modules():
        if hasattr(mod, "e_score_correction_bias"):
            assert mod.e_score_correction_bias.abs().min() > 0, "bias not restored"
    re_logits = _forward(re, input_ids)
    reload_diff = (re_logits - logits).abs().max().item()
    assert reload_diff < 1e-5, f"{name}: reload mismatch {reload_diff}"

    import transformers

    meta = dict(
        name=name,
        seed=seed,
        batch=BATCH,
        seq_len=spec["seq_len"],
        vocab_size=cfg.vocab_size,
        dtype="float32",
        attn_implementation="eager",
        files={
            "config.json": "HF GlmMoeDsaConfig (save_pretrained)",
            "model.safetensors": "HF checkpoint, per-expert keys (see BUILD_NOTES)",
            "input_ids.npy": f"int32 [{BATCH}, {spec['seq_len']}]",
            "logits.npy": f"float32 [{BATCH}, {spec['seq_len']}, {cfg.vocab_size}] (no attention_mask, "
            "positions 0..T-1, use_cache=False)",
            "indexer_topk.npz": "layer_{i}: int32 [B, T, min(index_topk, T)] key indices used by layer i "
            "(ascending per row; rows with t+1 < k also contain masked future positions)",
        },
        exercises=spec["exercises"],
        mlp_layer_types=list(cfg.mlp_layer_types),
        indexer_types=list(cfg.indexer_types),
        index_topk=cfg.index_topk,
        n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        rope_parameters=dict(cfg.rope_parameters),
        min_indexer_topk_gap=None if not rec.index_gaps else min(rec.index_gaps),
        min_router_group_gap=None if not rec.group_gaps else min(rec.group_gaps),
        min_router_expert_gap=None if not rec.expert_gaps else min(rec.expert_gaps),
        logits_std=float(logits.std()),
        reload_max_abs_diff=reload_diff,
        dense_attention_logits_max_abs_diff=dense_diff,
        **({} if rope_diff is None else {"default_rope_logits_max_abs_diff": rope_diff}),
        suggested_tolerance=dict(atol=1e-4, rtol=1e-4),
        num_params=int(sum(p.numel() for p in model.parameters())),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        generator="python -m tools.make_hf_fixtures",
    )
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")

    size = sum(os.path.getsize(os.path.join(d, fn)) for fn in os.listdir(d))
    print(
        f"[{name}] seed={seed} T={spec['seq_len']} params={meta['num_params']} size={size} B "
        f"index_gap={meta['min_indexer_topk_gap']} router_gaps=({meta['min_router_group_gap']}, "
        f"{meta['min_router_expert_gap']}) logits_std={meta['logits_std']:.4f} dsa_vs_dense={dense_diff:.3g} reload_diff={reload_diff:.1e}",
        flush=True,
    )
    assert size < 1_000_000, f"{name} fixture too large: {size}"
    if verbose:
        for k, shp in keys.items():
            print(f"  {k} {shp}")
    return d, keys


FLAGS = flags.FLAGS


def define_flags() -> None:
    """This CLI's flags (defined only when run as a program, so importing the module has no side effect)."""
    flags.DEFINE_string("out", os.path.join("tests", "fixtures"), "output folder")
    flags.DEFINE_list("only", [], "comma-separated fixture names (default: all)")
    flags.DEFINE_string("print_keys", "hf_shared", "print the key list of this fixture")
    flags.register_validator("only", lambda v: set(v) <= set(FIXTURES), f"allowed: a comma list of {', '.join(sorted(FIXTURES))}")


@main_wrapper      # no torch: one line on stderr, exit 2 (glm5_jax.cli)
def main(argv):
    del argv
    if torch is None:
        raise app.UsageError("tools.make_hf_fixtures needs torch and transformers: pip install -e '.[fixtures]'")
    args = FLAGS
    names = args.only or list(FIXTURES)
    os.makedirs(args.out, exist_ok=True)
    for n in names:
        build_one(n, FIXTURES[n], args.out, verbose=(n == args.print_keys))
    return 0


if __name__ == "__main__":
    run(main, define_flags)
