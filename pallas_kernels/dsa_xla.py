"""The DSA kernels in plain jnp, compiled by XLA: the production path (`ModelConfig.attention_impl="xla"`,
the default, and every CPU run) and what the Pallas kernels (`pallas_kernels.dsa`) are tested against.

Both functions work chunk by chunk over queries, so neither writes a [T, S] array (or a full
gathered [T, K, D] tensor) to memory: peak extra memory is [B, chunk, S] for the indexer and
[B, chunk, K, Hk, D] for the attention.

Conventions shared with the Pallas kernels in `pallas_kernels.dsa`:
  * causal alignment is bottom-right: query t of T sees key s of S iff s <= t + (S - T)
    (prefill S == T; a chunk of queries at the end of a longer key sequence otherwise);
  * optional `segment_ids` ([B, T], needs S == T): a key is visible only inside its document;
  * top-k ties break towards the lower key index (the order of `jax.lax.top_k`);
  * slots past the number of visible keys hold -1; attention rows with no valid index return 0.
"""

from __future__ import annotations

import functools
import typing

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

NEG_INF = float("-inf")   # the one masked-score value (a Python float: usable inside Pallas kernels)


def pick_chunk(t: int, target: int) -> int:
    """Largest divisor of t that is <= target (chunks must tile T exactly for lax.map)."""
    c = max(1, min(t, target))
    while t % c:
        c -= 1
    return c


def visible_mask(t0, tc: int, s: int, t_total: int, causal: bool, seg_q=None, seg_k=None,
                 length: int | None = None, q_offset=None):
    """Bool [B or 1, tc, length or s]: key j visible from query t0 + i (bottom-right causal alignment,
    or at global position q_offset + t0 + i when q_offset is given: context parallelism), for the
    keys of an S-long sequence, or only its prefix [0, length) when `length` is given."""
    n_keys = s if length is None else length
    q_pos = t0 + jnp.arange(tc)[:, None] + ((s - t_total) if q_offset is None else q_offset)
    k_pos = jnp.arange(n_keys)[None, :]
    mask = (k_pos <= q_pos) if causal else jnp.ones((tc, n_keys), bool)
    mask = mask[None]
    if seg_q is not None:
        mask = mask & (seg_q[:, :, None] == seg_k[:, None, :])
    return mask


def index_scores(q_idx, k_idx, weights):
    """I[b, t, s] = sum_j weights[b, t, j] * relu(q_idx[b, t, j] . k_idx[b, s]), in float32.

    Callers fold the softmax scale (Di^-0.5, applied before the ReLU) into q_idx, and the
    head-weight scale (Hi^-0.5) into `weights`.
    """
    dots = jnp.einsum("bthd,bsd->bths", q_idx.astype(jnp.float32), k_idx.astype(jnp.float32))
    return jnp.einsum("bth,bths->bts", weights.astype(jnp.float32), jax.nn.relu(dots))


# --- exact top-k by threshold selection -------------------------------------------------------
#
# XLA's CPU TopK is a per-row partial sort (cost grows with k: ~0.8 ms per 32K-long row for
# k = 512), while fused compare+count passes over a row are ~50x cheaper. So the exact top-k is:
#   1. map float32 scores to int32 keys that preserve XLA TopK's total order (-0.0 < +0.0, -inf
#      lowest among non-NaN; ties are then broken by index inside lax.top_k);
#   2. bisect per row for a threshold `lo` with count(keys >= lo) >= k (always true) and
#      count(keys >= lo) <= cap (stop as soon as it holds, or when the bracket is one key: a run
#      of ties), alternating value-space and key-space midpoints (count passes only);
#   3. lax.top_k over the row with every key below `lo` replaced by -inf: the top-k of that row
#      is exactly the top-k of the original row (same set, same order, same tie-break, since
#      only elements outside the top-k set were demoted, to below every survivor), and the
#      partial sort then only inserts the <= cap survivors.
# Causal rows also skip the invisible key tail: query chunks are grouped and each group only
# scores the static key prefix that its last query can see.

_SCORE_TILE_BYTES = 4 * 2 ** 20  # one query chunk's [B, tc, Hi, S] index-score dot output
_KEY_NEG_INF = -2139095041  # _sortable_key(-inf) (0x807fffff)
_INT32_MAX = 2 ** 31 - 1


def _sortable_key(x):
    """float32 -> int32, monotone in XLA TopK's total order (-0.0 < +0.0; +NaN highest)."""
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return i ^ ((i >> 31) & jnp.int32(0x7FFFFFFF))


def _key_value(key):
    """Inverse of `_sortable_key`."""
    return jax.lax.bitcast_convert_type(key ^ ((key >> 31) & jnp.int32(0x7FFFFFFF)), jnp.float32)


def _key_midpoint(lo, hi):
    """ceil((lo + hi) / 2) for int32 lo <= hi without overflow: in (lo, hi] when lo < hi."""
    d = jax.lax.bitcast_convert_type(hi - lo, jnp.uint32)  # wraps to the true distance
    return lo + jax.lax.bitcast_convert_type((d >> 1) + (d & 1), jnp.int32)


def _select_threshold(keys, k: int, cap: int):
    """keys int32 [..., L] -> (lo [...], rounds): count(keys >= lo) >= k, and <= cap unless the
    k-th largest key is tied beyond cap. Rows with fewer than k keys above -inf get -inf's key."""
    count = lambda thr: jnp.sum((keys >= thr[..., None]).astype(jnp.int32), axis=-1)
    finite = keys > _KEY_NEG_INF
    n_fin = jnp.sum(finite.astype(jnp.int32), axis=-1)
    enough = n_fin >= k
    hi = jnp.max(keys, axis=-1)  # invariant: count(keys > hi) < k
    lo = jnp.where(enough, jnp.min(jnp.where(finite, keys, _INT32_MAX), axis=-1),
                   jnp.int32(_KEY_NEG_INF))  # invariant: count(keys >= lo) >= k
    cnt = jnp.where(enough, n_fin, 0)  # 0: rows without k finite keys are done at once

    def active(lo, hi, cnt):
        return (cnt > cap) & (lo < hi)

    def body(c):
        r, lo, hi, cnt = c
        # value-space midpoint (fast for O(1)-scaled scores); every third round the key-space
        # midpoint (halves the key range: at most ~3 x 32 rounds in the worst case)
        fmid = _sortable_key(0.5 * _key_value(lo) + 0.5 * _key_value(hi))
        use_f = (r % 3 != 2) & (fmid > lo) & (fmid <= hi)
        mid = jnp.where(use_f, fmid, _key_midpoint(lo, hi))
        c_mid = count(mid)
        act = active(lo, hi, cnt)
        up = act & (c_mid >= k)
        return (r + 1, jnp.where(up, mid, lo), jnp.where(act & ~up, mid - 1, hi),
                jnp.where(up, c_mid, cnt))

    r, lo, _, _ = jax.lax.while_loop(lambda c: jnp.any(active(*c[1:])), body,
                                     (jnp.int32(0), lo, hi, cnt))
    return lo, r


def topk_rows(scores, k: int, *, cap: int | None = None):
    """Exactly `jax.lax.top_k(scores, k)[1]` (ties to the lower index) with -1 where the value is
    -inf, for float32 scores [..., L], k <= L; by threshold selection (see above)."""
    if cap is not None and cap <= 0:  # plain lax.top_k (same result)
        vals, idx = jax.lax.top_k(scores, k)
        return jnp.where(vals == NEG_INF, -1, idx).astype(jnp.int32)
    keys = _sortable_key(scores)
    lo, _ = _select_threshold(keys, k, int(cap or 2 * k))
    vals, idx = jax.lax.top_k(jnp.where(keys >= lo[..., None], scores, NEG_INF), k)
    return jnp.where(vals == NEG_INF, -1, idx).astype(jnp.int32)


_MIN_PREFIX = 1024  # shortest key prefix a causal group scores: below it XLA CPU dots round differently (docs/kernels.md)


def indexer_topk(q_idx, k_idx, weights, topk: int, *, causal: bool = True, segment_ids=None,
                 chunk: int = 256, groups: int = 8, cap: int | None = 0, q_offset=None, kv_segment_ids=None):
    """Exact top-k keys per query by the lightning-indexer score.

    q_idx [B, T, Hi, Di], k_idx [B, S, Di], weights [B, T, Hi] -> int32 [B, T, topk]: the same
    array as `lax.top_k` over each full masked score row (values descending, ties towards the
    lower key index, -1 past the visible keys), computed by threshold selection; causal query
    chunks are split into `groups` groups that each score only their visible key prefix.
    cap=0 (default): plain lax.top_k over that prefix; cap=None or > 0: threshold selection
    (`topk_rows`) first -- identical output, but on XLA CPU not faster (its TopK cost is mostly
    the sort of the k outputs, see BUILD_NOTES).
    q_offset (context parallelism): query t sits at global position q_offset + t of the S keys (an
    int or a traced scalar; every chunk then scores the whole key row), with the keys' segment ids
    in kv_segment_ids [B, S].
    """
    b, t, _, _ = q_idx.shape
    s = k_idx.shape[1]
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if segment_ids is not None and s != t and kv_segment_ids is None:
        raise ValueError(f"segment_ids needs S == T (or kv_segment_ids [B, S]), got S={s}, T={t}")
    kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
    # `chunk` is an upper bound: the chunk's [B, tc, Hi, S] float32 dot output is kept cache-sized
    # (at B=4, T=1024, Hi=8, top-128: 256 -> 32 queries cut the indexer top-k's CPU time ~1.4x)
    row_bytes = b * q_idx.shape[2] * s * 4
    tc = pick_chunk(t, min(chunk, max(32, _SCORE_TILE_BYTES // row_bytes)))
    n = t // tc
    k_eff = min(topk, s)
    g = max(1, min(int(groups), n)) if causal and q_offset is None else 1
    bounds = [round(j * n / g) for j in range(g + 1)]

    def prefix(c1):  # keys [0, length) hold every key visible to queries of chunks < c1
        length = min(s, max(1, c1 * tc + s - t)) if causal and q_offset is None else s
        if length < s:  # whole 128-key tiles, at least _MIN_PREFIX keys (steady dot shapes)
            length = min(s, max(_MIN_PREFIX, -(-length // 128) * 128))
        return length

    # groups with the same key prefix run as one (short T: every prefix is the 1024-key minimum)
    bounds = [c for j, c in enumerate(bounds) if j in (0, g) or prefix(c) != prefix(bounds[j + 1])]
    outs = []
    for c0, c1 in zip(bounds[:-1], bounds[1:]):
        if c1 <= c0:
            continue
        length = prefix(c1)
        kk = min(k_eff, length)
        kx = k_idx[:, :length]
        seg_k = None if segment_ids is None else kv_seg[:, :length]

        def one_chunk(i, kx=kx, seg_k=seg_k, length=length, kk=kk):
            t0 = i * tc
            q = jax.lax.dynamic_slice_in_dim(q_idx, t0, tc, axis=1)
            w = jax.lax.dynamic_slice_in_dim(weights, t0, tc, axis=1)
            seg_q = (None if segment_ids is None
                     else jax.lax.dynamic_slice_in_dim(segment_ids, t0, tc, 1))
            scores = index_scores(q, kx, w)
            mask = visible_mask(t0, tc, s, t, causal, seg_q, seg_k, length=length, q_offset=q_offset)
            return topk_rows(jnp.where(mask, scores, NEG_INF), kk, cap=cap)

        out = jax.lax.map(one_chunk, jnp.arange(c0, c1))  # [n_g, B, tc, kk]
        out = jnp.moveaxis(out, 0, 1).reshape(b, (c1 - c0) * tc, kk)
        if kk < k_eff:
            out = jnp.pad(out, ((0, 0), (0, 0), (0, k_eff - kk)), constant_values=-1)
        outs.append(out)
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    if k_eff < topk:
        out = jnp.pad(out, ((0, 0), (0, 0), (0, topk - k_eff)), constant_values=-1)
    return out


def _indexer_topk_sort(q_idx, k_idx, weights, topk: int, *, causal: bool = True, segment_ids=None,
                 chunk: int = 256):
    """The previous implementation (full-row `lax.top_k` per query chunk), kept for tests:
    `indexer_topk` must return exactly this."""
    b, t, _, _ = q_idx.shape
    s = k_idx.shape[1]
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if segment_ids is not None and s != t:
        raise ValueError(f"segment_ids needs S == T, got S={s}, T={t}")
    tc = pick_chunk(t, chunk)
    k_eff = min(topk, s)

    def one_chunk(i):
        t0 = i * tc
        q = jax.lax.dynamic_slice_in_dim(q_idx, t0, tc, axis=1)
        w = jax.lax.dynamic_slice_in_dim(weights, t0, tc, axis=1)
        seg_q = None if segment_ids is None else jax.lax.dynamic_slice_in_dim(segment_ids, t0, tc, 1)
        scores = index_scores(q, k_idx, w)
        mask = visible_mask(t0, tc, s, t, causal, seg_q, segment_ids)
        scores = jnp.where(mask, scores, NEG_INF)
        vals, idx = jax.lax.top_k(scores, k_eff)
        return jnp.where(vals == NEG_INF, -1, idx).astype(jnp.int32)

    out = jax.lax.map(one_chunk, jnp.arange(t // tc))  # [n, B, tc, k]
    out = jnp.moveaxis(out, 0, 1).reshape(b, t, k_eff)
    if k_eff < topk:
        out = jnp.pad(out, ((0, 0), (0, 0), (0, topk - k_eff)), constant_values=-1)
    return out


def _gather_rows(x, idx):
    """x [B, S, D], idx [B, tc, K] in range -> [B, tc, K, D] (in-bounds gather: -1 slots are
    mapped to row 0 by the caller and masked, so XLA skips bounds clamping, ~2x cheaper on CPU)."""
    return jax.vmap(lambda xb, ib: xb.at[ib].get(mode="promise_in_bounds"))(x, idx)


def _gather_kv(kv, safe, dvp):
    """kv = (k [B, S, Dq], v [B, S, Dv]), or (k,) with v = k[..., :dvp] (MLA's MQA form: the value
    is the latent, a prefix of every key row) -> gathered (kc, vc) [B, tc, K, .]; the prefix form
    gathers each row once (the gathers are most of the sparse attention's time on CPU)."""
    kc = _gather_rows(kv[0], safe)
    return kc, (kc[..., :dvp] if dvp else _gather_rows(kv[1], safe))


def _sparse_chunk_fwd(qc, kv, idx, scale, dvp=None):
    """One query chunk: qc [B, tc, H, Dq], kv = (k [B, S, Dq], v [B, S, Dv]) or (k,) with dvp,
    idx [B, tc, K] ->
    (out [B, tc, H, Dv] f32, lse [B, tc, H]; lse = +inf for a row without a valid index)."""
    kc, vc = _gather_kv(kv, jnp.where(idx >= 0, idx, 0), dvp)
    return _attend_rows(qc, kc, vc, idx >= 0, scale)


def _attend_rows(qc, kc, vc, valid, scale):
    """Attention of qc [B, tc, H, Dq] over gathered rows kc [B, tc, K, Dq], vc [B, tc, K, Dv] where valid
    [B, tc, K] -> (out [B, tc, H, Dv] f32, lse [B, tc, H]; lse = +inf for a row without a valid index)."""
    valid = valid[..., None]  # [B, tc, K, 1]
    s = jnp.einsum("btkd,bthd->btkh", kc, qc, preferred_element_type=jnp.float32) * scale
    s = jnp.where(valid, s, NEG_INF)  # [B, tc, K, H]: keys outside heads (fast XLA CPU dot)
    m = jnp.max(s, axis=2)  # [B, tc, H]
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[:, :, None, :])
    l = jnp.sum(p, axis=2)
    o = jnp.einsum("btkh,btkd->bthd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
    o = o / jnp.where(l == 0, 1.0, l)[..., None]
    lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)
    return o, lse


def sparse_mqa_rows(q, gather, indices, *, scale: float, r: int, chunk: int = 16):
    """The forward of `sparse_mqa_uv` before W_UV, with the rows read by `gather`: q [B, T, H, Dq],
    gather(slots [B, tc, K] in range) -> rows [B, tc, K, Dq] (the value is each row's first r columns),
    indices [B, T, K] (-1 = none) -> o [B, T, H, r] in q's dtype, the same values as `sparse_mqa_uv`'s (same
    query chunks, same per-chunk work). The decode cache's path: `gather` reads the selected rows straight
    from a stacked cache (glm5_jax.attention.core.LayerCache), so no layer-sized operand exists. No VJP."""
    b, t, h, dq = q.shape
    tc = _tile_chunk(t, indices.shape[-1], dq, chunk)

    def one(args):
        qc, idx = args
        kc = gather(jnp.where(idx >= 0, idx, 0))
        o, _ = _attend_rows(qc, kc, kc[..., :r], idx >= 0, scale)
        return o.astype(q.dtype)

    return _unchunks(jax.lax.map(one, (_chunks(q, tc), _chunks(indices.astype(jnp.int32), tc))))


def _chunks(x, tc):  # [B, T, ...] -> [n, B, tc, ...]
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // tc, tc, *x.shape[2:]), 1, 0)


def _unchunks(x):  # [n, B, tc, ...] -> [B, T, ...]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _sparse_mqa_fwd(q, kv, indices, scale, tc, dvp):
    def one(args):
        qc, idx = args
        o, lse = _sparse_chunk_fwd(qc, kv, idx, scale, dvp)
        return o.astype(q.dtype), lse
    o, lse = jax.lax.map(one, (_chunks(q, tc), _chunks(indices, tc)))
    return _unchunks(o), _unchunks(lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _sparse_mqa(q, kv, indices, scale, tc, dvp):
    return _sparse_mqa_fwd(q, kv, indices, scale, tc, dvp)[0]


def _sparse_mqa_vjp_fwd(q, kv, indices, scale, tc, dvp):
    o, lse = _sparse_mqa_fwd(q, kv, indices, scale, tc, dvp)
    return o, (q, kv, indices, o, lse)


def _sparse_mqa_vjp_bwd(scale, tc, dvp, res, do):
    """Per chunk: re-gather K/V, P = exp(S - lse), dP = dO V^T, dS = P (dP - delta);
    dQ = dS K; the dK rows (dS^T Q) and dV rows (P^T dO) are scatter-added."""
    q, kv, indices, o, lse = res
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1)  # [B, T, H]

    def one(dkv, args):
        qc, idx, doc, lsec, dc = args
        safe = jnp.where(idx >= 0, idx, 0)
        kc, vc = _gather_kv(kv, safe, dvp)
        s = jnp.einsum("btkd,bthd->btkh", kc, qc, preferred_element_type=jnp.float32) * scale
        p = jnp.where((idx >= 0)[..., None], jnp.exp(s - lsec[:, :, None, :]), 0.0)
        dp = jnp.einsum("btkd,bthd->btkh", vc, doc, preferred_element_type=jnp.float32)
        ds = p * (dp - dc[:, :, None, :]) * scale
        dqc = jnp.einsum("btkh,btkd->bthd", ds, kc.astype(jnp.float32))
        sc = jax.vmap(lambda a, i, u: a.at[i].add(u, mode="promise_in_bounds"))
        if dvp:  # v = k[..., :dv]: each slot's row gradient dS^T q + [P^T dO | 0] as ONE matmul over the
            # stacked heads [dS | P] x [q ; dO padded to Dq] (no second [K, D] float32 product and sum
            # written out), and one scatter of it (the scatter is serial on CPU)
            do_pad = jnp.pad(doc.astype(jnp.float32), ((0, 0),) * 3 + ((0, qc.shape[-1] - dvp),))
            drow = jnp.einsum("btkh,bthd->btkd", jnp.concatenate([ds, p], axis=-1),
                              jnp.concatenate([qc.astype(jnp.float32), do_pad], axis=2))
            return (sc(dkv[0], safe, drow),), dqc.astype(q.dtype)
        dkc = jnp.einsum("btkh,bthd->btkd", ds, qc.astype(jnp.float32))
        dvc = jnp.einsum("btkh,bthd->btkd", p, doc.astype(jnp.float32))
        dkv = (sc(dkv[0], safe, dkc), sc(dkv[1], safe, dvc))  # invalid slots: zero rows
        return dkv, dqc.astype(q.dtype)

    xs = (_chunks(q, tc), _chunks(indices, tc), _chunks(do, tc), _chunks(lse, tc),
          _chunks(delta, tc))
    zeros = tuple(jnp.zeros(x.shape, jnp.float32) for x in kv)
    dkv, dq = jax.lax.scan(one, zeros, xs)
    return _unchunks(dq), tuple(d.astype(x.dtype) for d, x in zip(dkv, kv)), None


_sparse_mqa.defvjp(_sparse_mqa_vjp_fwd, _sparse_mqa_vjp_bwd)


_TILE_BYTES = 4 * 2 ** 20  # gathered [tc, K, Dq] f32 tile kept under this (cache-sized; see below)

LSE_NAME = "attn_lse"   # checkpoint name of sparse_mqa_uv's log-sum-exp (the one residual its backward needs)


def _tile_chunk(t: int, n_sel: int, dq: int, chunk: int) -> int:
    """Queries per chunk: <= chunk, the gathered [tc, K, Dq] float32 tile under _TILE_BYTES, dividing t."""
    return pick_chunk(t, min(chunk, max(1, _TILE_BYTES // max(1, n_sel * dq * 4))))


def sparse_mqa_uv(q, k, w_uv, indices, *, scale: float, chunk: int = 16, rows=None):
    """MLA's MQA sparse attention with W_UV applied: q [B, T, H, Dq], k [B, S, 1, Dq] (the value is each key
    row's first r columns, the latent), w_uv [r, H, dv], indices [B, T, K] -> [B, T, H, dv] in q's dtype.

    The same values as `sparse_attention(q, k, None, indices, dv=r)` (cast to q's dtype) followed by the
    W_UV einsum, but in one custom VJP whose backward needs of the forward only the log-sum-exp [B, T, H]
    (named LSE_NAME for remat policies): per query it re-gathers the rows, as the backward of
    `sparse_attention` does, and recomputes that query's latent output P V from them for W_UV's gradient and
    for delta = rowsum(dO . O). So a remat'd layer that keeps its attention output (attn_context) and
    the LSE never runs the forward's gathers and matmuls again (docs/scaleout.md, 128K row).

    `rows`: the per-query work, an object with `fwd(q, k, indices, scale, r) -> (o [B, T, H, r] in q's dtype,
    lse)` and `bwd(q, k, do, indices, lse, scale, r) -> (dq, o [B, T, H, r] in q's dtype, dk float32)` (k [B, S, Dq],
    do [B, T, H, Dq] zero past r); None: `JnpRows`, these jnp chunk loops. `pallas_kernels.dsa.sparse_mqa_uv`
    passes the Pallas kernels (the TPU backward fuses the key gradient's scatter-add).
    """
    b, t, h, dq = q.shape
    r = w_uv.shape[0]
    if k.ndim != 4 or k.shape[2] != 1 or k.shape[-1] != dq or not 0 < r <= dq:
        raise ValueError(f"sparse_mqa_uv: k {k.shape} must be [B, S, 1, Dq={dq}] and w_uv {w_uv.shape} [r <= Dq, H, dv]")
    if indices.shape[:2] != (b, t):
        raise ValueError(f"indices {indices.shape} must be [B={b}, T={t}, K]")
    if rows is None:
        rows = JnpRows(_tile_chunk(t, indices.shape[-1], dq, chunk))
    # The forward runs outside the custom VJP on gradient-free operands, and its log-sum-exp enters the VJP as
    # an input: a remat policy can then keep the (named) LSE, which it cannot see among a custom VJP's residuals.
    sg, kr, idx = jax.lax.stop_gradient, k[:, :, 0], indices.astype(jnp.int32)
    o, lse = rows.fwd(sg(q), sg(kr), idx, float(scale), r)
    out = jnp.einsum("bthr,rhd->bthd", o, sg(w_uv).astype(o.dtype))
    return _sparse_uv(q, kr, w_uv, idx, checkpoint_name(lse, LSE_NAME), out, float(scale), rows)


class JnpRows(typing.NamedTuple):
    """`sparse_mqa_uv`'s per-query work in jnp: `tc` queries per chunk of a scan (the gathered tile bounded)."""
    tc: int

    def fwd(self, q, k, indices, scale, r):
        return _sparse_mqa_fwd(q, (k,), indices, scale, self.tc, r)   # o: q's dtype, as sparse_attention

    def bwd(self, q, k, do, indices, lse, scale, r):
        """Per chunk, reading the re-gathered rows K (V = K[..., :r]) in two matmuls over stacked heads:
        [S | dP] = K [q ; dO] (S = K q, dP = V dO), P = exp(S - lse), delta = rowsum(P . dP) (= rowsum(dO . O)),
        dS = P (dP - delta); [O | dq] = [P | dS]^T K; each slot's row gradient dS^T q + [P^T dO | 0] in one
        matmul over [dS | P], scatter-added into float32 dK."""
        h, dt, f32 = q.shape[2], q.dtype, jnp.float32

        def one(dk, args):
            qc, idx, doc, lsec = args
            valid = idx >= 0
            safe = jnp.where(valid, idx, 0)
            kc = _gather_rows(k, safe)                                               # [B, tc, K, Dq]
            sdp = jnp.einsum("btkd,bthd->btkh", kc, jnp.concatenate([qc, doc], axis=2),
                             preferred_element_type=f32)                             # [B, tc, K, 2H]
            p = jnp.where(valid[..., None], jnp.exp(sdp[..., :h] * scale - lsec[:, :, None, :]), 0.0)
            dp = sdp[..., h:]
            delta = jnp.sum(p * dp, axis=2)                                          # [B, tc, H]
            ds = p * (dp - delta[:, :, None, :]) * scale
            odq = jnp.einsum("btkh,btkd->bthd", jnp.concatenate([p, ds], axis=-1), kc.astype(f32))  # [B, tc, 2H, Dq]
            drow = jnp.einsum("btkh,bthd->btkd", jnp.concatenate([ds, p], axis=-1),
                              jnp.concatenate([qc, doc], axis=2).astype(f32))
            dk = jax.vmap(lambda a, i, u: a.at[i].add(u, mode="promise_in_bounds"))(dk, safe, drow)
            return dk, (odq[:, :, :h, :r].astype(dt), odq[:, :, h:].astype(dt))

        xs = (_chunks(q, self.tc), _chunks(indices, self.tc), _chunks(do, self.tc), _chunks(lse, self.tc))
        dk, (o, dq) = jax.lax.scan(one, jnp.zeros(k.shape, f32), xs)
        return _unchunks(dq), _unchunks(o), dk


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _sparse_uv(q, k, w_uv, indices, lse, out, scale, rows):
    """`out` (computed by `rows.fwd` and W_UV from the same operands) with the gradient of attention + W_UV."""
    return out


def _sparse_uv_vjp_fwd(q, k, w_uv, indices, lse, out, scale, rows):
    return out, (q, k, w_uv, indices, lse)


def _sparse_uv_vjp_bwd(scale, rows, res, dout):
    """dO = dOut W_UV^T over all queries at once; the per-query work (`rows.bwd`) gives dq, dK and the latent
    output O = P V (in q's dtype, as the forward's); dW_UV = O^T dOut after it (W_UV and its gradient are never
    read or written per query chunk: at one query a chunk that was 48 MiB a query at GLM-5 widths)."""
    q, k, w_uv, indices, lse = res
    r, dt, f32 = w_uv.shape[0], q.dtype, jnp.float32
    dq_dim = q.shape[3]
    do = jnp.einsum("bthd,rhd->bthr", dout.astype(dt), w_uv.astype(dt))        # as the W_UV einsum's transpose
    do_pad = jnp.pad(do, ((0, 0),) * 3 + ((0, dq_dim - r),)).astype(q.dtype)
    dq, o, dk = rows.bwd(q, k, do_pad, indices, lse, scale, r)
    dw = jnp.einsum("bthr,bthd->rhd", o, dout.astype(dt), preferred_element_type=f32)
    return dq, dk.astype(k.dtype), dw.astype(w_uv.dtype), None, None, None


_sparse_uv.defvjp(_sparse_uv_vjp_fwd, _sparse_uv_vjp_bwd)


def sparse_attention(q, k, v, indices, *, scale: float, chunk: int = 16, dv: int | None = None):
    """Attention of each query over its selected keys only.

    q [B, T, H, Dq], k [B, S, Hk, Dq], v [B, S, Hk, Dv] with Hk in {1, H}, indices int32 [B, T, K]
    (-1 = no key) -> [B, T, H, Dv] in q's dtype. Softmax in float32; a row without a valid index
    returns zeros. Differentiable in q, k and v (custom VJP; indices get no gradient).
    v=None with `dv`: the value is the key's prefix k[..., :dv] (MLA's MQA form, value = latent):
    each selected row is gathered once and the backward scatters one summed dK row per slot
    (the gradient w.r.t. that prefix is dK + dV). Measured fwd+bwd at T=2K, K=2K, 8 heads, 72-d
    keys: -14% CPU time against passing v = k[..., :dv] as a separate array.

    Per query chunk: gather the selected rows of K and V (two gathers: one gather of a
    concatenated [K | V] measured slower, its last-axis slices copy), logits laid out
    [B, tc, K, H] (key axis outside the head axis: long-by-narrow matmuls, ~2x faster on XLA CPU
    than [H, K]), softmax, P V; the forward saves only the
    log-sum-exp. The backward re-gathers per chunk (O(T) residual memory, no [T, K, D] tensor
    saved) and scatter-adds the dK and dV rows. Small chunks keep the gathered [tc, K, D] tile in
    cache: `chunk` is an upper bound, lowered so the tile stays under 4 MiB (at K=2048, 72-d
    keys: 16 -> 4 queries, -25..30% fwd+bwd CPU time measured; 128-query chunks were ~2-3x slower).
    Hk = H runs as B*H sequences with one shared head each.
    """
    b, t, h, _ = q.shape
    hk = k.shape[2]
    if v is None:
        if dv is None or not 0 < dv <= k.shape[-1]:
            raise ValueError(f"v=None needs dv in [1, Dq={k.shape[-1]}] (value = k[..., :dv]), got dv={dv}")
    elif dv is not None:
        raise ValueError(f"dv={dv} is only for v=None (value = k[..., :dv]); got a v array too")
    else:
        dv = v.shape[-1]
    if hk not in (1, h):
        raise ValueError(f"k has {hk} heads; sparse_attention allows 1 or H={h}")
    if indices.shape[:2] != (b, t):
        raise ValueError(f"indices {indices.shape} must be [B={b}, T={t}, K]")
    if hk == h and h > 1:  # fold heads into the batch: [B*H, T, 1, D], indices repeated
        fold = lambda x: None if x is None else jnp.swapaxes(x, 1, 2).reshape(
            b * h, x.shape[1], 1, x.shape[-1])
        idx = jnp.repeat(indices, h, axis=0)
        o = sparse_attention(fold(q), fold(k), fold(v), idx, scale=scale, chunk=chunk,
                             dv=None if v is not None else dv)
        return jnp.swapaxes(o.reshape(b, h, t, dv), 1, 2)
    tc = _tile_chunk(t, indices.shape[-1], k.shape[-1], chunk)
    if v is None:
        kv, dvp = (k[:, :, 0],), int(dv)
    else:
        kv, dvp = (k[:, :, 0], v[:, :, 0]), None
    return _sparse_mqa(q, kv, indices.astype(jnp.int32), float(scale), tc, dvp).astype(q.dtype)
