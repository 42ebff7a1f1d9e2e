"""The one place that picks a DSA kernel: `ModelConfig.attention_impl` "xla" runs the jnp XLA path
(pallas_kernels.dsa_xla), "pallas" the Pallas kernels (pallas_kernels.dsa: Mosaic on TPU, Triton on
GPU, interpret mode on CPU). Both have the same signatures; tests compare them.

Under a mesh (glm5_jax.sharding.use_mesh) a Pallas call cannot be partitioned by GSPMD (a Mosaic /
Triton custom call is opaque: it would be run on the whole, replicated batch). So with
attention_impl="pallas" the kernels run per device inside `jax.shard_map` over the mesh's batch axes
(`glm5_jax.batch.BATCH_AXES`: data, fsdp, expert) that are not manual already (under context
parallelism `glm5_jax.attention.context.over_context` has made them manual, with the `context` axis,
and passes the global query offset). The shard_map is manual over every other not-yet-manual axis too
(tensor, size-1 axes), the operands replicated over them: the TPU lowering refuses a Mosaic call in a
partly automatic region. The batch dim must divide by the product of the batch axes' sizes; when it
does not (only flax's init trace, batch 1, whose forward is dead code) it is replicated.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from glm5_jax.batch import BATCH_AXES
from pallas_kernels import dsa_xla as ref


def batch_split_axes(batch: int) -> tuple[str, ...]:
    """The mesh's batch axes (data, fsdp, expert) that the Pallas kernels split `batch` over: those of the
    current abstract mesh of size > 1 and not already manual (inside a shard_map); () without a mesh, or
    when `batch` does not divide by their product (module docstring)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = set(getattr(mesh, "manual_axes", ()))
    shape = dict(mesh.shape)
    axes = tuple(a for a in BATCH_AXES if a in shape and a not in manual and shape[a] > 1)
    if not axes or batch % math.prod(shape[a] for a in axes):
        return ()
    return axes


def _auto_axes() -> tuple[str, ...]:
    """Axes of the current abstract mesh that are not manual yet (a Mosaic kernel needs all of them manual:
    the TPU lowering refuses a Pallas call in a partly automatic region, even over axes of size 1)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = set(getattr(mesh, "manual_axes", ()))
    return tuple(a for a in mesh.axis_names if a not in manual)


def per_device(fn, batch_args: dict, scalar_args: dict | None = None):
    """fn(**batch_args, **scalar_args) run per device in a shard_map manual over every axis of the mesh
    not manual yet: every non-None entry of batch_args is split on its leading (batch) dim over
    `batch_split_axes` and replicated over the other axes, scalar_args are replicated, the output pytree
    is split like the inputs. Without a mesh (or inside a fully manual region): fn called directly."""
    scalar_args = {k: v for k, v in (scalar_args or {}).items() if v is not None}
    arrays = {k: v for k, v in batch_args.items() if v is not None}
    nones = {k: None for k, v in batch_args.items() if v is None}
    b = next(iter(arrays.values())).shape[0]
    auto = _auto_axes()
    if not auto:
        return fn(**arrays, **nones, **scalar_args)
    axes = batch_split_axes(b)
    spec = P(axes) if axes else P()

    def body(arrays, scalars):
        return fn(**arrays, **nones, **scalars)

    in_specs = ({k: spec for k in arrays}, {k: P() for k in scalar_args})
    out = jax.eval_shape(body, arrays, scalar_args)
    out_specs = jax.tree_util.tree_map(lambda _: spec, out)
    return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset(auto),
                         check_vma=False)(arrays, scalar_args)


def indexer_topk(q_idx, k_idx, weights, topk: int, *, segment_ids=None, impl: str = "xla", chunk: int = 256,
                 q_offset=None, kv_segment_ids=None):
    """Exact top-k key indices per query, int32 [B, T, topk], -1 where fewer keys are visible.
    q_offset / kv_segment_ids: the T queries at global positions q_offset.. of the S keys (context
    parallelism, glm5_jax.attention.context)."""
    if impl == "pallas":
        from pallas_kernels import dsa

        def run(q_idx, k_idx, weights, segment_ids, kv_segment_ids, q_offset=None):
            return dsa.indexer_topk(q_idx, k_idx, weights, topk, segment_ids=segment_ids, q_offset=q_offset,
                                    kv_segment_ids=kv_segment_ids)
        return per_device(run, dict(q_idx=q_idx, k_idx=k_idx, weights=weights, segment_ids=segment_ids,
                                    kv_segment_ids=kv_segment_ids), dict(q_offset=q_offset))
    if impl != "xla":
        raise ValueError(f"attention_impl must be 'xla' or 'pallas', got {impl!r}")
    return ref.indexer_topk(q_idx, k_idx, weights, topk, segment_ids=segment_ids, chunk=chunk, q_offset=q_offset,
                            kv_segment_ids=kv_segment_ids)


def sparse_attention(q, k, v, indices, *, scale, impl: str = "xla", chunk: int = 128, dv: int | None = None):
    """q [B, T, H, D] over the keys `indices` [B, T, K] (-1 = none) of k/v [B, S, Hk, D] -> [B, T, H, Dv].
    v=None with `dv`: the value is k[..., :dv] (MLA's MQA form); the xla path then gathers each row
    once and scatters one gradient row per slot (see dsa_xla.sparse_attention). The indices are
    global key positions, so no query offset is needed under context parallelism."""
    if impl == "pallas":
        from pallas_kernels import dsa
        if v is None:
            if dv is None:
                raise ValueError("sparse_attention: v=None needs dv (value = k[..., :dv])")
            v = k[..., :dv]

        def run(q, k, v, indices):
            return dsa.sparse_attention(q, k, v, indices, scale=scale)
        return per_device(run, dict(q=q, k=k, v=v, indices=indices))
    if impl != "xla":
        raise ValueError(f"attention_impl must be 'xla' or 'pallas', got {impl!r}")
    return ref.sparse_attention(q, k, v, indices, scale=scale, chunk=chunk, dv=dv)


def mqa_sparse_attention(q, k, w_uv, indices, *, scale, impl: str = "xla", chunk: int = 16):
    """MLA's MQA sparse attention with W_UV applied -- the one sparse call of training's sparse stage, prefill and
    decode (glm5_jax.attention.mla): q [B, T, H, Dq], k [B, S, 1, Dq] whose first r columns are the value (the
    latent: each selected row is gathered once), w_uv [r, H, dv], indices [B, T, K] -> [B, T, H, dv]. The xla path
    is one custom VJP whose backward keeps only the log-sum-exp (`dsa_xla.sparse_mqa_uv`); the pallas path is the
    same VJP with the Pallas kernels (`dsa.sparse_mqa_uv`: on TPU the backward fuses the dK scatter-add)."""
    if impl == "xla":
        return ref.sparse_mqa_uv(q, k, w_uv, indices, scale=scale, chunk=chunk)
    if impl != "pallas":
        raise ValueError(f"attention_impl must be 'xla' or 'pallas', got {impl!r}")
    from pallas_kernels import dsa

    def run(q, k, indices, w_uv):
        return dsa.sparse_mqa_uv(q, k, w_uv, indices, scale=scale, chunk=chunk)
    return per_device(run, dict(q=q, k=k, indices=indices), dict(w_uv=w_uv))
