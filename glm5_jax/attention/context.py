"""Context parallelism: the sequence axis of activations split over the `context` mesh axis.

Layout (load balance). With N = context size, every sequence is cut into 2N equal chunks and device
i holds chunks i and 2N-1-i (Megatron's order): under causal attention chunk c's queries see c+1
chunks of keys, so every device does (i+1) + (2N-i) = 2N+1 chunk pairs of work. The permutation is
applied once, to the token-level batch at the start of the train step (`layout_batch`; shifted
targets, e.g. MTP's (glm5_jax.mtp.mtp_batch), are built in natural order first), and every token-wise layer (norms,
projections, MoE routing and its all-to-all, MTP blocks, head, losses) runs on the permuted
sequence unchanged: only attention needs to know where a token sits.

Attention (`over_context`). Queries stay local; the keys (for DSA's sparse stage and absorbed MLA
one [kv_latent | k_rope] row per token, plus the 128-d indexer key; for expanded dense MLA the
per-head K/V) are all-gathered along `context` and put back in natural order, so key index = global
token index (DSA's top-k indices mean the same as unsharded). Each local chunk then runs the ordinary
kernels with its global query offset (q_offset = chunk * T / 2N) under `jax.shard_map` over the
`context` axis and the batch axes (the tensor axis stays automatic). The all-gather's transpose, a
reduce-scatter, returns the keys' gradients to their owners.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from glm5_jax.batch import BATCH_AXES
from glm5_jax.layers.common import constrain

AXIS = "context"
REDUCE = ("token", "mean", "max")   # how over_context combines one output of the two local chunks


def context_size() -> int:
    """Size of the `context` axis of the mesh jit traces under (glm5_jax.sharding.use_mesh), 1 without."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names:
        return 1
    return int(dict(mesh.shape)[AXIS])


def chunk_order(n: int) -> np.ndarray:
    """The 2n chunks in layout order: device i holds chunks (i, 2n-1-i) -> [0, 2n-1, 1, 2n-2, ...]."""
    return np.array([c for i in range(n) for c in (i, 2 * n - 1 - i)])


def layout_index(t: int, n: int) -> np.ndarray:
    """[t] natural token index at each layout position (n = context size; t % 2n == 0)."""
    if t % (2 * n):
        raise ValueError(f"sequence length {t} is not divisible by 2*context = {2 * n}")
    c = t // (2 * n)
    return (chunk_order(n)[:, None] * c + np.arange(c)[None, :]).reshape(-1)


def to_layout(x, n: int, axis: int = 1):
    """Natural order -> layout order along `axis` (a static gather)."""
    return jnp.take(x, jnp.asarray(layout_index(x.shape[axis], n)), axis=axis)


def from_layout(x, n: int, axis: int = 1):
    """Layout order -> natural order along `axis`."""
    return jnp.take(x, jnp.asarray(np.argsort(layout_index(x.shape[axis], n))), axis=axis)


def layout_batch(batch: dict, n: int) -> dict:
    """The train step's batch ({tokens, targets, positions, segment_ids, loss_mask, ...}, leaves [.., B, T])
    in the context layout: every [.., T] leaf permuted. Leaves shifted along the sequence (MTP's,
    glm5_jax.mtp.mtp_batch) are built in natural order before this."""
    t = batch["tokens"].shape[1]
    seq = ("activation_batch", "activation_seq")

    def permute(v):   # [.., B, T] leaves: layout order, then split over the batch axes x context
        if v is None or v.shape[-1] != t:
            return v
        return constrain(to_layout(v, n, axis=v.ndim - 1), (None,) * (v.ndim - 2) + seq)
    return {k: permute(v) for k, v in batch.items()}


def _natural_keys(x, n: int):
    """x [B, T/n, ...] local layout shard -> [B, T, ...] all keys in natural order."""
    g = jax.lax.all_gather(x, AXIS, axis=1, tiled=True)            # layout order
    b, t = g.shape[:2]
    chunks = g.reshape(b, 2 * n, t // (2 * n), *g.shape[2:])
    return chunks[:, np.argsort(chunk_order(n))].reshape(g.shape)


def over_context(fn: Callable, local, keys, reduce: Sequence[str], n: int | None = None, key_prefix: bool = False,
                 consts=None):
    """Run `fn(local, keys, q_offset)` over the sequence shards of the `context` axis.

    local: pytree of per-query arrays [B, T, ...] (this device's shard under context parallelism);
    keys: pytree of per-key arrays [B, T, ...], all-gathered along `context` into natural order.
    fn returns a tuple; reduce[i] in REDUCE says how output i of the two local chunks combines:
    "token" ([B, chunk, ...] concatenated back into the shard), "mean" (a mean over the chunk's
    queries: averaged, then over the context axis), "max" (max, then over the axis).
    Without a context axis (size 1, or n=1: a module's init trace) this is fn(local, keys, None): the
    unsharded kernels, unchanged.
    consts: a pytree of arrays that are not per token (e.g. a weight), passed whole to every chunk as
    fn's fourth argument (replicated into the shard_map; their gradients summed over its devices); without
    consts fn takes three.
    key_prefix: fn is causal and sees only keys at positions <= its queries' (keys indexed by global
    position from 0), so each chunk gets the static key prefix it can see: the first chunk (global chunk
    i < n) the first T/2 keys, the second (chunk 2n-1-i) all T. The pair then scores 3n key chunks
    instead of 4n (2n+1 are visible); a kernel with a traced q_offset cannot bound its rows itself.
    """
    n = context_size() if n is None else n
    extra = () if consts is None else (consts,)
    if n == 1:
        return fn(local, keys, None, *extra)
    for r in reduce:
        if r not in REDUCE:
            raise ValueError(f"reduce {r!r}; allowed: {', '.join(REDUCE)}")
    # manual over the batch axes too: left automatic, GSPMD replicated the batch inside the body (the
    # gathered keys of all 16 sequences on every chip for glm5 at 128K, 2.25 GiB a copy, tools.aot)
    names = set(jax.sharding.get_abstract_mesh().axis_names)
    batch = tuple(a for a in BATCH_AXES if a in names)
    manual = batch + (AXIS,)
    spec = P(batch or None, AXIS)

    def body(local, keys, *extra):
        i = jax.lax.axis_index(AXIS)
        full = jax.tree_util.tree_map(lambda x: _natural_keys(x, n), keys)
        c = jax.tree_util.tree_leaves(local)[0].shape[1] // 2
        outs = []
        for j, chunk in enumerate((i, 2 * n - 1 - i)):
            part = jax.tree_util.tree_map(lambda x: x[:, j * c:(j + 1) * c], local)
            seen = full if not key_prefix or j else jax.tree_util.tree_map(lambda x: x[:, :n * c], full)
            outs.append(fn(part, seen, (chunk * c).astype(jnp.int32), *extra))
        res = []
        for r, a, b in zip(reduce, *outs):
            if r == "token":
                res.append(None if a is None else jnp.concatenate([a, b], axis=1))
            elif r == "mean":   # every device holds as many queries: the mean of the means
                res.append(jax.lax.pmean((a + b) / 2, manual))
            else:
                res.append(jax.lax.pmax(jnp.maximum(a, b), manual))
        return tuple(res)

    specs = lambda tree: jax.tree_util.tree_map(lambda _: spec, tree)
    out_specs = tuple(spec if r == "token" else P() for r in reduce)
    const_specs = tuple(jax.tree_util.tree_map(lambda _: P(), e) for e in extra)
    return jax.shard_map(body, in_specs=(specs(local), specs(keys)) + const_specs, out_specs=out_specs,
                         axis_names=frozenset(manual), check_vma=False)(local, keys, *extra)
