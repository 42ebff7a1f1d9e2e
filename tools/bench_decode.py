"""Decode benchmark (not a test): `python -m tools.bench_decode [--new 512] [--prompt 32] [--layers 4]`.

Same process, same randomly initialised small DSA+MoE model, batch 1, greedy:
  * cached decode (prefill + one jitted lax.while_loop) and a Python loop over the jitted decode step;
  * full recompute: each step runs the jitted full forward over a fixed [1, prompt + new] buffer
    (one compile; causal, so the logits at the frontier are exact) and appends the argmax;
  * prefill tokens/s;
  * MTP speculative vs plain greedy: on the random model (drafts are random, acceptance ~1, so
    speculation only adds work) and on a constructed 'perfect drafter' (bigram trunk, MTP passes the
    next token's embedding through: every draft is accepted) to show the machinery's ceiling.
Timings exclude compilation (every program runs once before it is timed).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import model
from glm5_jax.config import ModelConfig
from glm5_jax.infer import decode, generate, speculative_generate
from glm5_jax.infer.cache import cache_numbers_per_token, init_cache


def bench_config(layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=1024, d_model=256, num_layers=layers, ffn_dim=512, attention="dsa", num_heads=4,
                       q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                       index_topk=64, index_n_heads=4, index_head_dim=32, num_experts=8, experts_per_tok=2,
                       moe_ffn_dim=128, first_k_dense=1, mtp_depth=1)


def _timed(fn, repeat=1):
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def full_recompute(cfg, params, prompt, n_new):
    width = len(prompt) + n_new

    @jax.jit
    def step(buf, pos):
        logits = model.forward(cfg, params, buf)
        tok = jnp.argmax(logits[0, pos]).astype(jnp.int32)
        return buf.at[0, pos + 1].set(tok), tok

    def run():
        buf = jnp.zeros((1, width), jnp.int32).at[0, :len(prompt)].set(jnp.asarray(prompt))
        toks = []
        for i in range(n_new):
            buf, tok = step(buf, jnp.int32(len(prompt) - 1 + i))
            toks.append(tok)
        return np.asarray(jnp.stack(toks))
    return run


def python_loop(cfg, params, prompt, n_new):
    def run():
        tokens = jnp.asarray([prompt], jnp.int32)
        cache = init_cache(cfg, 1, len(prompt) + n_new)
        logits, cache = decode.prefill(cfg, params, cache, tokens, jnp.asarray([len(prompt)]))
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        out = [tok]
        pos = jnp.asarray([len(prompt)], jnp.int32)
        for _ in range(n_new - 1):
            logits, cache = decode.decode_step(cfg, params, cache, tok, pos)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            out.append(tok)
            pos = pos + 1
        return np.asarray(jnp.concatenate(out))
    return run


def perfect_drafter(cfg, params):
    """Zero every attention/MLP/MoE output (trunk = embed -> head) and set eh_proj = [I; 0]."""
    p = jax.tree_util.tree_map(lambda x: x, params)
    # stacked sub-layers ([repeats, ...] leaves) and the MTP layer: zeros_like covers every repeat
    blocks = [p[s.name][f"layer_{j}"] for s in cfg.layer_stacks for j in range(s.period)] + [p["mtp_0"]["layer"]]
    for blk in blocks:
        blk["attn"]["o_proj"]["kernel"] = jnp.zeros_like(blk["attn"]["o_proj"]["kernel"])
        if "mlp" in blk:
            blk["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(blk["mlp"]["down_proj"]["kernel"])
        else:
            blk["moe"]["experts"]["down_proj"] = jnp.zeros_like(blk["moe"]["experts"]["down_proj"])
            blk["moe"]["shared_experts"]["down_proj"]["kernel"] = jnp.zeros_like(
                blk["moe"]["shared_experts"]["down_proj"]["kernel"])
    d = cfg.d_model
    p["mtp_0"]["eh_proj"]["kernel"] = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)
    return p


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--spec-new", type=int, default=128)
    ap.add_argument("--num-draft", type=int, default=4)
    args = ap.parse_args(argv)
    cfg = bench_config(args.layers)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    n_par = sum(x.size for x in jax.tree_util.tree_leaves(params))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt).tolist()
    print(f"model: d_model={cfg.d_model} layers={cfg.num_layers} dsa(topk={cfg.index_topk}) MoE {cfg.num_experts}x"
          f"{cfg.experts_per_tok}, {n_par / 1e6:.2f}M params, cache {cache_numbers_per_token(cfg)} numbers/token; "
          f"devices {jax.devices()}")
    rows = []

    t, res = _timed(lambda: generate(cfg, params, [prompt], max_new_tokens=args.new, temperature=0.0), repeat=2)
    cached_tps = args.new / res.stats["decode_s"]
    rows.append(("cached decode (while_loop)", f"{cached_tps:,.0f} tok/s", f"{res.stats['decode_s']:.2f} s for {args.new}"))
    t_py, py_toks = _timed(python_loop(cfg, params, prompt, args.new))
    rows.append(("cached decode (Python loop over jitted step)", f"{args.new / t_py:,.0f} tok/s", f"{t_py:.2f} s incl. prefill"))
    t_full, full_toks = _timed(full_recompute(cfg, params, prompt, args.new))
    full_tps = args.new / t_full
    rows.append(("full recompute each step", f"{full_tps:,.1f} tok/s", f"{t_full:.2f} s for {args.new}"))
    rows.append(("speed-up cached / recompute", f"{cached_tps / full_tps:.1f}x", ""))
    same = bool((full_toks == res.tokens[0]).all() and (py_toks == res.tokens[0]).all())
    rows.append(("greedy tokens identical (3 ways)", str(same), ""))

    pre = rng.integers(0, cfg.vocab_size, (1, args.prefill)).astype(np.int32)
    cache = init_cache(cfg, 1, args.prefill)
    lens = jnp.asarray([args.prefill])
    t_pre, _ = _timed(lambda: jax.block_until_ready(decode.prefill(cfg, params, cache, jnp.asarray(pre), lens)), 3)
    rows.append((f"prefill ({args.prefill} tokens, batch 1)", f"{args.prefill / t_pre:,.0f} tok/s", f"{t_pre * 1e3:.1f} ms"))

    for name, p in (("random model", params), ("perfect drafter", perfect_drafter(cfg, params))):
        _, plain = _timed(lambda: generate(cfg, p, [prompt], max_new_tokens=args.spec_new, temperature=0.0))
        _, spec = _timed(lambda: speculative_generate(cfg, p, [prompt], max_new_tokens=args.spec_new,
                                                      num_draft=args.num_draft))
        plain_tps = args.spec_new / plain.stats["decode_s"]
        rows.append((f"{name}: plain greedy ({args.spec_new} tokens)", f"{plain_tps:,.0f} tok/s", ""))
        rows.append((f"{name}: MTP speculative, {args.num_draft} drafts", f"{spec.tokens_per_s:,.0f} tok/s",
                     f"acceptance length {spec.acceptance_length:.2f}, {spec.verify_steps} verify steps, "
                     f"same tokens: {bool((spec.tokens == plain.tokens).all())}"))

    print("\n| measurement | throughput | notes |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    main()
