"""The train state on a mesh: its shardings, its abstract shapes, and creating it directly sharded.

state = {"params", "opt_state", "step", "rng"}. Parameter shardings come from the logical axis names
(glm5_jax.sharding.LOGICAL_RULES); every optimizer-state leaf takes the sharding of the parameter it
mirrors (mu/nu/momentum), anything else (step counts) is replicated. One device is the trivial mesh.
The same functions serve the train step, the checkpoints (restore onto these shardings) and the
memory planner (abstract shapes on an AbstractMesh).

Starting weights: with `TrainConfig.init_from=PATH` an init_train_state called without `params` reads
them from the checkpoint at PATH (Hugging Face folder or params checkpoint, glm5_jax.train.checkpoint.
load_params) straight onto the state's shardings instead of initialising from the seed. This is how
`experiments.run --init_from` reaches any experiment: it sets init_from on every TrainConfig of the
experiment's config, so each train() call of a fresh run (no checkpoint in its workdir, init_params None)
starts from those weights.
"""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.tree_util import DictKey

from glm5_jax.batch import BATCH_KEYS
from glm5_jax.config import ModelConfig
from glm5_jax.model import init_params, layer_slice_paths
from glm5_jax.optim import make_optimizer
from glm5_jax.sharding import LOGICAL_RULES, batch_spec, logical_specs, single_device_mesh, use_mesh
from glm5_jax.train.checkpoint import abstract_param_shapes, load_params
from glm5_jax.train.config import TrainConfig


def build_optimizer(model_cfg: ModelConfig, tcfg: TrainConfig, params):
    """(tx, labels) of the run's optimizer (glm5_jax.optim.make_optimizer with the TrainConfig's
    settings). `params` may be abstract (shapes only)."""
    trainable = None
    if tcfg.trainable_pattern:
        pat = re.compile(tcfg.trainable_pattern)
        trainable = lambda path: bool(pat.search(path))
    return make_optimizer(tcfg.optimizer, params, learning_rate=tcfg.schedule(), weight_decay=tcfg.weight_decay,
                          split_spec=model_cfg if tcfg.optimizer == "muon_split" else None,
                          grad_clip=tcfg.grad_clip or None, warmup_steps=min(tcfg.warmup_steps, tcfg.steps),
                          total_steps=tcfg.steps, min_lr_ratio=tcfg.min_lr_ratio, trainable=trainable,
                          slice_paths=functools.partial(layer_slice_paths, model_cfg),
                          param_specs=param_specs(model_cfg))  # Muon: NS where each matrix's shards live


@functools.lru_cache(maxsize=16)
@functools.lru_cache(maxsize=16)
def _logical_specs(model_cfg: ModelConfig):
    return logical_specs(model_cfg)


def param_specs(model_cfg: ModelConfig, rules=LOGICAL_RULES):
    """PartitionSpec (mesh axes) pytree of the params."""
    return nn.logical_to_mesh(_logical_specs(model_cfg), rules)


def _dict_suffix(path) -> tuple:
    out = []
    for k in reversed(path):
        if not isinstance(k, DictKey):
            break
        out.append(k.key)
    return tuple(reversed(out))


def opt_state_specs(params_abstract, specs, opt_abstract):
    """PartitionSpec for every optimizer-state leaf: the mirrored parameter's spec, else replicated.

    An optimizer leaf mirrors a parameter when the trailing dict keys of its path are the parameter's
    path and the shapes agree (optax nests the param tree inside its state tuples)."""
    flat_p = {tuple(k.key for k in path): (leaf.shape, spec) for (path, leaf), spec in zip(
        jax.tree_util.tree_flatten_with_path(params_abstract)[0],
        jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P)))}

    def pick(path, leaf):
        suffix = _dict_suffix(path)
        for i in range(len(suffix)):
            hit = flat_p.get(suffix[i:])
            if hit is not None and hit[0] == tuple(leaf.shape):
                return hit[1]
        return P()

    return jax.tree_util.tree_map_with_path(pick, opt_abstract)


def state_specs(model_cfg: ModelConfig, tcfg: TrainConfig | None, tx=None):
    """(PartitionSpec pytree of the state, tx, abstract state without shardings). tx defaults to
    build_optimizer(model_cfg, tcfg); with tx given, tcfg is not needed."""
    params = abstract_param_shapes(model_cfg)
    if tx is None:
        if tcfg is None:
            raise ValueError("state_specs needs tcfg (to build the optimizer) or tx")
        tx, _ = build_optimizer(model_cfg, tcfg, params)
    opt = jax.eval_shape(tx.init, params)
    pspecs = param_specs(model_cfg)
    specs = {"params": pspecs, "opt_state": opt_state_specs(params, pspecs, opt), "step": P(), "rng": P()}
    abstract = {"params": params, "opt_state": opt, "step": jax.ShapeDtypeStruct((), jnp.int32),
                "rng": jax.eval_shape(lambda: jax.random.PRNGKey(0))}
    if getattr(tcfg, "spike_window", 0):     # the spike guard's window (glm5_jax.train.step), replicated
        specs["spike"] = {"loss": P(), "grad_norm": P(), "count": P()}
        abstract["spike"] = jax.eval_shape(lambda: spike_window_init(tcfg.spike_window))
    return specs, tx, abstract


def spike_window_init(window: int) -> dict:
    """The spike guard's state: the last `window` applied steps' loss and grad norm (a ring) and how many
    steps were recorded."""
    return {"loss": jnp.zeros((window,), jnp.float32), "grad_norm": jnp.zeros((window,), jnp.float32),
            "count": jnp.zeros((), jnp.int32)}


def _named(mesh, specs):
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def state_shardings(model_cfg: ModelConfig, tcfg: TrainConfig | None, mesh, tx=None):
    """NamedSharding pytree of the train state on `mesh`."""
    specs, _, _ = state_specs(model_cfg, tcfg, tx)
    return _named(mesh, specs)


def abstract_state(model_cfg: ModelConfig, tcfg: TrainConfig | None, mesh, tx=None):
    """(ShapeDtypeStructs carrying the mesh's shardings, tx); mesh may be a jax.sharding.AbstractMesh.
    Also the restore target of a checkpoint on `mesh` (orbax reads just each device's slices)."""
    specs, tx, abstract = state_specs(model_cfg, tcfg, tx)
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        abstract, specs, is_leaf=lambda x: isinstance(x, P)), tx


def abstract_batch(batch_size: int, seq_len: int, mesh):
    sh = NamedSharding(mesh, batch_spec())
    return {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32 if k == "loss_mask" else jnp.int32,
                                    sharding=sh) for k in BATCH_KEYS}


def init_train_state(model_cfg: ModelConfig, tcfg: TrainConfig | None, mesh=None, tx=None, params=None,
                     seed: int | None = None):
    """(state, tx): the train state created directly on `mesh`'s shardings (default: one device).

    Without `params` the parameters are initialised from the seed inside one jit whose out_shardings
    are the state's, so no device ever holds a whole unsharded copy. With `params` (host or device
    arrays) each leaf is copied onto its sharding (a copy: the train step donates the state). Without
    `params` and with `tcfg.init_from`, the params are read from that checkpoint onto their shardings.
    """
    mesh = single_device_mesh() if mesh is None else mesh
    seed = (tcfg.seed if tcfg is not None else 0) if seed is None else seed
    specs, tx, _ = state_specs(model_cfg, tcfg, tx)
    sh = _named(mesh, specs)
    rng = jax.random.PRNGKey(seed)
    spike = getattr(tcfg, "spike_window", 0)

    def rest():
        out = {"step": jnp.zeros((), jnp.int32), "rng": jax.random.fold_in(rng, 2)}
        if spike:
            out["spike"] = spike_window_init(tcfg.spike_window)
        return out

    other_sh = {k: sh[k] for k in ("step", "rng", "spike") if k in sh}
    if params is None and getattr(tcfg, "init_from", None):
        fresh = jax.device_put(load_params(tcfg.init_from, model_cfg, mesh), sh["params"])  # no-op: already there
        with use_mesh(mesh):       # freshly read arrays nobody else holds: the step may donate them as they are
            opt = jax.jit(tx.init, out_shardings=sh["opt_state"])(fresh)
            other = jax.jit(rest, out_shardings=other_sh)()
        return {"params": fresh, "opt_state": opt, **other}, tx
    with use_mesh(mesh):
        if params is None:
            def init():
                p = init_params(model_cfg, jax.random.fold_in(rng, 1))
                return {"params": p, "opt_state": tx.init(p), **rest()}
            return jax.jit(init, out_shardings=sh)(), tx
        # device_put moves any source layout onto the shardings; the compiled copy then guarantees fresh
        # buffers (jax 0.10.2's device_put keeps the source buffer as one shard of a replicated target
        # even with may_alias=False, and the step's donation would delete the caller's arrays)
        params = jax.jit(lambda t: jax.tree_util.tree_map(jnp.copy, t), out_shardings=sh["params"])(
            jax.device_put(params, sh["params"]))
        opt = jax.jit(tx.init, out_shardings=sh["opt_state"])(params)
        other = jax.jit(rest, out_shardings=other_sh)()
    return {"params": params, "opt_state": opt, **other}, tx


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs/arrays with NamedShardings (max over
    devices of the shard sizes; uneven shards are rounded up as XLA pads them)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


__all__ = ["BATCH_KEYS", "abstract_batch", "abstract_param_shapes", "abstract_state", "build_optimizer",
           "init_train_state", "opt_state_specs", "param_specs", "per_device_bytes", "state_shardings",
           "state_specs"]
