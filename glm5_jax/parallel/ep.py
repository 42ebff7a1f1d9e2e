"""Expert-parallel MoE dispatch with explicit all-to-all (moe_impl="a2a").

The GSPMD paths (moe_impl ragged | dense) leave the collectives to the compiler. This one spells them
out inside `jax.shard_map`:

  1. tokens arrive sharded over the batch axes (data, fsdp, expert) and, with context parallelism, over
     `context` (the sequence axis); each device routes its own tokens;
  2. slots (token, choice) are sorted by expert and packed into a send buffer [ep, C, D], one row of
     C slots per device on the `expert` axis (that device owns experts [j*E/ep, (j+1)*E/ep));
  3. `jax.lax.all_to_all` over `expert` exchanges the buffers; every device now holds the slots for its
     local experts, runs them with a grouped matmul (pallas_kernels.gmm: megablox on TPU; F sharded over `tensor`, partial sums psum'd);
  4. a second all_to_all sends the results back, where they are un-permuted and weighted.

Capacity C per (source device, destination device) is ceil(capacity_factor * n * k / ep) slots for n
local tokens with k choices; slots beyond C are dropped (their output is 0, the residual carries the
token) and the dropped fraction is returned.

capacity_factor <= 0 means dropless, in rounds (issue 34): the first round sends the slots ranked
[0, C0) in their destination row, C0 = ceil(round_factor * n * k / ep); overflow rounds then send the
slots ranked past C0 in rounds of C1 = ceil(overflow_factor * n * k / ep), until every slot is sent:
ceil(max(max pair load - C0, 0) / C1) overflow rounds, the max taken over the whole mesh (pmax) so every
device runs the same loop. Balanced routing costs the first round only. The first round is plain autodiff,
as the capacity path (its named activations follow the remat policy: with expert_gate / expert_up saved
the backward recomputes no grouped matmul); the overflow rounds run in a lax.while_loop inside a
custom_vjp whose backward runs the same rounds again (each recomputing its forward), so no overflow
round's activations outlive it; the first round's output passes through that custom_vjp, whose backward
hands its cotangent on only with the overflow gradients, so the first round's backward runs after the
overflow rounds', not beside them. Why a small C1 (moe_overflow_capacity_factor 0.125): an overflow round
costs its buffer whatever it holds, and what overflows a 1.25 x mean first round is the tail of the
load, not another mean (docs/scaleout.md, "Spend the pod"). round_factor <= 0 gives the old worst-case
form: one round of C = n * k (ep x the buffer memory).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from glm5_jax.batch import BATCH_AXES
from pallas_kernels.gmm import grouped_matmul

TOKEN_AXES = BATCH_AXES + ("context",)   # [B, T] flattened to N = B*T: batch axes major, context minor


def capacity(n_slots: int, ep: int, capacity_factor: float) -> int:
    """Slots each device may send to each device on the expert axis (in one all-to-all round)."""
    if capacity_factor <= 0:
        return n_slots
    return max(1, min(n_slots, math.ceil(capacity_factor * n_slots / ep)))


# `_token_round` with many tokens: rows a local expert takes in its compacted buffer, x the mean it receives
# (ep * n * k / E); an expert routed more runs its extra rows through the dense form (dropless)
TOKEN_ROUND_CAPACITY = 2.0

# checkpoint names (ModelConfig.remat policies): the rows a device's local experts receive, and the
# gate / up projections of those rows ([rows, F] each)
EXPERT_IN, EXPERT_GATE, EXPERT_UP = "expert_in", "expert_gate", "expert_up"


def _swiglu(xs, gate, up, down, sizes, scale, kernel: str = "auto"):
    """The local experts' SwiGLU of rows xs [rows, D], each row's router weight `scale` [rows] applied
    before the down projection (w (h W_down) = (w h) W_down: the same sum). Applied there, the router
    weights' gradient needs h = silu(g) * u, an elementwise function of the saved gate / up outputs, not
    the [rows, D] expert output: with expert_gate / expert_up saved (remat custom) the backward runs no
    grouped matmul twice (docs/scaleout.md, "Spend the pod")."""
    dot = lambda a, w: grouped_matmul(a, w, sizes, impl=kernel)
    xs = checkpoint_name(xs, EXPERT_IN)
    g, u = checkpoint_name(dot(xs, gate), EXPERT_GATE), checkpoint_name(dot(xs, up), EXPERT_UP)
    h = jax.nn.silu(g) * u
    return dot((h.astype(jnp.float32) * scale[:, None]).astype(h.dtype), down)


def _plan(ids, el: int, ep: int):
    """Where each slot (token, choice) goes: ids [n, k] -> (order [s]: slots sorted by expert, so by
    destination device; local [s]: the sorted slot's expert on its device; start, per_dest [ep]: the
    destination rows' first sorted position and length). A slot of rank q in row j sits at sorted
    position start[j] + q."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_ids = flat[order]
    per_dest = jnp.bincount(flat // el, length=ep).astype(jnp.int32)
    start = jnp.cumsum(per_dest) - per_dest
    return order.astype(jnp.int32), (sorted_ids % el).astype(jnp.int32), start, per_dest


def _round(x, weights, gate, up, down, plan, lo, *, c: int, el: int, ep: int, expert_axis, tensor_axis,
           kernel: str = "auto"):
    """One all-to-all round: the slots of rank [lo, lo + c) in every destination row are gathered into
    a send buffer [ep, c, D], exchanged over `expert_axis`, run through the local experts (ragged_dot,
    F over `tensor_axis`; each row's router weight applied before the down projection), sent back and
    added to their tokens.
    Returns the round's contribution [n, D] (float32)."""
    order, local, start, per_dest = plan
    (n, d), k = x.shape, weights.shape[-1]
    s = n * k
    q = lo + jnp.arange(c, dtype=jnp.int32)                               # rank inside the row
    valid = q[None, :] < per_dest[:, None]                               # [ep, c]
    pos = jnp.minimum(start[:, None] + q[None, :], s - 1)                # sorted position
    slot = jnp.where(valid, order[pos], s)                               # s: empty
    tok = slot // k                                                      # n: empty (dropped by the scatter)
    send = jnp.where(valid[..., None], x[jnp.minimum(tok, n - 1)], 0)
    send_ids = jnp.where(valid, local[pos], el)
    send_w = jnp.where(valid, weights.reshape(-1)[jnp.minimum(slot, s - 1)], 0).astype(jnp.float32)
    if expert_axis is not None and ep > 1:
        recv = jax.lax.all_to_all(send, expert_axis, 0, 0, tiled=True)
        recv_ids = jax.lax.all_to_all(send_ids, expert_axis, 0, 0, tiled=True)
        recv_w = jax.lax.all_to_all(send_w, expert_axis, 0, 0, tiled=True)
    else:
        recv, recv_ids, recv_w = send, send_ids, send_w
    recv, recv_ids, recv_w = recv.reshape(ep * c, d), recv_ids.reshape(ep * c), recv_w.reshape(ep * c)
    r_order = jnp.argsort(recv_ids, stable=True)                         # empty slots (id el) go last
    sizes = jnp.bincount(recv_ids, length=el + 1)[:el].astype(jnp.int32)
    ys = _swiglu(recv[r_order], gate, up, down, sizes, recv_w[r_order], kernel)   # weighted by the router
    ys = jnp.where((recv_ids[r_order] < el)[:, None], ys, 0)
    if tensor_axis is not None:
        ys = jax.lax.psum(ys, tensor_axis)                               # F was sharded: sum the partial products
    ys = jnp.zeros_like(ys).at[r_order].set(ys).reshape(ep, c, d)
    if expert_axis is not None and ep > 1:
        ys = jax.lax.all_to_all(ys, expert_axis, 0, 0, tiled=True)
    return jnp.zeros((n, d), jnp.float32).at[tok].add(ys.astype(jnp.float32), mode="drop")


def _token_round(x, weights, ids, gate, up, down, *, el: int, ep: int, expert_axis, tensor_axis, capacity: int = 0):
    """The dropless one-round dispatch without sorting, for el <= k local experts a device: every device
    gathers all ep * n tokens of the expert axis (an all-gather of [n, D]) and each token's router weight
    for each of its el local experts (0 where the token does not route there: an all-to-all of [ep, el, n]),
    runs each local expert over all ep * n rows as dense matmuls (router weight applied before the down
    projection, as in `_swiglu`: a row that does not route there contributes exactly 0), sums its el experts
    inside the down projection's contraction, and sends each source device its rows back ([ep, n, D]).
    Nothing is ever dropped, whatever the routing. Why: at decode (n = 2 tokens a chip) the sorted round's
    worst-case buffer is ep * n * k rows padded to the grouped matmul's tiles and moved ~10 times, and the
    grouped matmul (a custom call) takes its expert weights as a copy sliced out of the scanned layer stack,
    every layer; a dense dot reads them in place (the slice fuses into the dot). el * ep * n rows (el <= k)
    is never more than the sorted round's ep * n * k.

    With many tokens (a paged decode step: tens of sequences a chip) running every local expert over all
    ep * n rows is el * E / k times the useful FLOPs (glm5 at 47 tokens a chip: 7e13 FLOPs a step, 6 % useful).
    So over a cache (inference: `compact`, not differentiable) when `capacity` C < ep * n each local expert
    takes only its routed rows, compacted in token order into a [el, C, D] buffer (C = TOKEN_ROUND_CAPACITY x
    the mean rows an expert receives), the same dense matmuls over it, in passes of C rows: one pass unless an
    expert is routed more than C of the ep * n tokens (a while loop: tools.budget counts it once), so nothing
    is dropped.
    Returns the [n, D] output (float32)."""
    n, d = x.shape
    m = ep * n
    hit = ids[:, :, None] == jnp.arange(el * ep, dtype=ids.dtype)                  # [n, k, E]
    w_e = jnp.sum(jnp.where(hit, weights.astype(jnp.float32)[..., None], 0.0), axis=1)   # [n, E]
    send_w = w_e.T.reshape(ep, el, n)
    if expert_axis is not None and ep > 1:
        xs = jax.lax.all_gather(x, expert_axis, axis=0)                          # [source, n, D]
        scale = jax.lax.all_to_all(send_w, expert_axis, 0, 0, tiled=True)       # [source, el, n]
    else:
        xs, scale = x[None], send_w
    dot = lambda spec, a, w: jnp.einsum(spec, a, w, preferred_element_type=jnp.float32).astype(a.dtype)

    def dense(scale):                                   # every local expert over all ep * n rows -> [source, n, D]
        xb = checkpoint_name(jnp.broadcast_to(xs[:, None], (ep, el, n, d)), EXPERT_IN)
        g = checkpoint_name(dot("send,edf->senf", xb, gate), EXPERT_GATE)
        u = checkpoint_name(dot("send,edf->senf", xb, up), EXPERT_UP)
        h = (jax.nn.silu(g) * u).astype(jnp.float32) * scale[..., None]
        return dot("senf,efd->snd", h.astype(g.dtype), down)                    # el summed

    if 0 < capacity < m:
        c = int(capacity)
        sc = jnp.moveaxis(scale, 1, 0).reshape(el, m)                            # [el, m]: token s * n + j
        routed = sc != 0
        pos = jnp.cumsum(routed, axis=1, dtype=jnp.int32) - 1                   # rank among the expert's rows
        tok = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (el, m))
        xf = xs.reshape(m, d)

        def one_pass(p, out):                           # the rows of rank p * C .. (p + 1) * C - 1 of each expert
            r = pos - p * c
            idx = jnp.full((el, c), m, jnp.int32).at[jnp.arange(el)[:, None], jnp.where(routed & (r >= 0) & (r < c),
                                                                                         r, c)].set(tok, mode="drop")
            safe = jnp.minimum(idx, m - 1)                                      # [el, C] token ids (m: empty)
            w = jnp.where(idx < m, jnp.take_along_axis(sc, safe, axis=1), 0.0)
            g = dot("ecd,edf->ecf", xf[safe], gate)
            h = (jax.nn.silu(g) * dot("ecd,edf->ecf", xf[safe], up)).astype(jnp.float32) * w[..., None]
            y = dot("ecf,efd->ecd", h.astype(g.dtype), down)
            return out.at[idx.reshape(-1)].add(y.reshape(-1, d).astype(jnp.float32), mode="drop")

        passes = (jnp.max(jnp.sum(routed, axis=1)) + c - 1) // c               # > 1 only past C rows an expert
        out = jax.lax.fori_loop(0, jnp.maximum(passes, 1), one_pass, jnp.zeros((m, d), jnp.float32))
        ys = out.reshape(ep, n, d).astype(x.dtype)
    else:
        ys = dense(scale)                                                        # [source, n, D]
    if tensor_axis is not None:
        ys = jax.lax.psum(ys, tensor_axis)                               # F was sharded: sum the partial products
    if expert_axis is not None and ep > 1:
        ys = jax.lax.all_to_all(ys, expert_axis, 0, 0, tiled=True)          # [device, n, D], back at the source
    return jnp.sum(ys, axis=0, dtype=jnp.float32)


def _overflow_rounds(plan, *, c0: int, c1: int, sync_axes):
    """Overflow rounds a dropless dispatch needs after its first round of c0 slots a pair:
    ceil(max(max pair load - c0, 0) / c1), the max taken over every device whose collectives meet this
    one's (`sync_axes`), so that all of them run the same number of all-to-alls."""
    m = jnp.max(plan[3])
    if sync_axes:
        m = jax.lax.pmax(m, sync_axes)
    return ((jnp.maximum(m - c0, 0) + c1 - 1) // c1).astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _overflow(first, x, weights, gate, up, down, plan, n_rounds, kw):
    """first (the first round's [n, D] float32 output) + the sum over overflow rounds r < n_rounds of
    _round(...) at ranks [c0 + r c, c0 + (r+1) c): every slot past the first round is sent in exactly one
    of them. They run in a while_loop (one round's buffers live at a time); the backward runs the rounds
    again, each round's vjp recomputing its forward. `first` only passes through, so that its cotangent
    can leave after the overflow gradients (_overflow_bwd)."""
    return _overflow_fwd(first, x, weights, gate, up, down, plan, n_rounds, kw)[0]


def _split_kw(kw):
    """The nondiff kw items -> (the first round's capacity c0, _round's keywords: c = the overflow rounds')."""
    kw = dict(kw)
    return kw.pop("c0"), kw


def _overflow_fwd(first, x, weights, gate, up, down, plan, n_rounds, kw):
    primals, (c0, rkw) = (x, weights, gate, up, down), _split_kw(kw)
    body = lambda r, acc: acc + _round(*primals, plan, c0 + r * rkw["c"], **rkw)
    out = jax.lax.fori_loop(0, n_rounds, body, jnp.zeros(x.shape, jnp.float32))   # traced bound: a while_loop
    return first + out, (primals, plan, n_rounds)


def _overflow_bwd(kw, res, ct):
    primals, plan, n_rounds = res
    c0, rkw = _split_kw(kw)

    def body(r, acc):
        _, vjp = jax.vjp(lambda *a: _round(*a, plan, c0 + r * rkw["c"], **rkw), *primals)
        return jax.tree_util.tree_map(lambda s, g: s + g.astype(s.dtype), acc, vjp(ct))

    f32 = lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32))    # sums over rounds in float32
    grads = jax.lax.fori_loop(0, n_rounds, body, jax.tree_util.tree_map(f32, primals))
    grads = jax.tree_util.tree_map(lambda g, a: g.astype(a.dtype), grads, primals)
    # The first round's cotangent is released only with the overflow gradients (cast to the primals'
    # dtypes first): the first round's backward (plain autodiff, fed by this cotangent) then runs after
    # this loop, not beside it. Left to the scheduler, the two overlapped: the loop's float32
    # accumulators shared the step's peak with the first round's [ep * C0, D] buffers, and the glm5 4K
    # dropless step needed 102.36 GiB a chip; ordered, 88.30 (docs/scaleout.md, "Spend the pod").
    ct_first, grads = jax.lax.optimization_barrier((ct, grads))
    return (ct_first, *grads, None, None)


_overflow.defvjp(_overflow_fwd, _overflow_bwd)


def dispatch_local(x, weights, ids, gate, up, down, *, num_experts: int, capacity_factor: float,
                   round_factor: float = 0.0, overflow_factor: float = 0.125, expert_axis: str | None = None, ep: int = 1,
                   tensor_axis: str | None = None, sync_axes: tuple[str, ...] = (), kernel: str = "auto",
                   compact: bool = False):
    """Per-device body. x [n, D], weights/ids [n, k]; gate/up [E/ep, D, F_l], down [E/ep, F_l, D].

    capacity_factor > 0: one all-to-all round of C = capacity(n*k, ep, capacity_factor) slots per
    device pair; slots ranked beyond C in their destination row are dropped.
    capacity_factor <= 0 (dropless): a first round of C0 = capacity(n*k, ep, round_factor) slots per pair,
    then overflow rounds of C1 = capacity(n*k, ep, overflow_factor) until every slot is sent
    (ceil(max(max pair load - C0, 0) / C1) of them, the max over `sync_axes`); round_factor <= 0 gives
    C = n*k, one round sized for the worst case, or, with el = E/ep <= k local experts, the unsorted round
    `_token_round` (el * ep * n rows a device, dense matmuls; `kernel` unused).

    Returns (out [n, D], dropped slots, total slots, rounds) for this device (int32 scalars).
    """
    n, d = x.shape
    k = ids.shape[-1]
    el = num_experts // ep
    s = n * k
    total = jnp.asarray(s, jnp.int32)
    if capacity_factor <= 0 and round_factor <= 0 and el <= k:   # dropless, one round, unsorted
        cap = math.ceil(TOKEN_ROUND_CAPACITY * ep * n * k / num_experts) if compact else 0
        out = _token_round(x, weights, ids, gate, up, down, el=el, ep=ep, expert_axis=expert_axis,
                           tensor_axis=tensor_axis, capacity=cap)
        return out.astype(x.dtype), jnp.int32(0), total, jnp.int32(1)
    plan = _plan(ids, el, ep)
    kw = dict(el=el, ep=ep, expert_axis=expert_axis, tensor_axis=tensor_axis, kernel=kernel)
    if capacity_factor > 0 or round_factor <= 0:    # one round: finite capacity, or dropless worst case
        c = capacity(s, ep, capacity_factor)
        out = _round(x, weights, gate, up, down, plan, jnp.int32(0), c=c, **kw)
        dropped = jnp.sum(jnp.maximum(plan[3] - c, 0)).astype(jnp.int32)
        return out.astype(x.dtype), dropped, total, jnp.int32(1)
    c0, c1 = capacity(s, ep, round_factor), capacity(s, ep, overflow_factor)
    first = _round(x, weights, gate, up, down, plan, jnp.int32(0), c=c0, **kw)
    n_over = _overflow_rounds(plan, c0=c0, c1=c1, sync_axes=sync_axes)
    out = _overflow(first, x, weights, gate, up, down, plan, n_over, tuple(sorted(dict(c=c1, c0=c0, **kw).items())))
    return out.astype(x.dtype), jnp.int32(0), total, n_over + 1


def dispatch_chunked(x, weights, ids, gate, up, down, *, token_chunk: int = 0, **kw):
    """dispatch_local over chunks of at most `token_chunk` of the device's n tokens, one after another
    (lax.map, each chunk under jax.checkpoint: the backward recomputes a chunk's dispatch, so its send /
    receive buffers and expert activations live for one chunk at a time, not for all n tokens).
    Capacity is per chunk (capacity_factor * chunk slots / ep); dropless dispatch is unchanged.
    token_chunk <= 0 or >= n: one dispatch. Returns (out, dropped, total, rounds summed over chunks,
    number of dispatches)."""
    n, d = x.shape
    if token_chunk <= 0 or token_chunk >= n:
        return *dispatch_local(x, weights, ids, gate, up, down, **kw), 1
    c = max(t for t in range(1, token_chunk + 1) if n % t == 0)   # chunks tile the tokens exactly
    m, k = n // c, ids.shape[-1]

    @jax.checkpoint
    def one(args):
        return dispatch_local(*args, gate, up, down, **kw)

    out, dropped, total, rounds = jax.lax.map(one, (x.reshape(m, c, d), weights.reshape(m, c, k),
                                                    ids.reshape(m, c, k)))
    return out.reshape(n, d), jnp.sum(dropped), jnp.sum(total), jnp.sum(rounds), m


def _context_mesh():
    """The mesh activated by glm5_jax.sharding.use_mesh (jax.set_mesh), as the abstract mesh jit traces
    under; None without one or when it lacks the batch axes (then the MoE runs on one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
        return None
    return mesh


def a2a_moe(x, weights, ids, gate, up, down, *, num_experts: int, capacity_factor: float, token_chunk: int = 0,
            round_factor: float = 0.0, overflow_factor: float = 0.125, kernel: str = "auto", compact: bool = False):
    """x [N, D] (N = batch * seq), weights/ids [N, k] -> (out [N, D], dropped fraction float32,
    all-to-all rounds per dispatch float32).

    Under a mesh with axes (data, fsdp, expert, context, tensor) (glm5_jax.sharding.use_mesh) this runs
    as a shard_map with all-to-all over `expert`; without one it runs the same code on one device.
    The N tokens are split over the batch axes and `context` (the flattened [B, T] layout of an
    activation whose batch is on the batch axes and sequence on `context`), so each device routes the
    tokens of its own sequence shard. token_chunk > 0: each device dispatches its tokens in chunks
    (dispatch_chunked), bounding the dispatch buffers at long context (glm5 at 128K: 16K tokens a chip).
    capacity_factor <= 0: dropless, a first round of round_factor x the mean pair load, then overflow
    rounds of overflow_factor x the mean (dispatch_local); every device runs the rounds the most loaded
    pair of the whole mesh needs. kernel: the local experts'
    grouped matmul (pallas_kernels.gmm.grouped_matmul's impl; ModelConfig.moe_kernel).
    """
    kw = dict(num_experts=num_experts, capacity_factor=capacity_factor, round_factor=round_factor,
              overflow_factor=overflow_factor, token_chunk=token_chunk, kernel=kernel, compact=compact)
    mesh = _context_mesh()
    if mesh is None:
        out, dropped, total, rounds, m = dispatch_chunked(x, weights, ids, gate, up, down, **kw)
        return out, dropped.astype(jnp.float32) / total, rounds.astype(jnp.float32) / m
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
        out, dropped, total, rounds, m = dispatch_chunked(x, weights, ids, gate, up, down, **kw, expert_axis="expert",
                                                          ep=ep, tensor_axis=tensor, sync_axes=tok_axes)
        dropped = jax.lax.psum(dropped, tok_axes)
        total = jax.lax.psum(total, tok_axes)
        return out, dropped.astype(jnp.float32) / total, rounds.astype(jnp.float32) / m   # rounds: same on every device

    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, w_in, w_in, w_out), out_specs=(tok, P(), P()),
                       check_vma=False)
    return fn(x, weights, ids, gate, up, down)
