"""The jitted train and eval steps: (state, batch) -> (state, metrics).

state = {"params", "opt_state", "step", "rng"}. The loss is LM cross-entropy (+ z-loss) + the MTP loss
times its weight + the DSA indexer KL (dense warm-up or sparse stage). The MoE correction bias is
updated aux-loss-free from expert load after the optimizer step.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from glm5_jax.config import ModelConfig
from glm5_jax.losses import cross_entropy, mtp_loss
from glm5_jax.model import GLM5
from glm5_jax.optim import make_optimizer
from glm5_jax.train.config import TrainConfig


def build_optimizer(model_cfg: ModelConfig, tcfg: TrainConfig, params):
    trainable = None
    if tcfg.trainable_pattern:
        pat = re.compile(tcfg.trainable_pattern)
        trainable = lambda path: bool(pat.search(path))
    return make_optimizer(tcfg.optimizer, params, learning_rate=tcfg.learning_rate, weight_decay=tcfg.weight_decay,
                          split_spec=model_cfg if tcfg.optimizer == "muon_split" else None,
                          grad_clip=tcfg.grad_clip or None, warmup_steps=min(tcfg.warmup_steps, tcfg.steps),
                          total_steps=tcfg.steps, min_lr_ratio=tcfg.min_lr_ratio, trainable=trainable)


def _collect(inter, name):
    flat = traverse_util.flatten_dict(inter)
    return {k[:-1]: sum(v) / len(v) if name != "expert_load" else sum(v) for k, v in flat.items() if k[-1] == name}


def _bias_update(params, loads, rate):
    """bias_e += rate * sign(mean load - load_e): raise the bias of under-loaded experts."""
    flat = traverse_util.flatten_dict(params)
    for path, load in loads.items():
        key = tuple(path) + ("router", "e_score_correction_bias")
        load = load.astype(jnp.float32)
        flat[key] = flat[key] + rate * jnp.sign(jnp.mean(load) - load)
    return traverse_util.unflatten_dict(flat)


def make_loss_fn(model_cfg: ModelConfig, tcfg: TrainConfig):
    model = GLM5(model_cfg)
    use_mtp = model_cfg.mtp_depth > 0 and tcfg.mtp_weight > 0

    def loss_fn(params, batch):
        out, state = model.apply({"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"],
                                 indexer_loss=tcfg.indexer_loss, mtp=use_mtp, mutable=["intermediates"])
        inter = state.get("intermediates", {})
        loss, ce = cross_entropy(out["logits"], batch["targets"], batch["loss_mask"], z_loss=tcfg.z_loss)
        metrics = {"ce": ce}
        if use_mtp:
            ml, _ = mtp_loss(out["mtp_logits"], batch["targets"], batch["loss_mask"], batch["segment_ids"])
            loss = loss + tcfg.mtp_weight * ml
            metrics["mtp_loss"] = ml
        kls = _collect(inter, "indexer_kl")
        if kls:
            kl = jnp.mean(jnp.stack(list(kls.values())))
            loss = loss + tcfg.indexer_loss_weight * kl
            metrics["indexer_kl"] = kl
        recalls = _collect(inter, "indexer_recall")
        if recalls:
            metrics["indexer_recall"] = jnp.mean(jnp.stack(list(recalls.values())))
        dropped = _collect(inter, "dropped_fraction")     # moe_impl="a2a" with a finite capacity
        if dropped:
            metrics["moe_dropped_fraction"] = jnp.mean(jnp.stack(list(dropped.values())))
        loads = _collect(inter, "expert_load")
        metrics["loss"] = loss
        return loss, (metrics, loads)

    return loss_fn


def make_train_step(model_cfg: ModelConfig, tcfg: TrainConfig, tx: optax.GradientTransformation):
    loss_fn = make_loss_fn(model_cfg, tcfg)

    def train_step(state, batch):
        (_, (metrics, loads)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        if loads:
            if tcfg.bias_update_rate:
                if tcfg.trainable_pattern:     # a frozen router keeps its bias too
                    pat = re.compile(tcfg.trainable_pattern)
                    loads_upd = {k: v for k, v in loads.items()
                                 if pat.search("/".join(k + ("router", "e_score_correction_bias")))}
                else:
                    loads_upd = loads
                params = _bias_update(params, loads_upd, tcfg.bias_update_rate)
            imbalance = [jnp.max(l) / jnp.maximum(jnp.mean(l.astype(jnp.float32)), 1e-9) for l in loads.values()]
            metrics["expert_load_max_over_mean"] = jnp.mean(jnp.stack(imbalance))
        metrics["grad_norm"] = optax.tree.norm(grads)
        rng, _ = jax.random.split(state["rng"])
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}, metrics

    return jax.jit(train_step, donate_argnums=(0,))


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
        flat = traverse_util.flatten_dict(state.get("intermediates", {}))
        per_layer = {k[0]: jnp.max(jnp.stack(v)) for k, v in flat.items() if k[-1] == "max_attn_logit"}
        out = {f"max_attn_logit/{k}": v for k, v in per_layer.items()}
        if per_layer:
            out["max_attn_logit"] = jnp.max(jnp.stack(list(per_layer.values())))
        return out

    return jax.jit(monitor)
