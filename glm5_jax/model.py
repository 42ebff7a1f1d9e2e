"""The GLM-5 decoder: embed -> layer stacks -> norm -> head, plus multi-token-prediction (MTP) blocks.

`GLM5` is the Flax Linen module; `forward(config, params, tokens)` is the plain-function entry.

Layers live in scanned stacks (`ModelConfig.layer_stacks`): the dense prefix and the MoE body, each an
`nn.scan` over a block of `period` decoder layers (period 1 unless shared-indexer layouts repeat with
a longer period). Every stacked parameter has a leading layer axis (logical name "layers"); the top-k
indices of the last `full` indexer layer travel in the scan carry (only when the model has a `shared` layer), so a `shared` layer anywhere reads
them. `scan_layers=False` unrolls the same stacks at trace time (same parameter tree).

Training, prefill and decode run the same modules: pass `cache` (from `glm5_jax.infer.cache`) and the
attention layers write this call's keys into it and attend over it (MLA in its absorbed latent form).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.attention.context import context_size
from glm5_jax.attention.core import LayerCache
from glm5_jax.config import LayerStack, ModelConfig
from glm5_jax.layers.common import Dense, RMSNorm, constrain, dtype_of, init_normal
from glm5_jax.layers.decoder import ACT, DecoderLayer
from glm5_jax.layers.rope import rope_angles
from glm5_jax.mtp import MTPBlock, shift_left

LAYER_INPUT = "decoder_layer_input"     # checkpoint_name of a scan step's input (see REMAT["offload"])
# (LAYER_MID, the residual between attention and MLP / MoE: glm5_jax.layers.decoder)

# ModelConfig.remat -> jax checkpoint policy (None: no rematerialisation at all). A remat'd block always keeps
# its inputs (the layer input); the named policies also keep the tagged activations (checkpoint_name:
# attn_q / attn_kv / attn_context in glm5_jax.attention.mla, expert_in / expert_gate / expert_up in
# glm5_jax.parallel.ep), so the backward recomputes only what lies between them (MaxText's
# save_qkv_proj / save_dot_except_mlp / custom policies are the reference).
_offload = lambda save=(), offload=(): jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=tuple(save), names_which_can_be_offloaded=tuple(offload),
    offload_src="device", offload_dst="pinned_host")
REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # as "full", but each scanned layer's input (the one value "full" keeps per layer, B*T*D) is
    # moved to host memory after the forward and brought back for the backward (TPU/GPU pinned host
    # memory; on CPU it stays where it is). Only the scan's saved inputs move: the MTP blocks keep theirs.
    "offload": _offload(offload=(LAYER_INPUT,)),
    "save_qkv": jax.checkpoint_policies.save_only_these_names("attn_q", "attn_kv"),
    "save_attention": jax.checkpoint_policies.save_only_these_names("attn_q", "attn_kv", "attn_context"),
}


def remat_policy(cfg: ModelConfig):
    """The jax checkpoint policy of cfg.remat; "custom" places each name of cfg.remat_custom
    ("NAME:device" saved in HBM, "NAME:offload" in pinned host memory), everything else recomputed."""
    if cfg.remat != "custom":
        return REMAT[cfg.remat]
    split = [item.split(":") for item in cfg.remat_custom]
    return _offload(save=[n for n, p in split if p == "device"], offload=[n for n, p in split if p == "offload"])


class Block(nn.Module):
    """One scan step of a stack: `stack.period` decoder layers (`layer_0` ...).

    The carry is (x, indices), or with a cache (x, indices, the stack's cache {"layer_j": buffers
    [repeats, B, S, ...]}, this step's int32 index r): the stacked buffers themselves travel in the carry and
    each attention layer writes its new rows at [r, b, slot] in place and reads row r (`LayerCache`), so a
    step neither slices out nor copies a layer's cache, and the cache exists once (a scan over per-layer
    cache slices as xs / ys copied every layer's cache per step into a second cache-sized output)."""
    cfg: ModelConfig
    stack: LayerStack

    @nn.compact
    def __call__(self, carry, cos, sin, segment_ids, positions, write_positions, indexer_loss, monitor_logits):
        x, indices, *cached = carry
        x = checkpoint_name(x, LAYER_INPUT)
        cache, r, slots, pages = cached if cached else (None, None, None, None)
        for j, itype in enumerate(self.stack.indexer_types):
            lc = None if cache is None else LayerCache(cache[f"layer_{j}"], r, slots, pages)
            x, idx, lc = DecoderLayer(self.cfg, self.stack.moe, itype, name=f"layer_{j}")(
                x, cos, sin, segment_ids, indices, indexer_loss, monitor_logits,
                positions=positions, cache=lc, write_positions=write_positions)
            if idx is not None and indices is not None:   # None: no shared layer reads them (not carried)
                indices = idx
            if cache is not None:
                cache = dict(cache, **{f"layer_{j}": lc.buffers})
        return ((x, indices) if cache is None else (x, indices, cache, r + 1, slots, pages)), None


def stack_module(cfg: ModelConfig, stack: LayerStack):
    """The scanned (or unrolled) Block class of one stack, with the config's remat policy inside."""
    block = Block
    if cfg.remat != "none":
        # argnums count `self`: 7 = indexer_loss, 8 = monitor_logits (Python values, not traced)
        block = nn.remat(Block, policy=remat_policy(cfg), prevent_cse=not cfg.scan_layers, static_argnums=(7, 8))
    return nn.scan(block, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                   in_axes=(nn.broadcast,) * 7, length=stack.repeats,
                   unroll=1 if cfg.scan_layers else stack.repeats,
                   metadata_params={nn.PARTITION_NAME: "layers"})


def num_indices(config: ModelConfig, cache_size: int | None) -> int:
    """Width K of the DSA top-k index arrays: index_topk in training (padded with -1 past the visible
    keys), min(index_topk, S) over a cache of S slots."""
    return config.index_topk if cache_size is None else min(config.index_topk, cache_size)


class GLM5(nn.Module):
    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        pdt = dtype_of(c.param_dtype)
        self.embed = nn.Embed(c.vocab_size, c.d_model, param_dtype=pdt, dtype=dtype_of(c.dtype),
                              embedding_init=init_normal(c.initializer_range, ("vocab", "embed")))
        self.stacks = [stack_module(c, s)(c, s, name=s.name) for s in c.layer_stacks]
        self.final_norm = RMSNorm(c.rms_norm_eps, pdt)
        if not c.tie_embeddings:
            # operands in the wider of the param / compute dtypes (bf16 for glm5), float32
            # accumulation and logits: both operands hold bf16 values anyway, so the products are
            # those of the former float32 dot (bf16 x bf16 is exact in float32), but neither
            # the gathered [D, V] kernel nor its gradient exists in float32 (2 x 3.8 GB per chip for
            # glm5, measured with tools.aot; docs/scaleout.md)
            self.lm_head = Dense(c.vocab_size, ("embed", "vocab"), c.initializer_range,
                                 jnp.promote_types(pdt, dtype_of(c.dtype)), pdt, out_dtype=jnp.float32,
                                 nn_kernel_grad=True)
        if c.reward_head:   # reward model: one scalar per position from the final-normed hidden state
            self.reward_head = Dense(1, ("embed", None), c.initializer_range, jnp.float32, pdt, out_dtype=jnp.float32)
        n_mtp = (1 if c.mtp_share else c.mtp_depth) if c.mtp_depth else 0
        # the MTP blocks run outside the scanned stacks: they take the same remat policy, or their
        # attention and MoE residuals (3 depths) dominate the step's peak memory (tools.aot, glm5)
        # argnums count `self`: 6 = indexer_loss (a Python value, not traced)
        mtp_cls = MTPBlock if c.remat == "none" else nn.remat(MTPBlock, policy=remat_policy(c), static_argnums=(6,))
        self.mtp = [mtp_cls(c, name=f"mtp_{k}") for k in range(n_mtp)]

    def head(self, h):
        """Final-normed hidden [.., D] -> float32 logits [.., V]."""
        if self.cfg.tie_embeddings:
            return self.embed.attend(h.astype(jnp.float32)).astype(jnp.float32)
        return self.lm_head(h)

    def rope(self, positions):
        c = self.cfg
        return rope_angles(positions, c.qk_rope_head_dim if c.is_mla else c.head_dim, c.rope_theta,
                           c.rope_scaling_dict or None)

    def mtp_depth(self, k: int, h_prev, next_tokens, positions, segment_ids=None, *, cache=None,
                  write_positions=None, indexer_loss=None, emb=None):
        """MTP depth k (1-based): h_prev [B, T, D] (depth k-1's h; the trunk's pre-norm output at k=1),
        next_tokens [B, T] (the token k steps ahead of each position), or their embedding `emb`
        [B, T, D] -> (h, final-normed h, cache)."""
        cos, sin = self.rope(positions)
        block = self.mtp[0] if self.cfg.mtp_share else self.mtp[k - 1]
        if emb is None:
            # constrained like the trunk's embedding: unconstrained, GSPMD gathered the whole [B, T, D] on
            # every chip for MTP's enorm (24 GiB a copy for glm5 at T=128K, tools.aot)
            emb = constrain(self.embed(next_tokens), ACT)
        return block(h_prev, emb, cos, sin, segment_ids, indexer_loss, positions=positions,
                     cache=cache, write_positions=write_positions)

    def __call__(self, tokens, positions=None, segment_ids=None, *, indexer_loss=None, mtp: bool = False,
                 return_hidden: bool = False, monitor_logits: bool = False, cache=None, write_positions=None,
                 logits: bool = True, mtp_tokens=None, reward: bool = False, cache_slots=None,
                 cache_pages=None) -> dict[str, Any]:
        """tokens [B, T] int -> {"logits": [B, T, V] float32, "mtp_logits": [depth, B, T, V] if mtp,
        "hidden": [B, T, D] final-normed and "trunk": [B, T, D] before the final norm if return_hidden,
        "mtp_hidden": [depth, B, T, D] final-normed MTP states instead of mtp_logits if mtp and not logits,
        "cache": the updated layer caches if cache}.

        positions [B, T] default arange (restart them per document when packing); segment_ids [B, T]
        keep attention inside documents; indexer_loss in (None, "dense", "sparse") sows indexer KL;
        monitor_logits sows each layer's max |q.k|*scale as intermediates/<stack>/layer_j/attn/max_attn_logit.
        cache: {stack name: {"layer_j": buffers [repeats, B, S, ...]}} (glm5_jax.infer.cache.init_cache's
        "layers", carried through each stack's scan: `Block`); this call's keys are written at write_positions (default positions; < 0 = not written)
        and a query at position p attends the cache slots 0..p. logits=False skips the head.
        cache_slots [B] int32: the cache buffers are [repeats, B, P, S, ...] and batch row b reads and writes
        its row cache_slots[b] of P in place (the serving engine's per-shard prefill, glm5_jax.infer.programs).
        cache_pages [B, n] int32: the cache buffers are page pools [repeats, num_pages, page_size, ...] and
        batch row b's position p is at page cache_pages[b, p // page_size] (the paged serving runtime).
        mtp_tokens [depth, B, T]: the input token k steps ahead for MTP depth k (default: tokens shifted
        left by k); needed under context parallelism, where the sequence is in the context layout
        (glm5_jax.mtp.mtp_batch builds it).
        reward=True (needs cfg.reward_head): "reward" [B, T] float32, the reward head's scalar at every position
        (a reward model reads it at a sequence's last token, glm5_jax.rl.reward_model).
        """
        c = self.cfg
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cos, sin = self.rope(positions)
        use_mtp = mtp and c.mtp_depth > 0
        if use_mtp:
            if mtp_tokens is None and context_size() > 1 and not self.is_initializing():
                raise ValueError("MTP under context parallelism needs mtp_tokens (the sequence is in the context "
                                 "layout: shifting it is wrong); glm5_jax.mtp.mtp_batch builds them")
            if mtp_tokens is None:
                mtp_tokens = jnp.stack([shift_left(tokens, k) for k in range(1, c.mtp_depth + 1)])
            # one lookup for the trunk and every MTP depth: each lookup's backward is a scatter-add into
            # a whole [V, D] table (glm5 at 128K held 16 such 1.77 GiB buffers with four lookups, tools.aot)
            emb = constrain(self.embed(jnp.concatenate([tokens[None], mtp_tokens])), (None,) + ACT)
            x = emb[0]
        else:
            x = constrain(self.embed(tokens), ACT)
        indices = None
        # the top-k indices travel in the scan carry only when a shared layer reads them: a carried [B, T, K]
        # int32 array is saved per layer for the backward (9.75 GiB per chip for glm5 at 128K, tools.aot)
        if c.attention == "dsa" and "shared" in c.layer_indexer_types:
            leaf = None if cache is None else next(iter(next(iter(next(iter(cache.values())).values())).values()))
            size = None if cache is None else (leaf.shape[2 + (cache_slots is not None)] if cache_pages is None
                                               else cache_pages.shape[1] * leaf.shape[2])
            indices = jnp.full((b, t, num_indices(c, size)), -1, jnp.int32)
        new_cache = {} if cache is not None else None
        for stack, mod in zip(c.layer_stacks, self.stacks):
            carry = (x, indices) if cache is None else (x, indices, cache[stack.name], jnp.int32(0), cache_slots,
                                                                       cache_pages)
            carry, _ = mod(carry, cos, sin, segment_ids, positions, write_positions, indexer_loss, monitor_logits)
            x, indices = carry[:2]
            if new_cache is not None:
                new_cache[stack.name] = carry[2]
        hidden = self.final_norm(x)
        out = {"logits": self.head(hidden)} if logits else {}
        if reward and not c.reward_head:
            raise ValueError("reward=True needs ModelConfig.reward_head=True (the scalar reward head)")
        if c.reward_head and (reward or self.is_initializing()):
            out["reward"] = self.reward_head(hidden)[..., 0]
        if return_hidden:
            out["hidden"], out["trunk"] = hidden, x
        if new_cache is not None:
            out["cache"] = new_cache
        if use_mtp:
            h, mtp_logits = x, []
            for k in range(1, c.mtp_depth + 1):
                h, hn, _ = self.mtp_depth(k, h, None, positions, segment_ids, indexer_loss=indexer_loss,
                                          emb=constrain(emb[k], ACT))
                mtp_logits.append(self.head(hn) if logits else hn)
            out["mtp_logits" if logits else "mtp_hidden"] = jnp.stack(mtp_logits)
        return out


def init_params(config: ModelConfig, rng, seq_len: int = 8):
    """Unboxed parameter pytree for `config` (logical axis metadata stripped).

    Jitted: only the parameters are outputs, so the forward pass flax's init runs is dead code to
    XLA and is never executed (op by op it was ~26 s of a ~27 s init of the default config on 2
    cores; jitted ~11 s, mostly tracing and compiling). The values are those of the train state's
    jitted init (eager initialisers round a few float32 ulps differently)."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    return jax.jit(lambda r: nn.unbox(GLM5(config).init(r, tokens, mtp=config.mtp_depth > 0)["params"]))(rng)


def abstract_params(config: ModelConfig, seq_len: int = 8):
    """Shapes/dtypes of the parameters (and their logical axes) without allocating anything."""
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    boxed = jax.eval_shape(lambda r, x: GLM5(config).init(r, x, mtp=config.mtp_depth > 0)["params"],
                           jax.random.PRNGKey(0), tokens)
    return boxed


def forward(config: ModelConfig, params, tokens, positions=None, segment_ids=None):
    """Main-head logits [B, T, vocab] float32 of `tokens` [B, T]."""
    return GLM5(config).apply({"params": params}, jnp.asarray(tokens), positions, segment_ids)["logits"]


def layer_slice_paths(config: ModelConfig, path: str) -> list[str] | None:
    """'/'-joined path of a stacked parameter (e.g. "dense_layers/layer_0/attn/q_a_proj/kernel") ->
    the per-layer name of each slice of its leading axis ("layer_<i>/attn/q_a_proj/kernel", i the
    global layer index); None for a parameter outside the layer stacks."""
    head, _, rest = path.partition("/")
    for stack in config.layer_stacks:
        if head == stack.name:
            sub, _, tail = rest.partition("/")
            j = int(sub[len("layer_"):])
            return [f"layer_{stack.layer_index(r, j)}/{tail}" for r in range(stack.repeats)]
    return None


def per_layer(config: ModelConfig, tree, name: str) -> dict[int, Any]:
    """{global layer index: value} of the leaves called `name` in a stacked tree (params or sown
    intermediates, e.g. "max_attn_logit", "expert_load"): undoes the stacks' leading layer axis."""
    out = {}
    for stack in config.layer_stacks:
        sub = tree.get(stack.name, {})
        for j in range(stack.period):
            leaf = _find(sub.get(f"layer_{j}", {}), name)
            if leaf is None:
                continue
            if isinstance(leaf, tuple):           # flax sow keeps a tuple of sown values
                leaf = leaf[0] if len(leaf) == 1 else jnp.stack(leaf, axis=1).sum(axis=1)
            for r in range(stack.repeats):
                out[stack.layer_index(r, j)] = leaf[r]
    return out


def _find(tree, name):
    if not isinstance(tree, dict):
        return None
    if name in tree:
        return tree[name]
    for v in tree.values():
        hit = _find(v, name)
        if hit is not None:
            return hit
    return None
