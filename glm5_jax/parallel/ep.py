"""Expert-parallel MoE dispatch with explicit all-to-all (moe_impl="a2a").

The GSPMD paths (moe_impl ragged | dense) leave the collectives to the compiler. This one spells them
out inside `jax.shard_map`:

  1. tokens arrive sharded over the batch axes (data, fsdp, expert) and, with context parallelism, over
     `context` (the sequence axis); each device routes its own tokens;
  2. slots (token, choice) are sorted by expert and packed into a send buffer [ep, C, D], one row of
     C slots per device on the `expert` axis (that device owns experts [j*E/ep, (j+1)*E/ep));
  3. `jax.lax.all_to_all` over `expert` exchanges the buffers; every device now holds the slots for its
     local experts, runs them with `jax.lax.ragged_dot` (F sharded over `tensor`, partial sums psum'd);
  4. a second all_to_all sends the results back, where they are un-permuted and weighted.

Capacity C per (source device, destination device) is ceil(capacity_factor * n * k / ep) slots for n
local tokens with k choices; slots beyond C are dropped (their output is 0, the residual carries the
token) and the dropped fraction is returned. capacity_factor <= 0 means dropless: C = n * k, the worst
case, so nothing is ever dropped (exactly the ragged path's numbers, at ep x the buffer memory).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp", "expert")
TOKEN_AXES = BATCH_AXES + ("context",)   # [B, T] flattened to N = B*T: batch axes major, context minor


def capacity(n_slots: int, ep: int, capacity_factor: float) -> int:
    """Slots each device may send to each device on the expert axis."""
    if capacity_factor <= 0:
        return n_slots
    return max(1, min(n_slots, math.ceil(capacity_factor * n_slots / ep)))


def _swiglu(xs, gate, up, down, sizes):
    dot = lambda a, w: jax.lax.ragged_dot(a, w, sizes)
    return dot(jax.nn.silu(dot(xs, gate)) * dot(xs, up), down)


def dispatch_local(x, weights, ids, gate, up, down, *, num_experts: int, capacity_factor: float,
                   expert_axis: str | None = None, ep: int = 1, tensor_axis: str | None = None):
    """Per-device body. x [n, D], weights/ids [n, k]; gate/up [E/ep, D, F_l], down [E/ep, F_l, D].

    Returns (out [n, D], dropped slots (int32 scalar), total slots (int32 scalar)) for this device.
    """
    n, d = x.shape
    k = ids.shape[-1]
    el = num_experts // ep
    s = n * k
    c = capacity(s, ep, capacity_factor)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)                       # slots grouped by expert (so by device)
    sorted_ids = flat[order]
    dest = sorted_ids // el
    per_dest = jnp.bincount(flat // el, length=ep)
    start = jnp.cumsum(per_dest) - per_dest
    rank = jnp.arange(s) - start[dest]                           # position inside the destination's row
    keep = rank < c
    row = jnp.where(keep, dest, ep)                              # out of range -> dropped by scatter
    xs = x[order // k]
    send = jnp.zeros((ep, c, d), x.dtype).at[row, rank].set(xs, mode="drop")
    send_ids = jnp.full((ep, c), el, jnp.int32).at[row, rank].set(sorted_ids - dest * el, mode="drop")
    if expert_axis is not None and ep > 1:
        recv = jax.lax.all_to_all(send, expert_axis, 0, 0, tiled=True)
        recv_ids = jax.lax.all_to_all(send_ids, expert_axis, 0, 0, tiled=True)
    else:
        recv, recv_ids = send, send_ids
    recv, recv_ids = recv.reshape(ep * c, d), recv_ids.reshape(ep * c)
    r_order = jnp.argsort(recv_ids, stable=True)                 # empty slots (id el) go last
    sizes = jnp.bincount(recv_ids, length=el + 1)[:el].astype(jnp.int32)
    ys = _swiglu(recv[r_order], gate, up, down, sizes)
    ys = jnp.where((recv_ids[r_order] < el)[:, None], ys, 0)
    if tensor_axis is not None:
        ys = jax.lax.psum(ys, tensor_axis)                       # F was sharded: sum the partial products
    ys = jnp.zeros_like(ys).at[r_order].set(ys).reshape(ep, c, d)
    if expert_axis is not None and ep > 1:
        ys = jax.lax.all_to_all(ys, expert_axis, 0, 0, tiled=True)
    back = jnp.where(keep[:, None], ys[jnp.minimum(row, ep - 1), jnp.minimum(rank, c - 1)], 0)
    out_slots = jnp.zeros((s, d), ys.dtype).at[order].set(back).reshape(n, k, d)
    out = jnp.einsum("nkd,nk->nd", out_slots, weights.astype(out_slots.dtype))
    return out, jnp.sum(~keep).astype(jnp.int32), jnp.asarray(s, jnp.int32)


def dispatch_chunked(x, weights, ids, gate, up, down, *, token_chunk: int = 0, **kw):
    """dispatch_local over chunks of at most `token_chunk` of the device's n tokens, one after another
    (lax.map, each chunk under jax.checkpoint: the backward recomputes a chunk's dispatch, so its send /
    receive buffers and expert activations live for one chunk at a time, not for all n tokens).
    Capacity is per chunk (capacity_factor * chunk slots / ep); dropless dispatch is unchanged.
    token_chunk <= 0 or >= n: one dispatch."""
    n, d = x.shape
    if token_chunk <= 0 or token_chunk >= n:
        return dispatch_local(x, weights, ids, gate, up, down, **kw)
    c = max(t for t in range(1, token_chunk + 1) if n % t == 0)   # chunks tile the tokens exactly
    m, k = n // c, ids.shape[-1]

    @jax.checkpoint
    def one(args):
        return dispatch_local(*args, gate, up, down, **kw)

    out, dropped, total = jax.lax.map(one, (x.reshape(m, c, d), weights.reshape(m, c, k), ids.reshape(m, c, k)))
    return out.reshape(n, d), jnp.sum(dropped), jnp.sum(total)


def _context_mesh():
    """The mesh activated by glm5_jax.sharding.use_mesh (jax.set_mesh), as the abstract mesh jit traces
    under; None without one or when it lacks the batch axes (then the MoE runs on one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
        return None
    return mesh


def a2a_moe(x, weights, ids, gate, up, down, *, num_experts: int, capacity_factor: float, token_chunk: int = 0):
    """x [N, D] (N = batch * seq), weights/ids [N, k] -> (out [N, D], dropped fraction float32).

    Under a mesh with axes (data, fsdp, expert, context, tensor) (glm5_jax.sharding.use_mesh) this runs
    as a shard_map with all-to-all over `expert`; without one it runs the same code on one device.
    The N tokens are split over the batch axes and `context` (the flattened [B, T] layout of an
    activation whose batch is on the batch axes and sequence on `context`), so each device routes the
    tokens of its own sequence shard. token_chunk > 0: each device dispatches its tokens in chunks
    (dispatch_chunked), bounding the dispatch buffers at long context (glm5 at 128K: 16K tokens a chip).
    """
    mesh = _context_mesh()
    if mesh is None:
        out, dropped, total = dispatch_chunked(x, weights, ids, gate, up, down, num_experts=num_experts,
                                               capacity_factor=capacity_factor, token_chunk=token_chunk)
        return out, dropped.astype(jnp.float32) / total
    sizes = dict(mesh.shape)
    ep = sizes["expert"]
    tok_axes = tuple(a for a in TOKEN_AXES if a in sizes)
    shards = math.prod(sizes[a] for a in tok_axes)
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by mesh axis expert={ep}")
    if x.shape[0] % shards:
        raise ValueError(f"moe_impl='a2a': {x.shape[0]} tokens are not divisible by "
                         f"{'*'.join(tok_axes)}={shards}")
    tensor = "tensor" if sizes.get("tensor", 1) > 1 and gate.shape[-1] % sizes["tensor"] == 0 else None
    tok = P(tok_axes, None)
    w_in = P("expert", None, tensor)
    w_out = P("expert", tensor, None)

    def body(x, weights, ids, gate, up, down):
        out, dropped, total = dispatch_chunked(x, weights, ids, gate, up, down, num_experts=num_experts,
                                               capacity_factor=capacity_factor, expert_axis="expert", ep=ep,
                                               tensor_axis=tensor, token_chunk=token_chunk)
        dropped = jax.lax.psum(dropped, tok_axes)
        total = jax.lax.psum(total, tok_axes)
        return out, dropped.astype(jnp.float32) / total

    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, w_in, w_in, w_out), out_specs=(tok, P()),
                       check_vma=False)
    return fn(x, weights, ids, gate, up, down)
