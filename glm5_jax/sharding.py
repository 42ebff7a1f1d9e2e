"""Meshes and the one table that maps logical axis names to mesh axes.

Every parameter carries logical names (see BUILD_NOTES.md); `LOGICAL_RULES` maps them onto the mesh
axes (data, fsdp, expert, context, tensor). The same model code runs on 1 CPU, 8 fake CPU devices and a pod.

`context` splits the sequence axis of activations (context parallelism: glm5_jax.attention.context
runs attention over the sequence shards); for parameters it joins fsdp (a weight's embed / latent dim
is sharded over fsdp x expert x context), so adding a context axis never replicates weights.
"""

from __future__ import annotations

import contextlib
import math
from typing import Mapping

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from glm5_jax.config import ModelConfig
from glm5_jax.errors import Glm5Error
from glm5_jax.model import abstract_params
from glm5_jax.batch import BATCH_AXES   # the batch dim is split over all three (activation_batch)

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")

LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_seq", "context"),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    # parameters. flax takes the rules in order and skips one whose mesh axes a dim of the same
    # parameter already uses, so a name may list fallbacks: `experts` claims `expert` first, then
    # `embed` spreads every non-expert weight over fsdp x expert x context (all chips of such a
    # mesh) and an expert kernel's embed dim falls back to fsdp x context (tools.aot, docs/scaleout.md)
    ("vocab", "tensor"),
    ("experts", "expert"),
    ("embed", ("fsdp", "expert", "context")),
    ("embed", ("fsdp", "context")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("q_lora", ("fsdp", "expert", "context")),   # the up-projections [latent, heads*dim] shard their
    ("q_lora", ("fsdp", "context")),             # latent dim; [embed, latent] kernels already use
    ("kv_lora", ("fsdp", "expert", "context")),  # those axes for embed
    ("kv_lora", ("fsdp", "context")),
    ("mlp", "tensor"),
    ("expert_mlp", "tensor"),
    ("experts_router", None),
    ("index_heads", None),
    ("index_heads_w", None),
    ("index_dim", None),
    ("norm", None),
    ("mtp_in", None),
)


# Serving (glm5_jax.serve): attention data-parallel, experts expert-parallel (docs/inference.md, "Sharding
# for serving"). MLA keeps one latent KV row per token for all heads, so each sequence's cache rows live on
# one batch shard and the attention weights are replicated (or split over `tensor`); a decode step never
# gathers a weight, unlike LOGICAL_RULES' ZeRO-3 layout whose every step all-gathers the parameters.
# The cache's batch axis spreads over the batch axes (the engine's slots are pinned to their shard).
SERVE_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("activation_batch", BATCH_AXES),
    ("activation_seq", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("cache_batch", BATCH_AXES),
    ("cache_seq", None),
    ("vocab", "tensor"),
    ("experts", "expert"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert_mlp", "tensor"),
    ("embed", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("experts_router", None),
    ("index_heads", None),
    ("index_heads_w", None),
    ("index_dim", None),
    ("norm", None),
    ("mtp_in", None),
)
SERVE_AXES = BATCH_AXES + ("tensor",)     # the mesh axes a serving mesh may use (no context parallelism yet)


class MeshError(Glm5Error):
    """The requested mesh does not fit the devices or the model."""


def parse_mesh_spec(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """'fsdp:64,expert:4' or {'fsdp': 64} -> sizes for all five axes (unnamed axes get 1, -1 = fill)."""
    if spec is None or spec == "":
        sizes = {}
    elif isinstance(spec, str):
        sizes = {}
        for part in spec.split(","):
            if ":" not in part:
                raise MeshError(f"mesh entry {part!r} must look like AXIS:N; axes: {', '.join(MESH_AXES)}")
            name, n = part.split(":", 1)
            sizes[name.strip()] = int(n)
    else:
        sizes = dict(spec)
    for name, n in sizes.items():
        if name not in MESH_AXES:
            raise MeshError(f"unknown mesh axis {name!r}; allowed: {', '.join(MESH_AXES)}")
        if n == 0 or n < -1:
            raise MeshError(f"mesh axis {name}={n}: sizes must be >= 1, or -1 to fill the remaining devices")
    if sum(1 for n in sizes.values() if n == -1) > 1:
        raise MeshError(f"mesh {sizes}: at most one axis may be -1")
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def resolve_mesh_shape(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    sizes = dict(sizes)
    fixed = math.prod(n for n in sizes.values() if n != -1)
    if -1 in sizes.values():
        if num_devices % fixed:
            raise MeshError(f"mesh {sizes}: the fixed axes ({fixed} devices) do not divide {num_devices} devices")
        sizes = {a: (num_devices // fixed if n == -1 else n) for a, n in sizes.items()}
    total = math.prod(sizes.values())
    if total != num_devices:
        raise MeshError(f"mesh {sizes} needs {total} devices but {num_devices} are available")
    return sizes


def make_mesh(spec: str | Mapping[str, int] | None = None, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(parse_mesh_spec(spec), len(devices))
    arr = np.asarray(devices).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


PARAM_AXES = ("fsdp", "expert", "context")   # the axes a weight's embed / latent dim is split over


def check_model_fits_mesh(config: ModelConfig, sizes: Mapping[str, int], batch_size: int | None = None,
                          seq_len: int | None = None) -> None:
    """Raise MeshError naming the first model dimension (or batch size / sequence length) the mesh
    does not divide."""
    sizes = {a: sizes.get(a, 1) for a in MESH_AXES}
    # non-expert weights spread embed / q_lora / kv_lora over fsdp x expert x context (LOGICAL_RULES);
    # expert kernels over fsdp x context, which divides the full product whenever that divides
    checks = [("num_heads", config.num_heads, "tensor"), ("d_model", config.d_model, PARAM_AXES)]
    if config.num_experts:
        checks += [("num_experts", config.num_experts, "expert"), ("moe_ffn_dim", config.moe_ffn_dim, "tensor")]
    checks += [("ffn_dim", config.ffn_dim, "tensor"), ("vocab_size", config.vocab_size, "tensor")]
    if not config.is_mla:
        checks.append(("num_kv_heads", config.num_kv_heads, "tensor"))
    else:
        checks += [("q_lora_rank", config.q_lora_rank, PARAM_AXES),
                   ("kv_lora_rank", config.kv_lora_rank, PARAM_AXES)]
    for field, value, axes in checks:
        axes = (axes,) if isinstance(axes, str) else axes
        n = math.prod(sizes[a] for a in axes)
        if value % n:
            raise MeshError(f"ModelConfig.{field}={value} is not divisible by mesh axes {'*'.join(axes)}={n} "
                            f"(mesh {dict(sizes)})")
    if batch_size is not None:
        shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
        if batch_size % shards:
            raise MeshError(f"batch size {batch_size} is not divisible by data*fsdp*expert = {shards} "
                            f"(mesh {dict(sizes)}; the batch is split over all three)")
    if seq_len is not None and sizes["context"] > 1 and seq_len % (2 * sizes["context"]):
        raise MeshError(f"seq_len {seq_len} is not divisible by 2*context = {2 * sizes['context']} (mesh "
                        f"{dict(sizes)}; context parallelism splits each sequence into 2*context equal chunks, "
                        "device i holding chunks i and 2*context-1-i)")


def logical_specs(config: ModelConfig):
    """PartitionSpec pytree of logical names for every parameter."""
    return nn.get_partition_spec(abstract_params(config))


def param_shardings(config: ModelConfig, mesh: Mesh, rules=LOGICAL_RULES):
    """NamedSharding pytree for the params of `config` on `mesh` (rules: LOGICAL_RULES for training,
    SERVE_RULES for serving)."""
    return nn.logical_to_mesh_sharding(logical_specs(config), mesh, rules)


def check_serving_mesh(config: ModelConfig, mesh: Mesh, max_batch: int) -> int:
    """Raise MeshError unless `mesh` can serve `config` with `max_batch` cache slots; -> the number of batch
    shards (slots per shard = max_batch / shards)."""
    sizes = dict(mesh.shape)
    bad = [a for a in MESH_AXES if a not in SERVE_AXES and sizes.get(a, 1) > 1]
    if bad:
        raise MeshError(f"serving mesh {sizes}: axis {bad[0]!r} is not supported for serving; allowed: "
                        f"{', '.join(SERVE_AXES)} (attention data-parallel over {'/'.join(BATCH_AXES)}, "
                        "experts over expert, heads / MLP / vocab over tensor)")
    shards = math.prod(sizes.get(a, 1) for a in BATCH_AXES)
    if max_batch % shards:
        raise MeshError(f"max_batch={max_batch} is not divisible by the mesh's batch shards "
                        f"{'*'.join(BATCH_AXES)}={shards} (mesh {sizes}): every shard holds max_batch / shards slots")
    checks = [("num_heads", config.num_heads, "tensor"), ("vocab_size", config.vocab_size, "tensor"),
              ("ffn_dim", config.ffn_dim, "tensor")]
    if config.num_experts:
        checks += [("num_experts", config.num_experts, "expert"), ("moe_ffn_dim", config.moe_ffn_dim, "tensor")]
    for field, value, axis in checks:
        if value % sizes.get(axis, 1):
            raise MeshError(f"ModelConfig.{field}={value} is not divisible by mesh axis {axis}={sizes[axis]} "
                            f"(serving mesh {sizes})")
    return shards


def shard_params(params, shardings):
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, s), params, shardings)




def single_device_mesh() -> Mesh:
    """The trivial mesh (every axis 1) on the first device: one device runs the same sharded program."""
    return make_mesh(None, jax.devices()[:1])


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules=LOGICAL_RULES):
    """Activate `mesh` and the logical rules so activation constraints apply inside jit.

    `jax.set_mesh` (not `with mesh:`): flax's with_logical_constraint reads the *abstract* mesh
    (jax.sharding.get_abstract_mesh), which only set_mesh sets; under the legacy `with mesh:` context
    every constraint silently became a no-op (tests/test_step_sharding.py guards this).
    """
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def batch_spec() -> P:
    return P(BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, batch_spec())
