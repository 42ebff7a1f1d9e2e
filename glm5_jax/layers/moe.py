"""Mixture of experts: sigmoid router with selection-only correction bias, group-limited top-k,
renormalised pre-bias weights times routed_scaling_factor, shared experts, dropless dispatch."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.layers.common import constrain, init_normal
from glm5_jax.layers.mlp import SwiGLU
from glm5_jax.utils import NEG_INF


def route(x, router_kernel, bias, *, experts_per_tok: int, n_group: int, topk_group: int,
          norm_topk_prob: bool, routed_scaling_factor: float, precision=None):
    """x [N, D] -> (weights [N, k] float32, expert ids [N, k] int32, scores [N, E]).

    The bias only decides which experts are chosen; the weights come from the pre-bias sigmoid scores.
    """
    # precision: HIGHEST over a cache (MoE.cached: decode / prefill) gives float32 logits on TPU too. At the
    # default precision the TPU compiler runs this dot in bf16 and, in a layer scan, converts the whole
    # [layers, D, E] float32 kernel stack to bf16 at every call (0.7 GB read and written a glm5 decode step,
    # to then read the bf16 copy); HIGHEST reads it in place. Not in training: the glm5 4K train step's
    # temporaries grew 54.57 -> 61.78 GiB with it (docs/scaleout.md), for the same FLOPs and bytes.
    logits = jnp.dot(x.astype(jnp.float32), router_kernel.astype(jnp.float32), precision=precision)
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias.astype(jnp.float32)
    n, e = choice.shape
    if n_group > 1:
        grouped = choice.reshape(n, n_group, e // n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)            # [N, G]
        _, top_groups = jax.lax.top_k(group_scores, topk_group)                   # [N, topk_group]
        group_keep = jnp.any(top_groups[..., None] == jnp.arange(n_group), axis=1)  # [N, G]
        keep = jnp.repeat(group_keep, e // n_group, axis=1)
        choice = jnp.where(keep, choice, NEG_INF)
    _, ids = jax.lax.top_k(choice, experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routed_scaling_factor, ids.astype(jnp.int32), scores


def _swiglu_experts(xs, gate, up, down, dot):
    return dot(jax.nn.silu(dot(xs, gate)) * dot(xs, up), down)


def ragged_experts(x, ids, gate, up, down):
    """Each token through its k experts: x [N, D], ids [N, k] -> [N, k, D] (unweighted outputs).
    Token slots sorted by expert, one `lax.ragged_dot` per projection (a grouped matmul on TPU/GPU)."""
    (n, d), k = x.shape, ids.shape[-1]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)                 # token slots grouped by expert
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    dot = lambda a, w: jax.lax.ragged_dot(a, w, sizes)
    ys = _swiglu_experts(x[order // k], gate, up, down, dot)
    return jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, d)


def expert_tile(rows: int, experts: int) -> int:
    """Tile height of `tiled_experts`: the power of two nearest rows / (8 E) in [8, 512], so that
    padding every expert's group to whole tiles adds at most ~1/8 of the rows."""
    t = max(1, rows // (8 * experts))
    return int(min(512, max(8, 1 << (t.bit_length() - 1))))


def tiled_experts(x, ids, gate, up, down, tile: int | None = None):
    """Same contract as `ragged_experts`, as dense batched matmuls: each expert's token slots are
    laid out in whole tiles of `tile` rows (zero rows pad a group's last tile), every tile is
    multiplied by its expert's weights (gathered per tile), and each slot reads its row back.
    Static shapes: N*k + E*(tile-1) rows rounded up to whole tiles, i.e. the FLOPs of the routed
    tokens plus at most E partly filled tiles (dense einsum over all experts: E/k x)."""
    (n, d), k = x.shape, ids.shape[-1]
    e = gate.shape[0]
    nk = n * k
    tile = expert_tile(nk, e) if tile is None else tile
    n_tiles = -(-(nk + e * (tile - 1)) // tile)
    flat = ids.reshape(-1)
    onehot = (flat[:, None] == jnp.arange(e)).astype(jnp.int32)               # [N*k, E]
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)         # slot's rank in its expert
    sizes = jnp.sum(onehot, axis=0)
    padded = -(-sizes // tile) * tile
    ends = jnp.cumsum(padded)
    pos = ends[flat] - padded[flat] + rank                                    # slot -> row of the tiled layout
    src = jnp.full((n_tiles * tile,), n, jnp.int32).at[pos].set(jnp.arange(nk, dtype=jnp.int32) // k,
                                                                 unique_indices=True)
    xp = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[src].reshape(n_tiles, tile, d)
    # tiles past the last group hold only zero rows; they reuse the last expert's weights
    tile_e = jnp.minimum(jnp.searchsorted(ends, jnp.arange(n_tiles) * tile, side="right"), e - 1)
    # rematerialised: the per-tile weight copies ([tiles, D, F], ~E x tiles / E the weights) are
    # gathered again in the backward pass instead of being kept as residuals of every layer
    tiled_dot = jax.checkpoint(lambda a, w, te: jnp.einsum("tmd,tdf->tmf", a, w[te]))
    dot = lambda a, w: tiled_dot(a, w, tile_e)
    yp = _swiglu_experts(xp, gate, up, down, dot).reshape(n_tiles * tile, d)
    return yp[pos].reshape(n, k, d)


class Router(nn.Module):
    """Holds the router kernel [D, E] (float32) and the selection bias; returns route()'s output."""
    num_experts: int
    cfg: dict
    stddev: float = 0.02
    cached: bool = False      # over a cache (decode / prefill): logits at HIGHEST precision (route)

    @nn.compact
    def __call__(self, x):
        e = self.num_experts
        kernel = self.param("kernel", init_normal(self.stddev, ("embed", "experts_router")), (x.shape[-1], e),
                            jnp.float32)
        # Updated by the train step from expert load (aux-loss-free balancing), never by gradients.
        bias = self.param("e_score_correction_bias",
                          nn.with_logical_partitioning(nn.initializers.zeros, ("experts_router",)), (e,), jnp.float32)
        return route(x, kernel, jax.lax.stop_gradient(bias), **self.cfg,
                     precision=jax.lax.Precision.HIGHEST if self.cached else None)


class Experts(nn.Module):
    """Routed expert weights [E, D, F] / [E, F, D] and the dropless token dispatch."""
    num_experts: int
    moe_ffn_dim: int
    impl: str = "ragged"
    stddev: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    capacity_factor: float = 1.25          # a2a only (<= 0: dropless)
    token_chunk: int = 0                   # a2a only (> 0: dispatch per chunk of this many local tokens)
    round_factor: float = 1.25             # a2a dropless only: first-round capacity (<= 0: one worst-case round)
    kernel: str = "auto"                   # a2a only: the local experts' grouped matmul (pallas_kernels.gmm)
    overflow_factor: float = 0.125         # a2a dropless only: capacity of the rounds after the first
    cached: bool = False                   # a2a, over a cache (inference only): ep's compacted token round

    @nn.compact
    def __call__(self, x, weights, ids):
        """x [N, D], weights/ids [N, k] -> [N, D]."""
        (n, d), e, f = x.shape, self.num_experts, self.moe_ffn_dim
        shapes = {"gate_proj": ((e, d, f), ("experts", "embed", "expert_mlp")),
                  "up_proj": ((e, d, f), ("experts", "embed", "expert_mlp")),
                  "down_proj": ((e, f, d), ("experts", "expert_mlp", "embed"))}
        gate, up, down = (self.param(name, init_normal(self.stddev, axes), shape, self.param_dtype).astype(self.dtype)
                          for name, (shape, axes) in shapes.items())
        if self.impl == "dense":   # every expert on every token: the simple reference, shards trivially
            combine = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], ids].add(weights)
            h = jax.nn.silu(jnp.einsum("nd,edf->enf", x, gate)) * jnp.einsum("nd,edf->enf", x, up)
            return jnp.einsum("enf,efd,ne->nd", h, down, combine.astype(self.dtype))
        if self.impl == "a2a":     # explicit expert parallelism: shard_map + all_to_all over `expert`
            from glm5_jax.parallel.ep import a2a_moe
            out, dropped, rounds = a2a_moe(x, weights, ids, gate, up, down, num_experts=e,
                                           capacity_factor=self.capacity_factor, token_chunk=self.token_chunk,
                                           round_factor=self.round_factor, overflow_factor=self.overflow_factor,
                                           kernel=self.kernel, compact=self.cached)
            self.sow("intermediates", "dropped_fraction", dropped)
            self.sow("intermediates", "a2a_rounds", rounds)
            return out
        # XLA:CPU has no grouped matmul: it expands ragged_dot into E masked dense dots (E x the
        # FLOPs; 8 experts made the routed experts a third of the tiny model's train step,
        # tools.bench_vs_hf). CPU runs the tiled grouped matmul instead; the choice is made when
        # the step is lowered, so an AOT compile for TPU from this CPU machine keeps ragged_dot.
        ys = jax.lax.platform_dependent(x, ids, gate, up, down, cpu=tiled_experts, default=ragged_experts)
        return jnp.einsum("nkd,nk->nd", ys, weights.astype(ys.dtype))


class MoE(nn.Module):
    num_experts: int
    experts_per_tok: int
    moe_ffn_dim: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    impl: str = "ragged"
    stddev: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    capacity_factor: float = 1.25
    token_chunk: int = 0
    round_factor: float = 1.25
    kernel: str = "auto"
    overflow_factor: float = 0.125
    cached: bool = False      # over a cache (decode / prefill): the router's logits at HIGHEST precision

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        xf = x.reshape(b * t, d).astype(self.dtype)
        router_cfg = dict(experts_per_tok=self.experts_per_tok, n_group=self.n_group,
                          topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                          routed_scaling_factor=self.routed_scaling_factor)
        weights, ids, _ = Router(self.num_experts, router_cfg, self.stddev, self.cached, name="router")(xf)
        self.sow("intermediates", "expert_load", jnp.bincount(ids.reshape(-1), length=self.num_experts))
        out = Experts(self.num_experts, self.moe_ffn_dim, self.impl, self.stddev, self.dtype, self.param_dtype,
                      self.capacity_factor, self.token_chunk, self.round_factor, self.kernel,
                      self.overflow_factor, self.cached, name="experts")(xf, weights, ids)
        out = constrain(out.reshape(b, t, d).astype(x.dtype), ("activation_batch", "activation_seq", "activation_embed"))
        if self.num_shared_experts:
            out = out + SwiGLU(self.moe_ffn_dim * self.num_shared_experts, self.stddev, self.dtype,
                               self.param_dtype, name="shared_experts")(x)
        return out
