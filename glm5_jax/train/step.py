"""The one train step factory: (state, batch) -> (state, metrics), jitted on a mesh.

state = {"params", "opt_state", "step", "rng"} (glm5_jax.train.state). Every program trains through
`make_train_step`: the LM loop (glm5_jax.train.loop), SFT (the same loop with its data) and the RL
update (glm5_jax.rl.program plugs its loss in). One device is the trivial mesh, so there is one
program whether it runs on a laptop or a pod.

The default loss is LM cross-entropy (+ z-loss) + the MTP loss times its weight + the DSA indexer KL
(dense warm-up or sparse stage). The MoE correction bias is updated aux-loss-free from the expert
loads the loss reports, after the optimizer step.
"""

from __future__ import annotations

import re
from typing import Callable

import chex
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax.attention.context import context_size, layout_batch
from glm5_jax.config import ModelConfig
from glm5_jax.losses import chunked_cross_entropy, cross_entropy
from glm5_jax.model import GLM5, per_layer
from glm5_jax.mtp import mtp_batch, mtp_depth_targets, mtp_loss
from glm5_jax.config import ConfigError
from glm5_jax.batch import BATCH_AXES, BATCH_KEYS
from glm5_jax.sharding import batch_sharding, single_device_mesh, use_mesh
from glm5_jax.train.config import TrainConfig
from glm5_jax.train.state import build_optimizer, state_shardings

__all__ = ["build_optimizer", "make_eval_step", "make_loss_fn", "make_monitor_fn", "make_train_step", "expert_load_metrics"]

BIAS = "e_score_correction_bias"


def _collect(inter, name):
    """{module path: value} of the intermediates sown as `name`. Inside a scanned stack the value keeps
    the stack's leading layer axis ([repeats, ...]). Several sows at one path (a shared MTP block used
    at every depth) are summed for expert_load (token counts) and averaged otherwise."""
    out = {}
    for k, v in traverse_util.flatten_dict(inter).items():
        if k[-1] == name:
            vals = jnp.stack([jnp.asarray(x) for x in v])
            out[k[:-1]] = vals.sum(0) if name == "expert_load" else vals.mean(0)
    return out


def _layer_mean(values) -> jax.Array:
    """Mean over layers of per-layer scalars given per path as scalars or [repeats] vectors."""
    return jnp.mean(jnp.concatenate([jnp.ravel(v).astype(jnp.float32) for v in values]))


def _all_finite(tree) -> jax.Array:
    """One boolean: every element of every floating leaf of `tree` is finite."""
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def expert_load_metrics(model_cfg: ModelConfig, loads) -> dict:
    """Per MoE layer (global layer index i, not averaged over layers): "expert_load_max_over_mean/layer_i"
    (the busiest expert's tokens over the layer's mean) and "dead_experts/layer_i" (experts that got no
    token this step). loads: {module path: [E] or stacked [repeats, E]} token counts (the MTP block's
    loads are left out: it is not a main layer)."""
    tree = traverse_util.unflatten_dict({tuple(k) + ("expert_load",): v for k, v in loads.items()})
    out = {}
    for i, load in sorted(per_layer(model_cfg, tree, "expert_load").items()):
        load = load.astype(jnp.float32)
        out[f"expert_load_max_over_mean/layer_{i}"] = jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)
        out[f"dead_experts/layer_{i}"] = jnp.sum(load == 0).astype(jnp.float32)
    return out


def _bias_update(params, loads, rate):
    """bias_e += rate * sign(mean load - load_e) for each MoE layer: raise the bias of under-loaded
    experts. loads: {module path: [E] or stacked [repeats, E]}; the mean is over the experts of each
    layer (last axis), never across layers."""
    flat = traverse_util.flatten_dict(params)
    for path, load in loads.items():
        key = tuple(path) + ("router", BIAS)
        bias = flat[key]
        if bias.shape != load.shape:
            raise ValueError(f"expert load {load.shape} at {'/'.join(path)} does not match its bias {bias.shape}")
        load = load.astype(jnp.float32)
        step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        flat[key] = (bias + step).astype(bias.dtype)
    return traverse_util.unflatten_dict(flat)


def make_loss_fn(model_cfg: ModelConfig, tcfg: TrainConfig):
    """loss_fn(params, batch) -> (loss, (metrics, expert loads)): the LM training loss."""
    model = GLM5(model_cfg)
    use_mtp = model_cfg.mtp_depth > 0 and tcfg.mtp_weight > 0

    def loss_fn(params, batch):
        n = context_size()
        if n > 1:   # context parallelism: the sequence in the load-balanced layout, MTP shifts built first
            batch = layout_batch(mtp_batch(batch, model_cfg.mtp_depth) if use_mtp else batch, n)
        chunked = tcfg.logits_chunk > 0
        out, state = model.apply({"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"],
                                 indexer_loss=tcfg.indexer_loss, mtp=use_mtp, mutable=["intermediates"],
                                 mtp_tokens=batch.get("mtp_tokens"), logits=not chunked, return_hidden=chunked)
        inter = state.get("intermediates", {})
        shifted = (batch["mtp_targets"], batch["mtp_mask"]) if "mtp_targets" in batch else None
        if chunked:   # the head per chunk of tokens for the main head and every MTP depth in one scan
            hs, tg, mk = [out["hidden"]], [batch["targets"]], [batch["loss_mask"]]
            for k in range(model_cfg.mtp_depth if use_mtp else 0):
                t_k, m_k = mtp_depth_targets(batch["targets"], batch["loss_mask"], batch["segment_ids"], k, shifted)
                hs.append(out["mtp_hidden"][k])
                tg.append(t_k)
                mk.append(m_k.astype(batch["loss_mask"].dtype))
            head = lambda h: model.apply({"params": params}, h, method=GLM5.head)
            ces, zs = chunked_cross_entropy(head, jnp.stack(hs), jnp.stack(tg), jnp.stack(mk),
                                            chunk=tcfg.logits_chunk, shards=n)
            ce = ces[0]
            loss = ce + (tcfg.z_loss * zs[0] if tcfg.z_loss else 0.0)
        else:
            loss, ce = cross_entropy(out["logits"], batch["targets"], batch["loss_mask"], z_loss=tcfg.z_loss)
        metrics = {"ce": ce}
        if use_mtp:
            if chunked:
                ml = jnp.mean(ces[1:])
            else:
                ml, _ = mtp_loss(out["mtp_logits"], batch["targets"], batch["loss_mask"], batch["segment_ids"],
                                 shifted=shifted)
            loss = loss + tcfg.mtp_weight * ml
            metrics["mtp_loss"] = ml
        kls = _collect(inter, "indexer_kl")
        if kls:
            kl = _layer_mean(kls.values())
            loss = loss + tcfg.indexer_loss_weight * kl
            metrics["indexer_kl"] = kl
        recalls = _collect(inter, "indexer_recall")
        if recalls:
            metrics["indexer_recall"] = _layer_mean(recalls.values())
        dropped = _collect(inter, "dropped_fraction")     # moe_impl="a2a" with a finite capacity
        if dropped:
            metrics["moe_dropped_fraction"] = _layer_mean(dropped.values())
        rounds = _collect(inter, "a2a_rounds")            # all-to-all rounds per dispatch (dropless a2a: >= 1)
        if rounds:
            metrics["moe_a2a_rounds"] = _layer_mean(rounds.values())
            metrics["moe_a2a_rounds_max"] = jnp.max(jnp.concatenate([jnp.ravel(v) for v in rounds.values()]))
        loads = _collect(inter, "expert_load")
        metrics["loss"] = loss
        return loss, (metrics, loads)

    return loss_fn


LossFn = Callable[[object, dict], tuple]


def _micro_batches(batch: dict, k: int, mesh) -> dict:
    """[B, ...] leaves -> [k, B/k, ...]: micro-batch j holds rows j, j+k, j+2k, ... Taking strided rows
    (not contiguous blocks) keeps every micro-batch spread over all the devices that hold the batch,
    so each scan iteration works on every device without moving rows between them."""
    def split(x):
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, BATCH_AXES)))
    return jax.tree_util.tree_map(split, batch)


def accumulated_value_and_grad(loss_fn: LossFn, k: int, mesh):
    """(params, batch) -> ((loss, (metrics, loads)), grads) over k micro-batches, one at a time
    (lax.scan: activations of one micro-batch live at once).

    Gradients and metrics are float32 averages weighted by each micro-batch's loss_mask token count
    (equal weights without a loss_mask), so a token-mean loss gets exactly the full batch's gradient;
    expert loads (token counts) are summed. k == 1 is the plain value_and_grad."""
    vg = jax.value_and_grad(loss_fn, has_aux=True)
    if k == 1:
        return vg

    def run(params, batch):
        micro = _micro_batches(batch, k, mesh)
        if "loss_mask" in micro:
            w = jnp.sum(micro["loss_mask"].astype(jnp.float32).reshape(k, -1), axis=1)
            total = jnp.sum(w)
            w = jnp.where(total > 0, w / jnp.maximum(total, 1e-9), 1.0 / k)
        else:
            w = jnp.full((k,), 1.0 / k, jnp.float32)
        first = jax.tree_util.tree_map(lambda x: x[0], micro)
        (_, (m_shape, l_shape)), g_shape = jax.eval_shape(vg, params, first)
        f32_zeros = lambda t: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, jnp.float32), t)
        zeros = (f32_zeros(g_shape), f32_zeros(m_shape), jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), l_shape))

        def body(carry, xs):
            mb, wj = xs
            (_, (metrics, loads)), grads = vg(params, mb)
            g_acc, m_acc, l_acc = carry
            add_w = lambda a, b: a + wj * b.astype(jnp.float32)
            return (jax.tree_util.tree_map(add_w, g_acc, grads), jax.tree_util.tree_map(add_w, m_acc, metrics),
                    jax.tree_util.tree_map(jnp.add, l_acc, loads)), None

        (grads, metrics, loads), _ = jax.lax.scan(body, zeros, (micro, w))
        grads = jax.tree_util.tree_map(lambda g, s: g.astype(s.dtype), grads, g_shape)
        return (metrics["loss"], (metrics, loads)), grads

    return run


def _spike_guard(window, loss, grad_norm, finite, k):
    """MaxText-style spike skipping: -> (spike, new window). A finite step is a spike when the window is
    full and its loss or gradient norm is above mean + k * std of the window (the last W applied steps);
    an applied step (finite, no spike) enters the window, a skipped one does not."""
    w = window["loss"].shape[0]

    def above(x, buf):
        mean = jnp.mean(buf)
        return x > mean + k * jnp.sqrt(jnp.mean(jnp.square(buf - mean)))

    loss, grad_norm = loss.astype(jnp.float32), grad_norm.astype(jnp.float32)
    spike = finite & (window["count"] >= w) & (above(loss, window["loss"]) | above(grad_norm, window["grad_norm"]))
    keep = finite & ~spike
    at = window["count"] % w
    put = lambda buf, x: jnp.where(keep, buf.at[at].set(x), buf)
    return spike, {"loss": put(window["loss"], loss), "grad_norm": put(window["grad_norm"], grad_norm),
                   "count": window["count"] + keep.astype(jnp.int32)}


def make_train_step(model_cfg: ModelConfig, tcfg: TrainConfig, tx: optax.GradientTransformation, mesh=None, *,
                    loss_fn: LossFn | None = None):
    """step(state, batch) -> (state, metrics), jitted on `mesh` (default: the trivial 1-device mesh).

    The state comes in and goes out with its shardings (glm5_jax.train.state.state_shardings) and is
    donated; every batch leaf is split on its first axis over (data, fsdp, expert). The step is traced
    under the mesh and the logical rules, so the model's activation constraints apply.
    loss_fn(params, batch) -> (loss, (metrics, expert loads {module path: [E] or [repeats, E]})):
    default make_loss_fn(model_cfg, tcfg); the RL loss plugs in here (glm5_jax.rl.program).
    After the optimizer update the MoE correction biases move aux-loss-free (tcfg.bias_update_rate)
    from the reported loads (a frozen router, per tcfg.trainable_pattern, keeps its bias).
    metrics: the loss's metrics + grad_norm, update_norm, skipped (+ expert_load_max_over_mean and per
    layer expert_load_max_over_mean/layer_i, dead_experts/layer_i with MoE).
    Non-finite guard: when the loss, the gradient norm, the update or the new params / optimizer state
    hold a NaN or inf, the step keeps the old params and optimizer state (step and rng advance) and
    reports skipped = 1; the loop then stops or goes on (TrainConfig.nonfinite). With tcfg.spike_window = W
    the state also carries the last W applied steps' loss and grad norm (state["spike"]), and a finite step
    whose loss or grad norm exceeds their mean + tcfg.spike_k * std is not applied either (spike = 1).
    tcfg.grad_accum > 1 splits the batch into that many micro-batches (accumulated_value_and_grad): one
    optimizer update from their token-weighted mean gradient, the same update as the whole batch at once.
    The returned callable has .jitted, .lower(state, batch), .shardings, .batch_sharding, .mesh.
    """
    mesh = single_device_mesh() if mesh is None else mesh
    if loss_fn is not None and mesh.shape.get("context", 1) > 1:
        raise ConfigError(f"mesh {dict(mesh.shape)}: context parallelism runs the LM loss (make_loss_fn) only; a "
                          "custom loss (RL, distillation) would see the sequence in the context layout. Use context:1")
    lm_batch = loss_fn is None      # the LM loss reads [B, T] batches; RL / reward-model losses bring their own
    loss_fn = make_loss_fn(model_cfg, tcfg) if loss_fn is None else loss_fn
    pat = re.compile(tcfg.trainable_pattern) if tcfg.trainable_pattern else None
    shards = 1
    for a in BATCH_AXES:
        shards *= mesh.shape.get(a, 1)
    if tcfg.grad_accum > 1 and (tcfg.batch_size // tcfg.grad_accum) % shards:
        raise ConfigError(
            f"TrainConfig.batch_size={tcfg.batch_size} / grad_accum={tcfg.grad_accum} = "
            f"{tcfg.batch_size // tcfg.grad_accum} rows per micro-batch is not divisible by data*fsdp*expert = "
            f"{shards} (mesh {dict(mesh.shape)}): every micro-batch is split over all batch devices")
    value_and_grad = accumulated_value_and_grad(loss_fn, tcfg.grad_accum, mesh)

    def train_step(state, batch):
        # the batch at the step's boundary (checked while tracing, so free at run time): the token-level
        # leaves it holds (BATCH_KEYS) share one shape, [B, T] for the LM loss ([B, 2, T] reward-model pairs,
        # other keys for RL); token ids are integers
        token_level = [batch[k] for k in BATCH_KEYS if k in batch]
        chex.assert_equal_shape(token_level)
        if lm_batch:
            chex.assert_rank(token_level, 2)
        if "tokens" in batch:
            chex.assert_type(batch["tokens"], int)
        (_, (metrics, loads)), grads = value_and_grad(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = dict(metrics)
        if loads:
            if tcfg.bias_update_rate:
                upd = {k: v for k, v in loads.items() if pat is None or pat.search("/".join(k + ("router", BIAS)))}
                params = _bias_update(params, upd, tcfg.bias_update_rate)
            metrics["expert_load_max_over_mean"] = _layer_mean(
                [jnp.max(l, axis=-1) / jnp.maximum(jnp.mean(l.astype(jnp.float32), axis=-1), 1e-9)
                 for l in loads.values()])
            metrics.update(expert_load_metrics(model_cfg, loads))
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["update_norm"] = optax.tree.norm(updates)
        rng, _ = jax.random.split(state["rng"])
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}
        # the non-finite guard: a step whose loss, gradient, update or new parameters hold a NaN/inf is
        # not applied (params and optimizer state stay as they were; step and rng advance, so the data
        # and the PRNG stream go on exactly as in a run without the bad step)
        ok = _all_finite((metrics["loss"], metrics["grad_norm"], metrics["update_norm"], params, opt_state))
        apply = ok
        if tcfg.spike_window:
            spike, new["spike"] = _spike_guard(state["spike"], metrics["loss"], metrics["grad_norm"], ok, tcfg.spike_k)
            apply = ok & ~spike
            metrics["spike"] = spike.astype(jnp.float32)
        new["params"], new["opt_state"] = jax.tree_util.tree_map(
            lambda a, b: jnp.where(apply, a, b), (params, opt_state), (state["params"], state["opt_state"]))
        metrics["skipped"] = 1.0 - ok.astype(jnp.float32)
        return new, metrics

    sh = state_shardings(model_cfg, tcfg, mesh, tx)
    bsh = batch_sharding(mesh)
    jitted = jax.jit(train_step, in_shardings=(sh, bsh), out_shardings=(sh, None), donate_argnums=(0,))

    def step(state, batch):
        with use_mesh(mesh):
            return jitted(state, batch)

    def lower(state, batch):
        with use_mesh(mesh):
            return jitted.lower(state, batch)

    step.jitted, step.lower, step.shardings, step.batch_sharding, step.mesh = jitted, lower, sh, bsh, mesh
    return step


def make_eval_step(model_cfg: ModelConfig):
    model = GLM5(model_cfg)

    def eval_step(params, batch):
        logits = model.apply({"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"])["logits"]
        mask = batch["loss_mask"].astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
        return jnp.sum((lse - tgt) * mask), jnp.sum(mask), jnp.argmax(logits, axis=-1)

    return jax.jit(eval_step)


def make_monitor_fn(model_cfg: ModelConfig):
    """Jitted (params, batch) -> {"max_attn_logit/layer_i": max |q.k|*scale of main layer i,
    "max_attn_logit": max over layers}: one forward pass with the logit monitor on (no gradients)."""
    model = GLM5(model_cfg)

    def monitor(params, batch):
        _, state = model.apply({"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"],
                               monitor_logits=True, mutable=["intermediates"])
        layers = per_layer(model_cfg, state.get("intermediates", {}), "max_attn_logit")
        out = {f"max_attn_logit/layer_{i}": v for i, v in sorted(layers.items())}
        if layers:
            out["max_attn_logit"] = jnp.max(jnp.stack(list(layers.values())))
        return out

    return jax.jit(monitor)
