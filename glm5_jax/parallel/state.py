"""The train state on a mesh: shardings, abstract (allocation-free) shapes, initialisation and a
train step whose inputs and outputs keep those shardings.

Parameter shardings come from the logical names (glm5_jax.sharding.LOGICAL_RULES). Optimizer-state
leaves take the sharding of the parameter they mirror (matched by the trailing dict-key path and the
shape: AdamW mu/nu, Muon momentum); everything else (counts, scalars) is replicated.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.tree_util import DictKey

from glm5_jax.config import ModelConfig
from glm5_jax.model import abstract_params, init_params
from glm5_jax.sharding import LOGICAL_RULES, MESH_AXES, logical_specs, use_mesh
from glm5_jax.train.config import TrainConfig
from glm5_jax.train.step import build_optimizer, make_train_step

BATCH_KEYS = ("tokens", "targets", "positions", "segment_ids", "loss_mask")


@functools.lru_cache(maxsize=16)
def abstract_param_shapes(model_cfg: ModelConfig):
    return nn.unbox(abstract_params(model_cfg))


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
    """PartitionSpec for every optimizer-state leaf: the mirrored parameter's spec, else replicated."""
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


def state_specs(model_cfg: ModelConfig, tcfg: TrainConfig, tx=None):
    """(PartitionSpec pytree of the state, tx, abstract state without shardings)."""
    params = abstract_param_shapes(model_cfg)
    if tx is None:
        tx, _ = build_optimizer(model_cfg, tcfg, params)
    opt = jax.eval_shape(tx.init, params)
    pspecs = param_specs(model_cfg)
    specs = {"params": pspecs, "opt_state": opt_state_specs(params, pspecs, opt), "step": P(), "rng": P()}
    abstract = {"params": params, "opt_state": opt, "step": jax.ShapeDtypeStruct((), jnp.int32),
                "rng": jax.eval_shape(lambda: jax.random.PRNGKey(0))}
    return specs, tx, abstract


def state_shardings(model_cfg: ModelConfig, tcfg: TrainConfig, mesh, tx=None):
    specs, tx, _ = state_specs(model_cfg, tcfg, tx)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def abstract_state(model_cfg: ModelConfig, tcfg: TrainConfig, mesh, tx=None):
    """ShapeDtypeStructs carrying the mesh's shardings (mesh may be a jax.sharding.AbstractMesh)."""
    specs, tx, abstract = state_specs(model_cfg, tcfg, tx)
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        abstract, specs, is_leaf=lambda x: isinstance(x, P)), tx


def batch_spec() -> P:
    return P(("data", "fsdp", "expert"))


def abstract_batch(batch_size: int, seq_len: int, mesh):
    sh = NamedSharding(mesh, batch_spec())
    return {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32 if k == "loss_mask" else jnp.int32,
                                    sharding=sh) for k in BATCH_KEYS}


def init_sharded_state(model_cfg: ModelConfig, tcfg: TrainConfig, mesh, *, params=None, tx=None, seed=None):
    """The train state laid out on `mesh` (params from `params` or initialised from the seed)."""
    seed = tcfg.seed if seed is None else seed
    rng = jax.random.PRNGKey(seed)
    if params is None:
        params = init_params(model_cfg, jax.random.fold_in(rng, 1))
    if tx is None:
        tx, _ = build_optimizer(model_cfg, tcfg, params)
    sh = state_shardings(model_cfg, tcfg, mesh, tx)
    params = jax.tree_util.tree_map(lambda x, s: jax.device_put(jnp.array(x, copy=True), s), params, sh["params"])
    opt = jax.jit(tx.init, out_shardings=sh["opt_state"])(params)
    state = {"params": params, "opt_state": opt,
             "step": jax.device_put(jnp.zeros((), jnp.int32), sh["step"]),
             "rng": jax.device_put(jax.random.fold_in(rng, 2), sh["rng"])}
    return state, tx


def make_sharded_train_step(model_cfg: ModelConfig, tcfg: TrainConfig, tx, mesh):
    """fn(state, batch) -> (state, metrics): jitted with the state's shardings in and out (donated),
    the batch sharded over (data, fsdp, expert), traced under the mesh and logical rules."""
    inner = make_train_step(model_cfg, tcfg, tx)
    inner = getattr(inner, "__wrapped__", inner)
    sh = state_shardings(model_cfg, tcfg, mesh, tx)
    bsh = {k: NamedSharding(mesh, batch_spec()) for k in BATCH_KEYS}
    step = jax.jit(inner, in_shardings=(sh, bsh), out_shardings=(sh, None), donate_argnums=(0,))

    def run(state, batch):
        with use_mesh(mesh):
            return step(state, batch)

    run.jitted = step
    run.shardings = sh
    return run


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs/arrays with NamedShardings (max over
    devices of the shard sizes; uneven shards are rounded up as XLA pads them)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


__all__ = ["MESH_AXES", "abstract_state", "abstract_batch", "batch_spec", "init_sharded_state",
           "make_sharded_train_step", "opt_state_specs", "param_specs", "per_device_bytes", "state_shardings",
           "state_specs"]
