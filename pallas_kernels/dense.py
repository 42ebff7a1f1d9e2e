"""Dense causal flash attention in pure jnp: THE dense attention on CPU (glm5_jax.attention.core
dispatches here) and the baseline of tools/bench_dsa.py.

Block-tiled online softmax with a hand-written single-pass backward (custom_vjp, only O and the
log-sum-exp saved; probabilities recomputed per block pair). Only the ~T^2/2 block pairs on or
below the causal diagonal are visited (dynamic-length inner loops). Memory is O(T) plus one
[block, block] tile per head, forward and backward. q [B, T, H, Dq], k [B, S, Hk, Dq],
v [B, S, Hk, Dv] with H % Hk == 0 (MHA, GQA, MQA; Dv != Dq allowed), S == T (prefill/training), or
S >= T with `q_offset` (context parallelism: the T local queries sit at global positions
q_offset .. q_offset + T - 1 of the S keys; q_offset may be traced, a multiple of the block),
optional `segment_ids` [B, T] (packed documents: a query sees only keys of its own document;
`kv_segment_ids` [B, S] for the keys when S != T).

Layout (what makes it fast on XLA CPU): one KV head per program. The g = H / Hk query heads that
share a KV head are folded into the matmul rows, M = block*g (row m = query m // g, head m % g),
and the KV heads into the batch, so every product is a plain 2-D GEMM with a single contracting
dimension ([M, D] x [D, blk]). (Contracting over two dimensions at once, or broadcasting K/V to
H heads, costs XLA CPU ~2x per product.)

Backward (FlashAttention-2 order): the outer loop walks key blocks j and carries dK_j, dV_j; the
inner loop walks query blocks i >= j and adds dS_ij K_j into a carried dQ. The probabilities are
built transposed ([blk(k), M]) so that dV = P^T dO and dK = dS^T Q are NN GEMMs. Per block pair:
5 matmuls (S, dP, dV, dK, dQ) and one exp, against 7 and two when the probabilities are recomputed
once for dQ and once for dK/dV. With segment ids every visited block pair is masked (a key block
may hold other documents); a row whose keys in a block are all masked keeps its running state
(masked logits are -inf, the running max is taken as 0 while it is still -inf, never NaN).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_F32 = jnp.float32


def _mm(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=_F32)


def _diag_mask(blk, g):
    """Bool [blk*g (query rows m = q*g + head), blk (keys)]: key <= query."""
    return jnp.arange(blk)[None, :] <= (jnp.arange(blk * g) // g)[:, None]


def _block_mask(i, j, tri, segq, segk, km, off=0, bh=1):
    """Bool [B*Hk, M, blk] (or [M, blk] without segments or key mask) for query block i (global block
    i + off) and key block j; bh = B*Hk, the rows of q. km [B, n, blk, nk, blk] holds one row per query
    (not per head): its tile is repeated to the M = blk*g rows and the Hk key heads here, so only a
    tile is ever repeated, never the [T, T] mask."""
    mask = jnp.logical_or(j != i + off, tri)
    if segq is not None:
        mask = mask & (segq[:, i][:, :, None] == segk[:, j][:, None, :])
    if km is not None:
        kmb = jnp.repeat(km[:, i, :, j], tri.shape[0] // tri.shape[1], axis=1)   # [B, M, blk]
        hk = bh // kmb.shape[0]
        mask = mask & (jnp.repeat(kmb, hk, axis=0) if hk > 1 else kmb)
    return mask


def _fwd_pair(qb, kb, vb, mask, c, scale):
    """One block pair of the online softmax: row state c = (max, sum, acc) of query block qb [B, M, D]
    over key block kb [B, blk, D] / vb [B, blk, Dv] (mask [B, M, blk] or [M, blk]) -> the new state."""
    mx, l, acc = c
    s = jnp.where(mask, _mm("bmd,bkd->bmk", qb, kb) * scale, -jnp.inf)
    m_new = jnp.maximum(mx, s.max(-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(mx - m_safe)
    pv = _mm("bmk,bkd->bmd", p.astype(vb.dtype), vb)
    return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv


def _finish(mx, l, acc, dtype, masked):
    """Row state -> (o, lse); with a key mask a row may see no key: o = 0, lse = +inf."""
    if not masked:  # l > 0: a query sees itself
        return (acc / l[..., None]).astype(dtype), mx + jnp.log(l)
    seen = l > 0
    o = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    return o.astype(dtype), jnp.where(seen, mx + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)


def _pairs(n: int, key_major: bool):
    """The n(n+1)/2 causal block pairs (query block i >= key block j) as two int32 arrays, ordered by
    query block then key block (forward) or by key block then query block (backward): the order in which
    the dynamic-bound loops visit them, so both loop forms give bitwise the same sums."""
    i, j = np.tril_indices(n)
    order = np.lexsort((i, j)) if key_major else np.arange(len(i))
    return jnp.asarray(i[order], jnp.int32), jnp.asarray(j[order], jnp.int32)


def _fwd(q, k, v, segq, segk, km, off, scale, blk):
    """q [B, n, blk*g, D], k [B, nk, blk, D], v [B, nk, blk, Dv], segq [B, n, M], segk [B, nk, blk],
    km [B/Hk, n, blk, nk, blk] (each or None), off: global block index of query block 0 (a traced int;
    None: 0 and S == T, then one loop of static trip count walks the causal block pairs, which a
    compiled program's FLOP / byte counter can multiply out) -> o [B, n, M, Dv], lse [B, n, M] (+inf for a
    row that sees no key: only a key mask or padding can empty a row; its output is 0)."""
    b, n, m, _ = q.shape
    tri = _diag_mask(blk, m // blk)
    init = (jnp.full((b, m), -jnp.inf, _F32), jnp.zeros((b, m), _F32), jnp.zeros((b, m, v.shape[-1]), _F32))
    if off is None:
        def pair(c, ij):
            i, j = ij
            row = _fwd_pair(q[:, i], k[:, j], v[:, j], _block_mask(i, j, tri, segq, segk, km, 0, b),
                            tuple(x[:, i] for x in c), scale)
            return tuple(x.at[:, i].set(r) for x, r in zip(c, row)), None

        state = tuple(jnp.broadcast_to(x[:, None], (b, n) + x.shape[1:]) for x in init)
        state, _ = jax.lax.scan(pair, state, _pairs(n, key_major=False))
        return _finish(*state, q.dtype, km is not None)

    def per_q(i):
        step = lambda j, c: _fwd_pair(q[:, i], k[:, j], v[:, j],
                                      _block_mask(i, j, tri, segq, segk, km, off, b), c, scale)
        return _finish(*jax.lax.fori_loop(0, i + off + 1, step, init), q.dtype, km is not None)

    o, lse = jax.lax.map(per_q, jnp.arange(n))
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(lse, 0, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, segq, segk, km, off, scale, blk):
    return _fwd(q, k, v, segq, segk, km, off, scale, blk)[0]


def _flash_fwd(q, k, v, segq, segk, km, off, scale, blk):
    o, lse = _fwd(q, k, v, segq, segk, km, off, scale, blk)
    return o, (q, k, v, segq, segk, km, off, o, lse)


def _bwd_pair(qb, dob, kb, vb, mask, lse_i, delta_i, scale):
    """One block pair of the backward (probabilities built transposed, [B, blk(k), M]) -> the pair's
    (dK, dV, dQ) contributions in float32."""
    s_t = jnp.where(jnp.swapaxes(mask, -1, -2), _mm("bkd,bmd->bkm", kb, qb) * scale, -jnp.inf)
    p_t = jnp.exp(s_t - lse_i[:, None, :])
    dp_t = _mm("bkd,bmd->bkm", vb, dob)
    ds_t = p_t * (dp_t - delta_i[:, None, :]) * scale
    return (_mm("bkm,bmd->bkd", ds_t.astype(qb.dtype), qb), _mm("bkm,bmd->bkd", p_t.astype(dob.dtype), dob),
            _mm("bkm,bkd->bmd", ds_t.astype(kb.dtype), kb))


def _flash_bwd(scale, blk, res, do):
    q, k, v, segq, segk, km, off, o, lse = res
    b, n, m, _ = q.shape
    tri = _diag_mask(blk, m // blk)
    delta = jnp.sum(do.astype(_F32) * o.astype(_F32), -1)  # [B, n, M]

    def contrib(i, j):
        return _bwd_pair(q[:, i], do[:, i], k[:, j], v[:, j], _block_mask(i, j, tri, segq, segk, km, 0 if off is None else off, b),
                         lse[:, i], delta[:, i], scale)

    if off is None:  # the causal pairs key block by key block, one loop of static trip count
        def pair(c, ij):
            dk, dv, dq = c
            i, j = ij
            ck, cv, cq = contrib(i, j)
            return (dk.at[:, j].add(ck), dv.at[:, j].add(cv), dq.at[:, i].add(cq)), None

        zeros = lambda x: jnp.zeros(x.shape, _F32)
        (dk, dv, dq), _ = jax.lax.scan(pair, (zeros(k), zeros(v), zeros(q)), _pairs(n, key_major=True))
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None

    def per_k(dq, j):
        def step(i, c):
            dk, dv, dq = c
            ck, cv, cq = contrib(i, j)
            return dk + ck, dv + cv, dq.at[:, i].add(cq)

        init = (jnp.zeros(k.shape[:1] + k.shape[2:], _F32), jnp.zeros(v.shape[:1] + v.shape[2:], _F32), dq)
        # query blocks whose global index i + off >= j see key block j
        dk, dv, dq = jax.lax.fori_loop(jnp.clip(j - off, 0, n), n, step, init)
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq, (dk, dv) = jax.lax.scan(per_k, jnp.zeros(q.shape, _F32), jnp.arange(k.shape[1]))
    return (dq.astype(q.dtype), jnp.moveaxis(dk, 0, 1), jnp.moveaxis(dv, 0, 1), None, None, None,
            np.zeros(jnp.shape(off), jax.dtypes.float0))


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, *, scale: float, segment_ids=None, block: int = 512, key_mask=None,
                    q_offset=None, kv_segment_ids=None):
    """Causal dense attention, differentiable in q, k, v -> [B, T, H, Dv] in q's dtype.

    q [B, T, H, Dq], k [B, S, Hk, Dq], v [B, S, Hk, Dv] (H % Hk == 0), segment_ids [B, T] or None.
    S == T unless `q_offset` is given: then query t sits at global position q_offset + t of the S
    keys (context parallelism; q_offset an int or a traced int32 scalar, a multiple of the block,
    which is then the largest divisor of T <= block) and `kv_segment_ids` [B, S] are the keys'
    segment ids (default: segment_ids, which needs S == T). Only block pairs on or below the causal
    diagonal are visited.
    key_mask [B, T, T] bool or None (S == T only): keys each query may see besides the causal /
    document rule (DSA's top-k set as a dense mask, `topk_key_mask`); a query that sees no key
    returns zeros. T is padded up to a multiple of the block (min(block, T)); padded keys lie after
    every real query, so the causal mask already hides them."""
    b, t, h, d = q.shape
    s, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
    if q_offset is None and (s != t or v.shape[1] != t):
        raise ValueError(f"flash_attention needs S == T without q_offset, got q T={t}, k S={s}, v S={v.shape[1]}")
    if v.shape[1] != s:
        raise ValueError(f"k has S={s} keys but v has {v.shape[1]}")
    if h % hk or v.shape[2] != hk:
        raise ValueError(f"query heads {h} must be a multiple of key heads {hk} (v has {v.shape[2]})")
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(f"segment_ids {segment_ids.shape} must be [B={b}, T={t}]")
    if kv_segment_ids is None and segment_ids is not None and s != t:
        raise ValueError(f"segment_ids with S={s} != T={t} keys needs kv_segment_ids [B, S]")
    if (kv_segment_ids is None) != (segment_ids is None):
        if kv_segment_ids is not None:
            raise ValueError("kv_segment_ids without segment_ids (the queries' ids)")
    if key_mask is not None and q_offset is not None:
        raise ValueError("key_mask is for S == T only (no q_offset)")
    g = h // hk
    if q_offset is None:
        blk = min(int(block), t)
        off = None                  # static: the causal block pairs in one loop of static trip count
    else:  # the block must tile T exactly so that q_offset (a multiple of T) is a whole number of blocks
        blk = max(c for c in range(1, min(int(block), t) + 1) if t % c == 0)
        off = jnp.asarray(q_offset, jnp.int32) // blk
    n = -(-t // blk)
    nk = -(-s // blk)
    tp, sp = n * blk, nk * blk
    pad = lambda x, to: jnp.pad(x, [(0, 0), (0, to - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    # KV heads into the batch, the g query heads of a KV head into the rows: [B*Hk, n, blk*g, D]
    qf = jnp.swapaxes(pad(q, tp).reshape(b, tp, hk, g, d), 1, 2).reshape(b * hk, n, blk * g, d)
    fold = lambda x: jnp.swapaxes(pad(x, sp), 1, 2).reshape(b * hk, nk, blk, x.shape[-1])
    segq = segk = None
    if segment_ids is not None:
        kseg = segment_ids if kv_segment_ids is None else kv_segment_ids
        segk = jnp.repeat(pad(kseg.astype(jnp.int32), sp), hk, axis=0).reshape(b * hk, nk, blk)
        seg = jnp.repeat(pad(segment_ids.astype(jnp.int32), tp), hk, axis=0)  # [B*Hk, Tp]
        segq = jnp.repeat(seg, g, axis=1).reshape(b * hk, n, blk * g)
    km = None
    if key_mask is not None:
        if key_mask.shape != (b, t, t):
            raise ValueError(f"key_mask {key_mask.shape} must be [B={b}, T={t}, T={t}]")
        km = jnp.pad(key_mask.astype(bool), [(0, 0), (0, tp - t), (0, tp - t)])  # padded keys: never
        km = km.reshape(b, n, blk, n, blk)
    o = _flash(qf, fold(k), fold(v), segq, segk, km, off, float(scale), blk)  # [B*Hk, n, blk*g, Dv]
    o = jnp.swapaxes(o.reshape(b, hk, tp, g, dv), 1, 2).reshape(b, tp, h, dv)
    return o[:, :t]


def topk_key_mask(indices, s: int):
    """indices [B, T, K] (key slots, -1 = none) -> [B, T, S] bool: True at every selected slot."""
    b, t, _ = indices.shape
    idx = jnp.where(indices < 0, s, indices)  # -1 -> out of range, dropped
    rows = (jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None])
    return jnp.zeros((b, t, s), bool).at[rows[0], rows[1], idx].set(True, mode="drop")
