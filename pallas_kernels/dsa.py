"""Pallas kernels for DeepSeek Sparse Attention (DSA): lightning-indexer top-k and sparse attention.

Conventions are those of the XLA path `pallas_kernels.dsa_xla` (read its docstring): bottom-right causal
alignment (query t of T sees key s of S iff s <= t + S - T), -1 for empty top-k slots, top-k ties
broken towards the lower key index (the order of `jax.lax.top_k`: values descending, equal values by
ascending key index), attention rows without a valid index return zeros.

indexer_topk (block-then-token)
-------------------------------
Score I[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s]) in float32. Callers fold every scale into the
inputs (the softmax scale Di^-0.5 into q_idx, the head scale Hi^-0.5 into `weights`), as for the
reference.

  1. Block bound (Pallas, grid (B, T/bq)): for each key block the box [kmin, kmax] (per-dimension
     min/max of its keys) gives, per query head, upper/lower bounds of q.k:
         hi = q+ . kmax + q- . kmin,   lo = q+ . kmin + q- . kmax      (q+ = max(q, 0), q- = min(q, 0))
     and since relu is monotone,  I[t, s] <= sum_j (w_j >= 0 ? w_j relu(hi_j) : w_j relu(lo_j)).
     The kernel reduces this to UB[b, query block, key block] (max over the block's queries; -inf
     where the key block is causally invisible to the whole query block). Two small matmuls per
     head; only a [B, T/bq, S/bk] array is written.
  2. Threshold probe (Pallas token-scoring kernel): score the ceil(topk/bk) key blocks with the
     highest UB exactly; the k-th best visible probe score of each query is a lower bound tau_t
     of its true k-th best score (-inf when the probe sees fewer than topk visible keys), and
     tau = min over the query block.
  3. A key block survives iff UB >= tau (with a small relative slack against rounding); no key of
     a discarded block can enter the top-k, ties included. The survivors form a per-query-block
     block table, sorted by block index.
  4. Token pass (same Pallas scoring kernel, block table scalar-prefetched, `round_blocks` table
     entries per call) scores tokens only inside surviving blocks, in rounds of `round_blocks`
     blocks (a `lax.while_loop` whose trip count is the largest survivor count / round_blocks).
     After each round the running top-k is merged with the round's scores by `lax.top_k` over
     [running, round]: since rounds visit blocks in ascending index and `lax.top_k` is stable,
     equal scores are kept in ascending key order, which is exactly the reference's tie-break.
No [T, S] array is written: the largest intermediate is [B, T, topk + round_blocks * bk].

mode="approx": keep the `approx_blocks` key blocks with the highest UB per query block (the block
summary), then the exact top-k among their tokens (one round, no threshold): fewer FLOPs, recall
below 1 (measured in tools/bench_dsa.py).

sparse_attention
----------------
KV heads are folded into the batch first (Hk == H -> batch B*H with one query head), so every
kernel sees a single KV head: q [B, T, H, Dq], k [B, S, Dq], v [B, S, Dv], indices [B, T, K].
Forward (online softmax over chunks of `block_k` selected keys, float32 state, writes O and the
log-sum-exp L) and the backward's dq kernel (recomputes P = exp(S - L), dP = dO . V_sel,
dS = P (dP - delta) with delta = rowsum(dO * O), accumulates dq, writes the chunk's
per-(query, head, slot) P and scale*dS) exist in two lowerings:
  * `sparse_attn_tpu` (Mosaic TPU; also the interpret-mode path): grid (B, T/bq, K/kc) with the
    chunk axis "arbitrary"; K/V stay in HBM (memory_space=ANY), viewed as [B, S, 1, D]; the
    chunk's indices come as an SMEM block (DMA addresses) and a VMEM block (mask); one
    make_async_copy per selected row into VMEM [bq, kc, 1, D] buffers, then batched matmuls.
  * `sparse_attn_triton` (Pallas Triton, GPU): one program per query, index-array loads from
    global memory (`k_ref[0, ids]`), 2-D tl.dots; H, D, kc padded to powers of two >= 16.
Without interpret, `lax.platform_dependent` picks the kernel for the lowering platform (the
indexer's kernels likewise: Mosaic here, Triton in `indexer_triton`).
The generic `sparse_attention`'s backward runs in query chunks (`bwd_rows`): per chunk the kernel gives
dq, P and dS [B, rows, H, K], and dk / dv are atomic-free XLA scatter-adds of the chunk's per-query rows
(dv[s] += sum_h P dO, dk[s] += sum_h scale dS q): no [T, H, K] or [T, K, D] array is ever
materialised (docs/kernels.md: why these dk/dv are not a kernel, and the compiled memory). The model's own
call, MLA's MQA form (`dsa_xla.sparse_mqa_uv` with `PallasRows`), does not take that path on TPU: its
backward is `sparse_mqa_tpu.mqa_bwd`, which sums dK inside the kernel (`PallasRows` below; on GPU it is the
jnp backward).

Lowering and compilation: tests/test_pallas_lowering.py (jax.export for TPU and CUDA) and
tests/test_kernel_compile.py (the real TPU compiler via libtpu, tools/compile_kernels.py).
"""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import indexer_triton as _idx_gpu
from pallas_kernels._bounds import block_visible, bound_cost, dot_t, head_bound, score_cost
from pallas_kernels import dsa_xla as _xla
from pallas_kernels import sparse_attn_tpu as _tpu
from pallas_kernels import sparse_mqa_tpu as _mqa_tpu
from pallas_kernels import sparse_attn_triton as _triton

from pallas_kernels.dsa_xla import NEG_INF
_F32 = jnp.float32


def _interpret(interpret):
    """None (auto) stays None: the kernel is picked per lowering platform (`_dispatch`), interpret mode
    on CPU. Not `jax.default_backend()`: a deviceless TPU compile (tools.aot, tools.compile_kernels)
    traces with a CPU default backend and must still lower the Mosaic kernels."""
    return None if interpret is None else bool(interpret)


def _dispatch(args, make_tpu, make_gpu, interpret, kernels="auto"):
    """Run one kernel family on `args`: make_tpu / make_gpu(interp: bool) -> fn. interpret True: the
    TPU-structured kernel (or, kernels="gpu", the Triton one) in interpret mode; otherwise
    `lax.platform_dependent`: Mosaic on TPU, Triton on CUDA / ROCm (kernels="tpu" / "gpu" force one
    family), and on CPU interpret mode when interpret is None (auto)."""
    if kernels not in ("auto", "tpu", "gpu"):
        raise ValueError(f"kernels must be 'auto', 'tpu' or 'gpu', got {kernels!r}")
    tpu = make_gpu if kernels == "gpu" else make_tpu
    gpu = make_tpu if kernels == "tpu" else make_gpu
    if interpret:
        return tpu(True)(*args)
    if kernels != "auto" and interpret is False:
        return tpu(False)(*args)
    cpu = tpu(True) if interpret is None else tpu(False)
    return jax.lax.platform_dependent(*args, tpu=tpu(False), cuda=gpu(False), rocm=gpu(False), cpu=cpu,
                                      default=tpu(False))


def set_gpu_backend(name):
    """Kept for compatibility. sparse_attention always lowers through Pallas Triton on GPU
    (Mosaic GPU has no in-kernel row gather and staged the whole K/V block in shared memory);
    None and "triton" are both accepted and mean Triton."""
    if name not in (None, "triton"):
        raise ValueError(f"unknown GPU backend {name!r}")


def _cdiv(a, b):
    return -(-a // b)


_dot_t = dot_t


# ----------------------------------------------------------------------------------------------
# indexer: block bound kernel
# ----------------------------------------------------------------------------------------------

def _bound_kernel(shift_ref, q_ref, w_ref, kmax_ref, kmin_ref, segq_ref, smin_ref, smax_ref, ub_ref, *,
                  n_heads, bq, bk, t_total, causal):
    i = pl.program_id(1)
    kmax = kmax_ref[0].astype(_F32)  # [nk, Di]
    kmin = kmin_ref[0].astype(_F32)
    w = w_ref[0].astype(_F32)  # [bq, Hi]
    nk = kmax.shape[0]
    acc = jnp.zeros((bq, nk), _F32)
    for j in range(n_heads):
        acc = acc + head_bound(q_ref[0, :, j, :].astype(_F32), w[:, j:j + 1], kmax, kmin)
    vis = block_visible(i, bq, bk, nk, t_total, shift_ref[0], causal)
    # a key block can hold a key of the query's document only if the query's segment id lies in
    # the block's [min, max] segment range (exact for contiguous packed documents)
    seg = segq_ref[0]  # [bq, 1]
    vis = vis & (seg >= smin_ref[0]) & (seg <= smax_ref[0])
    acc = jnp.where(vis, acc, NEG_INF)
    ub_ref[0, 0] = jnp.max(acc, axis=0, keepdims=True)


def _pow2_pad(x, axis, value):
    n = x.shape[axis]
    return _pad_to(x, x.shape[:axis] + (_pow2(n, 1),) + x.shape[axis + 1:], value)


def _block_bounds(qp, wp, kmax, kmin, segq, smin, smax, shift, *, bq, bk, t_total, s_total, causal,
                  interpret, kernels="auto"):
    """UB [B, nq, nk] by the Mosaic kernel (TPU, and interpret mode by default) or the Triton one
    (GPU; kernels="gpu" runs it in interpret mode on CPU)."""
    nk = kmax.shape[1]
    kw = dict(bq=bq, bk=bk, t_total=t_total, s_total=s_total, causal=causal)
    big = jnp.iinfo(jnp.int32).max

    def gpu(interp):
        def run(qp, wp, kmax, kmin, segq, smin, smax, shift):
            # key-block count padded to a power of two; padded blocks have an empty segment range
            ub = _idx_gpu.block_bounds(qp, wp, _pow2_pad(kmax, 1, 0), _pow2_pad(kmin, 1, 0), segq[..., 0],
                                       _pow2_pad(smin[:, 0], 1, big), _pow2_pad(smax[:, 0], 1, -big), shift,
                                       interpret=interp, **kw)
            return ub[..., :nk]
        return run

    tpu = lambda interp: lambda *a: _block_bounds_tpu(*a, interpret=interp, **kw)
    args = (qp, wp, kmax, kmin, segq, smin, smax, _shift_arr(shift))
    return _dispatch(args, tpu, gpu, interpret, kernels)


def _shift_arr(shift):
    return jnp.reshape(jnp.asarray(shift, jnp.int32), (1,))


def _block_bounds_tpu(qp, wp, kmax, kmin, segq, smin, smax, shift, *, bq, bk, t_total, s_total, causal,
                      interpret):
    b, tp, hi, di = qp.shape
    nq, nk = tp // bq, kmax.shape[1]
    kern = functools.partial(_bound_kernel, n_heads=hi, bq=bq, bk=bk, t_total=t_total, causal=causal)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,   # the causal shift (S - T, or the context chunk's global query offset)
        grid=(b, nq),
        in_specs=[
            pl.BlockSpec((1, bq, hi, di), lambda bi, i, sh: (bi, i, 0, 0)),
            pl.BlockSpec((1, bq, hi), lambda bi, i, sh: (bi, i, 0)),
            pl.BlockSpec((1, nk, di), lambda bi, i, sh: (bi, 0, 0)),
            pl.BlockSpec((1, nk, di), lambda bi, i, sh: (bi, 0, 0)),
            pl.BlockSpec((1, bq, 1), lambda bi, i, sh: (bi, i, 0)),
            pl.BlockSpec((1, 1, nk), lambda bi, i, sh: (bi, 0, 0)),
            pl.BlockSpec((1, 1, nk), lambda bi, i, sh: (bi, 0, 0)),
        ],
        out_specs=pl.BlockSpec((1, 1, 1, nk), lambda bi, i, sh: (bi, i, 0, 0)),
    )
    ub = pl.pallas_call(
        kern,
        out_shape=jax.ShapeDtypeStruct((b, nq, 1, nk), _F32),
        grid_spec=grid_spec,
        cost_estimate=bound_cost(qp, wp, kmax, kmin, segq, smin, smax, b * nq * nk),
        interpret=interpret,
    )(shift, qp, wp, kmax, kmin, segq, smin, smax)
    return ub[:, :, 0, :]  # [B, nq, nk]


# ----------------------------------------------------------------------------------------------
# indexer: token scoring kernel over a scalar-prefetched block table
# ----------------------------------------------------------------------------------------------

def _score_kernel(tbl_ref, act_ref, off_ref, q_ref, w_ref, k_ref, segq_ref, segk_ref, o_ref, *,
                  n_heads, bq, bk, t_total, s_total, causal):
    bi, i, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pos = off_ref[0] + c
    kb = tbl_ref[bi, i, pos]
    active = act_ref[bi, i, pos] > 0

    @pl.when(active)
    def _():
        k = k_ref[0].astype(_F32)  # [bk, Di]
        w = w_ref[0].astype(_F32)  # [bq, Hi]
        acc = jnp.zeros((bq, bk), _F32)
        for j in range(n_heads):
            d = _dot_t(q_ref[0, :, j, :].astype(_F32), k)
            acc = acc + w[:, j:j + 1] * jnp.maximum(d, 0.0)
        t = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        s = kb * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        vis = (s < s_total) & (segq_ref[0] == segk_ref[0])  # [bq, 1] == [1, bk]: same document
        if causal:   # off_ref[1]: the causal shift (S - T, or the chunk's global query offset)
            vis = vis & (s <= t + off_ref[1])
        o_ref[0] = jnp.where(vis, acc, NEG_INF)

    @pl.when(jnp.logical_not(active))
    def _():
        o_ref[0] = jnp.full((bq, bk), NEG_INF, _F32)


def _score_round(tbl, act, off, qp, wp, kp, segq, segk, shift, n_blocks, *, bq, bk, t_total, s_total,
                 causal, interpret, kernels="auto"):
    """Scores of the n_blocks table entries starting at `off` -> ([B, Tp, n*bk], key idx); the
    kernel chosen as in `_block_bounds`."""
    kw = dict(bq=bq, bk=bk, t_total=t_total, s_total=s_total, causal=causal)

    def gpu(interp):
        def run(tbl, act, off, qp, wp, kp, segq, segk):
            vals = _idx_gpu.score_round(tbl, act, off, qp, wp, kp, segq[..., 0], segk[:, 0], n_blocks,
                                        interpret=interp, **kw)
            return vals, _round_ids(tbl, off[0], n_blocks, bq, bk, qp.shape[1])
        return run

    tpu = lambda interp: lambda *a: _score_round_tpu(*a, n_blocks, interpret=interp, **kw)
    # [round offset, causal shift]: one scalar-prefetch / scalar-load array for both kernels
    off = jnp.stack([jnp.asarray(off, jnp.int32), jnp.asarray(shift, jnp.int32)])
    args = (tbl, act, off, qp, wp, kp, segq, segk)
    return _dispatch(args, tpu, gpu, interpret, kernels)


def _round_ids(tbl, off, n_blocks, bq, bk, tp):
    """Key index of every scored column: [B, Tp, n_blocks * bk]."""
    b, nq = tbl.shape[:2]
    blk = jax.lax.dynamic_slice_in_dim(tbl, off, n_blocks, axis=2)  # [B, nq, n]
    idx = (blk[..., None] * bk + jnp.arange(bk, dtype=jnp.int32)).reshape(b, nq, n_blocks * bk)
    return jnp.repeat(idx, bq, axis=1)


def _score_round_tpu(tbl, act, off, qp, wp, kp, segq, segk, n_blocks, *, bq, bk, t_total, s_total,
                     causal, interpret):
    b, tp, hi, di = qp.shape
    nq = tp // bq
    kern = functools.partial(_score_kernel, n_heads=hi, bq=bq, bk=bk, t_total=t_total,
                             s_total=s_total, causal=causal)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, nq, n_blocks),
        in_specs=[
            pl.BlockSpec((1, bq, hi, di), lambda bi, i, c, t_, a_, o_: (bi, i, 0, 0)),
            pl.BlockSpec((1, bq, hi), lambda bi, i, c, t_, a_, o_: (bi, i, 0)),
            # inactive entries repeat the previous block id, so no new DMA is issued for them
            pl.BlockSpec((1, bk, di), lambda bi, i, c, t_, a_, o_: (bi, t_[bi, i, o_[0] + c], 0)),
            pl.BlockSpec((1, bq, 1), lambda bi, i, c, t_, a_, o_: (bi, i, 0)),
            pl.BlockSpec((1, 1, bk), lambda bi, i, c, t_, a_, o_: (bi, 0, t_[bi, i, o_[0] + c])),
        ],
        out_specs=pl.BlockSpec((1, bq, bk), lambda bi, i, c, t_, a_, o_: (bi, i, c)),
    )
    vals = pl.pallas_call(
        kern,
        out_shape=jax.ShapeDtypeStruct((b, tp, n_blocks * bk), _F32),
        grid_spec=grid_spec,
        cost_estimate=score_cost(qp, wp, kp, n_blocks, bq, bk),
        interpret=interpret,
    )(tbl, act, off, qp, wp, kp, segq, segk)
    return vals, _round_ids(tbl, off[0], n_blocks, bq, bk, tp)


def _merge_topk(run_v, run_i, new_v, new_i, topk):
    cat_v = jnp.concatenate([run_v, new_v], axis=-1)
    cat_i = jnp.concatenate([run_i, new_i], axis=-1)
    vals, pos = jax.lax.top_k(cat_v, topk)
    return vals, jnp.take_along_axis(cat_i, pos, axis=-1)


def _table(order_key, sel, width):
    """Per (b, query block): block ids with sel first (ascending order_key), inactive repeat the
    last active id. Returns (tbl, act) int32 [B, nq, width]."""
    nk = sel.shape[-1]
    order = jnp.argsort(order_key, axis=-1, stable=True).astype(jnp.int32)[..., :width]
    n_sel = jnp.sum(sel, axis=-1, dtype=jnp.int32)
    pos = jnp.arange(width, dtype=jnp.int32)
    act = pos < n_sel[..., None]
    last = jnp.take_along_axis(order, jnp.maximum(n_sel - 1, 0)[..., None], axis=-1)
    tbl = jnp.where(act, order, last)
    del nk
    return tbl, act.astype(jnp.int32), n_sel


def _segments(segment_ids, b, t, s, tp, sp, bk, kv_segment_ids=None):
    """Segment ids for the kernels: queries [B, Tp, 1], keys [B, 1, Sp] and the per key block
    [min, max] range [B, 1, nk]. None -> one document (all zeros). Padded keys get an id no query
    has and are excluded from the block ranges. kv_segment_ids [B, S]: the keys' own ids (S != T,
    context parallelism); default: segment_ids, which then needs S == T."""
    if kv_segment_ids is not None:
        if segment_ids is None or segment_ids.shape != (b, t) or kv_segment_ids.shape != (b, s):
            raise ValueError(f"kv_segment_ids {kv_segment_ids.shape} must be [B={b}, S={s}] and come with "
                             f"segment_ids [B={b}, T={t}] (got {None if segment_ids is None else segment_ids.shape})")
        seg_q, seg_k = segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
    elif segment_ids is None:
        seg_q, seg_k = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32)
    elif segment_ids.shape != (b, t) or s != t:
        raise ValueError(f"segment_ids {segment_ids.shape} must be [B={b}, T={t}] with S == T "
                         f"(got S={s}; pass kv_segment_ids [B, S] for S != T)")
    else:
        seg_q = seg_k = segment_ids.astype(jnp.int32)
    segq = jnp.pad(seg_q, ((0, 0), (0, tp - t)))[:, :, None]
    big = jnp.iinfo(jnp.int32).max
    segk = jnp.pad(seg_k, ((0, 0), (0, sp - s)), constant_values=-big)  # never a query's id
    kvalid = jnp.arange(sp) < s
    blocks = lambda x, fill: jnp.where(kvalid, x, fill).reshape(b, 1, sp // bk, bk)
    smin = blocks(segk, big).min(axis=-1)
    smax = blocks(segk, -big).max(axis=-1)
    return segq, segk[:, None, :], smin, smax


def indexer_topk(q_idx, k_idx, weights, topk: int, *, causal: bool = True, block_size: int = 128,
                 query_block: int | None = None, round_blocks: int | None = None,
                 interpret=None, mode: str = "exact", approx_blocks: int | None = None,
                 segment_ids=None, kernels: str = "auto", q_offset=None, kv_segment_ids=None):
    """Top-k keys per query by the lightning-indexer score (see module docstring).

    q_idx [B, T, Hi, Di], k_idx [B, S, Di], weights [B, T, Hi] -> int32 [B, T, topk], -1 in slots
    past the number of visible keys. `segment_ids` [B, T] (packed documents, needs S == T): a key
    is visible only to queries of its own document, as in the reference. `kernels`: "auto" picks
    the Mosaic kernels on TPU (and in interpret mode), the Triton ones on GPU; "tpu" / "gpu" force
    one family (kernels="gpu", interpret=True tests the GPU kernels on CPU). mode="exact" returns exactly `dsa_xla.indexer_topk`'s result
    (same set, same order, same tie-break) up to float rounding of the scores; mode="approx" keeps
    the `approx_blocks` best key blocks per query block by the block bound (default
    2 * ceil(topk / block_size)) and the exact top-k inside them.
    q_offset (context parallelism, glm5_jax.attention.context): the T queries sit at global positions
    q_offset .. q_offset + T - 1 of the S keys (an int or a traced int32 scalar; causal: query t sees
    keys s <= q_offset + t; default: bottom-right alignment, s <= t + S - T), and kv_segment_ids [B, S]
    are the keys' segment ids (with segment_ids [B, T] for the queries). Returns what
    `dsa_xla.indexer_topk` returns with the same arguments.
    """
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if mode not in ("exact", "approx"):
        raise ValueError(f"mode must be 'exact' or 'approx', got {mode!r}")
    interpret = _interpret(interpret)
    b, t, hi, di = q_idx.shape
    s = k_idx.shape[1]
    bk = int(block_size)
    bq = int(query_block or block_size)
    bq = min(bq, _cdiv(t, 8) * 8)
    tp, sp = _cdiv(t, bq) * bq, _cdiv(s, bk) * bk
    nq, nk = tp // bq, sp // bk
    qp = jnp.pad(q_idx, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    wp = jnp.pad(weights, ((0, 0), (0, tp - t), (0, 0)))
    kp = jnp.pad(k_idx, ((0, 0), (0, sp - s), (0, 0)))
    kvalid = (jnp.arange(sp) < s)[None, :, None]
    kf = kp.astype(_F32)
    kmax = jnp.where(kvalid, kf, NEG_INF).reshape(b, nk, bk, di).max(axis=2)
    kmin = jnp.where(kvalid, kf, -NEG_INF).reshape(b, nk, bk, di).min(axis=2)
    if kernels not in ("auto", "tpu", "gpu"):
        raise ValueError(f"kernels must be 'auto', 'tpu' or 'gpu', got {kernels!r}")
    common = dict(bq=bq, bk=bk, t_total=t, s_total=s, causal=causal, interpret=interpret,
                  kernels=kernels)

    segq, segk, smin, smax = _segments(segment_ids, b, t, s, tp, sp, bk, kv_segment_ids)
    shift = jnp.int32(s - t) if q_offset is None else jnp.asarray(q_offset, jnp.int32)
    segs = (segq, segk, shift)

    # pass 1: per (query block, key block) upper bound of the score
    ub = _block_bounds(qp, wp, kmax, kmin, segq, smin, smax, shift, **common)  # [B, nq, nk]
    vis_blk = ub > NEG_INF
    blk_ids = jnp.arange(nk, dtype=jnp.int32)

    if mode == "approx":
        n = min(nk, int(approx_blocks or 2 * _cdiv(topk, bk)))
        best = jnp.argsort(-ub, axis=-1, stable=True)[..., :n]
        sel = jnp.zeros(ub.shape, bool).at[
            jnp.arange(b)[:, None, None], jnp.arange(nq)[None, :, None], best].set(True) & vis_blk
        tbl, act, _ = _table(jnp.where(sel, blk_ids, nk + blk_ids), sel, n)
        vals, idx = _score_round(tbl, act, jnp.int32(0), qp, wp, kp, *segs, n, **common)
        if vals.shape[-1] < topk:
            pad = topk - vals.shape[-1]
            vals = jnp.pad(vals, ((0, 0), (0, 0), (0, pad)), constant_values=NEG_INF)
            idx = jnp.pad(idx, ((0, 0), (0, 0), (0, pad)))
        v, pos = jax.lax.top_k(vals, topk)
        out = jnp.take_along_axis(idx, pos, axis=-1)
        return jnp.where(v == NEG_INF, -1, out)[:, :t].astype(jnp.int32)

    # pass 2a: threshold probe on the best-bounded blocks
    n_probe = _cdiv(topk, bk)
    if n_probe <= nk:
        best = jnp.argsort(-ub, axis=-1, stable=True)[..., :n_probe].astype(jnp.int32)
        pact = jnp.take_along_axis(vis_blk, best, axis=-1).astype(jnp.int32)
        pv, _ = _score_round(best, pact, jnp.int32(0), qp, wp, kp, *segs, n_probe, **common)
        tau_t = jax.lax.top_k(pv, topk)[0][..., -1]  # [B, Tp]; -inf if < topk visible
        tau_t = jnp.where(jnp.arange(tp) < t, tau_t, -NEG_INF)
        tau = tau_t.reshape(b, nq, bq).min(axis=-1)  # [B, nq]
    else:
        tau = jnp.full((b, nq), NEG_INF, _F32)
    slack = 1e-4 * (jnp.abs(ub) + jnp.abs(tau)[..., None]) + 1e-30
    surv = vis_blk & ((tau[..., None] == NEG_INF) | (ub + slack >= tau[..., None]))

    # pass 2b: exact token scores inside surviving blocks, in rounds, merged by stable top-k
    rb = int(round_blocks or max(1, _cdiv(2 * topk, bk)))
    rb = min(rb, nk)
    width = _cdiv(nk, rb) * rb
    tbl, act, n_surv = _table(jnp.where(surv, blk_ids, nk + blk_ids), surv, nk)
    tbl = jnp.pad(tbl, ((0, 0), (0, 0), (0, width - nk)), mode="edge")
    act = jnp.pad(act, ((0, 0), (0, 0), (0, width - nk)))
    n_rounds = _cdiv(jnp.max(n_surv), rb)

    def body(carry):
        r, run_v, run_i = carry
        vals, idx = _score_round(tbl, act, r * rb, qp, wp, kp, *segs, rb, **common)
        run_v, run_i = _merge_topk(run_v, run_i, vals, idx, topk)
        return r + 1, run_v, run_i

    init = (jnp.int32(0), jnp.full((b, tp, topk), NEG_INF, _F32),
            jnp.zeros((b, tp, topk), jnp.int32))
    _, run_v, run_i = jax.lax.while_loop(lambda c: c[0] < n_rounds, body, init)
    return jnp.where(run_v == NEG_INF, -1, run_i)[:, :t].astype(jnp.int32)


def indexer_block_stats(q_idx, k_idx, weights, topk, *, causal=True, block_size=128,
                        interpret=None):
    """Diagnostics for the benchmark: fraction of visible key blocks that survive the bound."""
    b, t, hi, di = q_idx.shape
    s = k_idx.shape[1]
    bk = bq = min(block_size, _cdiv(t, 8) * 8)
    tp, sp = _cdiv(t, bq) * bq, _cdiv(s, bk) * bk
    nk = sp // bk
    qp = jnp.pad(q_idx, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    wp = jnp.pad(weights, ((0, 0), (0, tp - t), (0, 0)))
    kf = jnp.pad(k_idx, ((0, 0), (0, sp - s), (0, 0))).astype(_F32)
    kvalid = (jnp.arange(sp) < s)[None, :, None]
    kmax = jnp.where(kvalid, kf, NEG_INF).reshape(b, nk, bk, di).max(axis=2)
    kmin = jnp.where(kvalid, kf, -NEG_INF).reshape(b, nk, bk, di).min(axis=2)
    segq, _, smin, smax = _segments(None, b, t, s, tp, sp, bk)
    ub = _block_bounds(qp, wp, kmax, kmin, segq, smin, smax, jnp.int32(s - t), bq=bq, bk=bk, t_total=t, s_total=s,
                       causal=causal, interpret=_interpret(interpret))
    return ub


# ----------------------------------------------------------------------------------------------
# sparse attention
# ----------------------------------------------------------------------------------------------

def _round_up(x, m):
    return _cdiv(x, m) * m


def _pow2(x, lo=16):
    return max(lo, 1 << max(0, int(x) - 1).bit_length())


def _fold_heads(q, k, v, idx):
    """KV heads into the batch: every kernel sees one KV head.

    Hk == 1: q [B,T,H,D], k [B,S,D], v [B,S,Dv], idx [B,T,K]. Hk == H: batch B*H, one query head."""
    b, t, h, dq = q.shape
    hk = k.shape[2]
    if hk == 1:
        return q, k[:, :, 0], v[:, :, 0], idx
    s = k.shape[1]
    q2 = jnp.swapaxes(q, 1, 2).reshape(b * h, t, 1, dq)
    k2 = jnp.swapaxes(k, 1, 2).reshape(b * h, s, k.shape[-1])
    v2 = jnp.swapaxes(v, 1, 2).reshape(b * h, s, v.shape[-1])
    idx2 = jnp.broadcast_to(idx[:, None], (b, h) + idx.shape[1:]).reshape(b * h, t, -1)
    return q2, k2, v2, idx2


def _unfold_heads(x, b, h, hk):
    """[B', T, H', ...] (folded) -> [B, T, H, ...]."""
    if hk == 1:
        return x
    x = x.reshape((b, h) + x.shape[1:])[:, :, :, 0]  # [B, H, T, ...]
    return jnp.swapaxes(x, 1, 2)


def _pad_idx(idx, tp, kp):
    t, kk = idx.shape[1], idx.shape[2]
    return jnp.pad(idx, ((0, 0), (0, tp - t), (0, kp - kk)), constant_values=-1)


def _pad_to(x, shape, value=0):
    return jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape)], constant_values=value)


def _tpu_blocks(h, kk, bq, kc, interpret):
    """(bq, kc) for the TPU kernels. Interpret mode keeps the caller's blocks. For Mosaic: kc a
    multiple of 128 or all of K (block-shape rule for the [.., kc] index / P / dS blocks), and
    bq capped so that a step gathers <= 1024 rows per tensor and bq*H <= 256 matmul rows."""
    kc = min(kc, kk)
    if interpret:
        return bq, kc
    if kc < kk:
        kc = min(_round_up(kc, 128), kk)
    bq = max(1, min(bq, 256 // h, 1024 // kc))
    return bq, kc


def _fwd_tpu(q2, k2, v2, idx2, scale, bq, kc, interpret):
    t, h, kk = q2.shape[1], q2.shape[2], idx2.shape[-1]
    bq, kc = _tpu_blocks(h, kk, bq, kc, interpret)
    tp, kp = _round_up(t, bq), _round_up(kk, kc)
    o, lse = _tpu.attn_fwd(_pad_to(q2, (q2.shape[0], tp) + q2.shape[2:]), k2, v2,
                           _pad_idx(idx2, tp, kp), scale=scale, bq=bq, kc=kc,
                           interpret=interpret)
    return o[:, :t], lse[:, :t, :, 0]


def _gpu_dims(q2, v2, kk, kc):
    """Triton shapes: H, Dq, Dv, kc padded to powers of two >= 16; kc also capped so that the
    gathered [kc, Dq] + [kc, Dv] tiles stay <= 64 KiB (shared-memory operands of tl.dot)."""
    bp, t, h, dq = q2.shape
    dqp, dvp = _pow2(dq), _pow2(v2.shape[-1])
    cap = max(16, (64 * 1024) // ((dqp + dvp) * q2.dtype.itemsize))
    kc = min(_pow2(min(kc, kk)), 1 << (cap.bit_length() - 1))
    return (bp, t, _pow2(h), dqp, dvp), kc, _round_up(kk, kc)


def _fwd_gpu(q2, k2, v2, idx2, scale, kc):
    t, h, kk, dv = q2.shape[1], q2.shape[2], idx2.shape[-1], v2.shape[-1]
    (bp, _, hp, dqp, dvp), kc, kp = _gpu_dims(q2, v2, kk, kc)
    o, lse = _triton.attn_fwd(_pad_to(q2, (bp, t, hp, dqp)), _pad_to(k2, k2.shape[:2] + (dqp,)),
                              _pad_to(v2, v2.shape[:2] + (dvp,)), _pad_idx(idx2, t, kp),
                              scale=scale, kc=kc)
    return o[:, :, :h, :dv], lse[:, :, :h]


def _attn_fwd(q, k, v, indices, scale, bq, kc, interpret):
    b, t, h, _ = q.shape
    hk = k.shape[2]
    q2, k2, v2, idx2 = _fold_heads(q, k, v, indices.astype(jnp.int32))
    tpu_fn = lambda interp: lambda *a: _fwd_tpu(*a, scale, bq, kc, interp)
    gpu_fn = lambda interp: lambda *a: _fwd_gpu(*a, scale, kc)
    o, lse = _dispatch((q2, k2, v2, idx2), tpu_fn, gpu_fn, interpret)
    return _unfold_heads(o, b, h, hk), _unfold_heads(lse, b, h, hk)


def _bwd_tpu(q2, k2, v2, idx2, do2, lse2, delta2, scale, bq, kc, interpret):
    bp, t, h, _ = q2.shape
    kk = idx2.shape[-1]
    bq, kc = _tpu_blocks(h, kk, bq, kc, interpret)
    tp, kp = _round_up(t, bq), _round_up(kk, kc)
    padt = lambda x, v=0: _pad_to(x, (bp, tp) + x.shape[2:], v)
    dq, p, ds = _tpu.attn_bwd_dq(
        padt(q2), k2, v2, _pad_idx(idx2, tp, kp), padt(do2), padt(lse2, NEG_INF)[..., None],
        padt(delta2)[..., None], scale=scale, bq=bq, kc=kc, interpret=interpret)
    return dq[:, :t], p[:, :t, :, :kk], ds[:, :t, :, :kk]


def _bwd_gpu(q2, k2, v2, idx2, do2, lse2, delta2, scale, kc):
    t, h, dq_dim, kk = q2.shape[1], q2.shape[2], q2.shape[3], idx2.shape[-1]
    (bp, _, hp, dqp, dvp), kc, kp = _gpu_dims(q2, v2, kk, kc)
    dq, p, ds = _triton.attn_bwd_dq(
        _pad_to(q2, (bp, t, hp, dqp)), _pad_to(k2, k2.shape[:2] + (dqp,)),
        _pad_to(v2, v2.shape[:2] + (dvp,)), _pad_idx(idx2, t, kp),
        _pad_to(do2, (bp, t, hp, dvp)), _pad_to(lse2, (bp, t, hp), NEG_INF),
        _pad_to(delta2, (bp, t, hp)), scale=scale, kc=kc)
    return dq[:, :, :h, :dq_dim], p[:, :, :h, :kk], ds[:, :, :h, :kk]


def _bwd_chunk_rows(bq_kernel, h, kk, dq, dv, tp, rows=None):
    """Queries per backward chunk: a multiple of the kernel's query block, sized so that one
    chunk's float32 P and dS ([rows, H, K] each) and dK/dV row contributions ([rows, K, Dq + Dv])
    stay under ~256 MiB (GLM-5 shapes: 24 queries). `rows` overrides (tests use tiny chunks)."""
    if rows is None:
        per_query = 4 * (2 * h * kk + kk * (dq + dv))
        rows = max(1, (256 << 20) // per_query)
    rows = max(bq_kernel, (int(rows) // bq_kernel) * bq_kernel)
    return min(rows, _round_up(tp, bq_kernel))


def _attn_bwd_pallas(q, k, v, indices, o, lse, do, scale, bq, kc, interpret, bwd_rows=None):
    """dq from the Pallas kernel, dk / dv by an XLA scatter-add, chunk by chunk over queries.

    The kernel returns, besides dq, the chunk's P and scale*dS [B, rows, H, K]; the dK rows
    (dS^T Q) and dV rows (P^T dO) are summed over heads and scatter-added into float32 dK/dV
    carried through a fori_loop. Only one chunk's P / dS exist at a time: the backward holds no
    [T, H, K] array (docs/kernels.md: compiled temp memory at GLM-5 shapes). Why not a dK/dV kernel:
    a key row's gradient sums over the queries that selected it, i.e. the transposed (key ->
    queries) index lists, and Pallas TPU has no atomic add to scatter into HBM from parallel
    grid steps; the per-chunk scatter keeps the same O(chunk) memory without that sort."""
    b, t, h, _ = q.shape
    s, hk = k.shape[1], k.shape[2]
    indices = indices.astype(jnp.int32)
    delta = jnp.sum(do.astype(_F32) * o.astype(_F32), axis=-1)  # [B, T, H]
    q2, k2, v2, idx2 = _fold_heads(q, k, v, indices)
    do2 = _fold_heads(do, k, v, indices)[0]
    fold = lambda x: _fold_heads(x[..., None], k, v, indices)[0][..., 0]
    lse2, delta2 = fold(lse), fold(delta)
    bp, _, h2, dqd = q2.shape
    kk, dvd = idx2.shape[-1], v2.shape[-1]
    bq_k = _tpu_blocks(h2, kk, bq, kc, interpret)[0]
    rows = _bwd_chunk_rows(bq_k, h2, kk, dqd, dvd, t, bwd_rows)
    tp = _round_up(t, rows)
    padt = lambda x, val=0: _pad_to(x, (bp, tp) + x.shape[2:], val)
    q2, do2, delta2, lse2 = padt(q2), padt(do2), padt(delta2), padt(lse2, NEG_INF)
    idx2 = padt(idx2, -1)

    def kernel(qc, ic, doc, lc, dc):
        tpu_fn = lambda interp: lambda *a: _bwd_tpu(*a, scale, bq, kc, interp)
        gpu_fn = lambda interp: lambda *a: _bwd_gpu(*a, scale, kc)
        return _dispatch((qc, k2, v2, ic, doc, lc, dc), tpu_fn, gpu_fn, interpret)

    bidx = jnp.arange(bp)[:, None, None]

    def chunk(c, carry):
        dq_all, dk, dvv = carry
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, c * rows, rows, axis=1)
        qc, ic, doc = sl(q2), sl(idx2), sl(do2)
        dqc, pc, dsc = kernel(qc, ic, doc, sl(lse2), sl(delta2))  # P, dS [B', rows, H', K] f32
        cv = jnp.einsum("bthk,bthd->btkd", pc, doc.astype(_F32))
        ck = jnp.einsum("bthk,bthd->btkd", dsc, qc.astype(_F32))
        safe = jnp.where(ic >= 0, ic, s)  # out of range -> dropped
        dvv = dvv.at[bidx, safe].add(cv, mode="drop")
        dk = dk.at[bidx, safe].add(ck, mode="drop")
        dq_all = jax.lax.dynamic_update_slice_in_dim(dq_all, dqc.astype(q.dtype), c * rows, axis=1)
        return dq_all, dk, dvv

    init = (jnp.zeros(q2.shape, q.dtype), jnp.zeros(k2.shape, _F32), jnp.zeros(v2.shape, _F32))
    dq2, dk2, dv2 = jax.lax.fori_loop(0, tp // rows, chunk, init)
    dq = _unfold_heads(dq2[:, :t], b, h, hk)
    if hk == 1:
        dk, dvv = dk2[:, :, None], dv2[:, :, None]
    else:  # [B*H, S, D] -> [B, S, H, D]
        dk = jnp.swapaxes(dk2.reshape(b, h, s, -1), 1, 2)
        dvv = jnp.swapaxes(dv2.reshape(b, h, s, -1), 1, 2)
    return dq, dk.astype(k.dtype), dvv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _sparse_attention(q, k, v, indices, scale, bq, kc, interpret, bwd_rows):
    return _attn_fwd(q, k, v, indices, scale, bq, kc, interpret)[0]


def _sa_fwd(q, k, v, indices, scale, bq, kc, interpret, bwd_rows):
    o, lse = _attn_fwd(q, k, v, indices, scale, bq, kc, interpret)
    return o, (q, k, v, indices, o, lse)


def _sa_bwd(scale, bq, kc, interpret, bwd_rows, res, do):
    q, k, v, indices, o, lse = res
    dq, dk, dv = _attn_bwd_pallas(q, k, v, indices, o, lse, do, scale, bq, kc, interpret,
                                  bwd_rows)
    return dq, dk, dv, None


_sparse_attention.defvjp(_sa_fwd, _sa_bwd)


def sparse_attention(q, k, v, indices, *, scale: float, interpret=None, block_q: int = 64,
                     block_k: int = 128, bwd_rows: int | None = None):
    """Attention of each query over its selected keys (Pallas; differentiable in q, k, v).

    q [B, T, H, Dq], k [B, S, Hk, Dq], v [B, S, Hk, Dv], Hk in {1, H}, indices int32 [B, T, K]
    (-1 = none) -> [B, T, H, Dv] in q's dtype. block_q queries per grid step, block_k selected
    keys per online-softmax chunk (interpret mode uses them as given; the TPU and GPU lowerings
    adjust them to their block-shape rules, see `_tpu_blocks` / `_gpu_dims`). `bwd_rows`: queries
    per backward chunk (default: sized by `_bwd_chunk_rows`).
    Without interpret the kernel is chosen per platform (`lax.platform_dependent`): TPU ->
    Mosaic DMA-gather kernels (`sparse_attn_tpu`), CUDA/ROCm -> Pallas Triton
    (`sparse_attn_triton`).
    """
    h, hk = q.shape[2], k.shape[2]
    if hk not in (1, h):
        raise ValueError(f"k has {hk} heads; sparse_attention allows 1 or H={h}")
    if indices.shape[:2] != q.shape[:2]:
        raise ValueError(f"indices {indices.shape} must be [B, T, K] with [B, T] = {q.shape[:2]}")
    return _sparse_attention(q, k, v, indices.astype(jnp.int32), float(scale), int(block_q),
                             int(block_k), _interpret(interpret),
                             None if bwd_rows is None else int(bwd_rows))


def sparse_attention_with_lse(q, k, v, indices, *, scale: float, interpret=None,
                              block_q: int = 64, block_k: int = 128):
    """Forward only: (out [B, T, H, Dv], lse [B, T, H] float32, -inf on empty rows)."""
    return _attn_fwd(q, k, v, indices.astype(jnp.int32), float(scale), int(block_q),
                     int(block_k), _interpret(interpret))


class PallasRows(typing.NamedTuple):
    """`dsa_xla.sparse_mqa_uv`'s per-query work with the Pallas kernels: the forward is `sparse_attention`'s
    (value = the key rows' first r columns), the backward on TPU is `sparse_mqa_tpu.mqa_bwd` (the key gradient's
    scatter-add fused: per query the K rows are read once and the dK rows read and written once, nothing per
    slot reaches HBM). On GPU the backward is the jnp path's (`dsa_xla.JnpRows`): there is no fused Triton
    backward yet (docs/kernels.md)."""
    interpret: bool | None
    block_q: int
    block_k: int
    chunk: int

    def fwd(self, q, k, indices, scale, r):
        return _attn_fwd(q, k[:, :, None], k[:, :, None, :r], indices, scale, self.block_q, self.block_k,
                         self.interpret)

    def bwd(self, q, k, do, indices, lse, scale, r):
        h = q.shape[2]
        jnp_rows = _xla.JnpRows(_xla._tile_chunk(q.shape[1], indices.shape[-1], q.shape[-1], self.chunk))

        def tpu(interp):
            def run(q, k, do, indices, lse):
                odq, dk = _mqa_tpu.mqa_bwd(q, k, do, indices, lse, scale=scale, interpret=interp)
                return odq[:, :, h:], odq[:, :, :h, :r], dk
            return run

        def gpu(interp):
            return lambda *a: jnp_rows.bwd(*a, scale, r)

        return _dispatch((q, k, do, indices, lse), tpu, gpu, self.interpret)


def sparse_mqa_uv(q, k, w_uv, indices, *, scale: float, interpret=None, block_q: int = 64, block_k: int = 128,
                  chunk: int = 16):
    """`dsa_xla.sparse_mqa_uv` (MLA's MQA sparse attention with W_UV, one custom VJP that keeps only the LSE)
    with the Pallas kernels (`PallasRows`): q [B, T, H, Dq], k [B, S, 1, Dq], w_uv [r, H, dv], indices [B, T, K]
    -> [B, T, H, dv]."""
    return _xla.sparse_mqa_uv(q, k, w_uv, indices, scale=scale,
                              rows=PallasRows(_interpret(interpret), int(block_q), int(block_k), int(chunk)))
