"""Dense causal attention for training and prefill (S == T, GQA / MQA, Dv != Dq, packed documents),
one kernel per platform, chosen at trace time from the default backend:
  * CPU: `pallas_kernels.dense.flash_attention`: jnp flash attention with a custom VJP that saves
    only O and the log-sum-exp; the backward recomputes probabilities block by block, so memory is
    linear in T (docs/kernels.md: compiled temp memory at T = 1K..4K);
  * TPU: splash attention (jax.experimental.pallas.ops.tpu.splash_attention), segment ids as
    SegmentIds, causal mask as a lazy CausalMask;
  * GPU: Pallas Triton flash attention (jax.experimental.pallas.ops.gpu.attention.mha, which takes
    segment ids; cuDNN's fused attention has no packed-document mask short of a [T, S] array).
Plus attention over a decode cache (`cached_attention`), which is not a training path."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from glm5_jax.batch import BATCH_AXES
from glm5_jax.utils import NEG_INF
from pallas_kernels.dense import flash_attention

PLATFORMS = ("cpu", "tpu", "gpu")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_axis(x, axis: int, size: int):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def splash_attention(q, k, v, *, scale: float, segment_ids=None, block: int = 128, interpret: bool = False):
    """TPU: splash attention over [B, T, H, D] inputs (H % Hk == 0; Hk == 1 runs the MQA kernel).
    q is pre-scaled (splash does not scale); T is padded to a multiple of `block` (padded keys come
    after every real query: the causal mask hides them); Dq / Dv are zero-padded to one common
    multiple of 128 (zeros change no dot product; the padded output columns are dropped)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    b, t, h, dq = q.shape
    hk, dv = k.shape[2], v.shape[-1]
    tp, dp = _round_up(t, block), _round_up(max(dq, dv), 128)
    prep = lambda x: jnp.swapaxes(_pad_axis(_pad_axis(x, 1, tp), 3, dp), 1, 2)   # [B, H, Tp, Dp]
    qs, ks, vs = prep(q * jnp.asarray(scale, q.dtype)), prep(k), prep(v)
    mask = sm.MultiHeadMask([sm.CausalMask((tp, tp)) for _ in range(h)])
    bs = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                       block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mqa = hk == 1
    make = sk.make_splash_mqa if mqa else sk.make_splash_mha
    kernel = make(mask, block_sizes=bs, head_shards=1, q_seq_shards=1, interpret=interpret)
    if mqa:
        ks, vs = ks[:, 0], vs[:, 0]
    if segment_ids is None:
        out = jax.vmap(kernel)(qs, ks, vs)
    else:
        seg = _pad_axis(segment_ids.astype(jnp.int32), 1, tp)
        out = jax.vmap(lambda a, b_, c, s_: kernel(a, b_, c, segment_ids=sk.SegmentIds(q=s_, kv=s_)))(qs, ks, vs, seg)
    return jnp.swapaxes(out, 1, 2)[:, :t, :, :dv].astype(q.dtype)


def gpu_flash_attention(q, k, v, *, scale: float, segment_ids=None, block: int = 64, interpret: bool = False):
    """GPU: Pallas Triton flash attention (fwd + Triton bwd) over [B, T, H, D]. KV heads are
    repeated to H (the kernel is MHA-only), T is padded to a multiple of `block`, Dq / Dv
    zero-padded to one power of two >= 16 (Triton block shapes)."""
    from jax.experimental.pallas.ops.gpu import attention as ga
    b, t, h, dq = q.shape
    hk, dv = k.shape[2], v.shape[-1]
    tp = _round_up(t, block)
    dp = max(16, 1 << (max(dq, dv) - 1).bit_length())
    prep = lambda x: _pad_axis(_pad_axis(x, 1, tp), 3, dp)
    k, v = jnp.repeat(k, h // hk, axis=2), jnp.repeat(v, h // hk, axis=2)
    seg = None if segment_ids is None else _pad_axis(segment_ids.astype(jnp.int32), 1, tp)
    bs = ga.BlockSizes(block_q=block, block_k=block, block_q_dkv=block, block_kv_dkv=block,
                       block_q_dq=block, block_kv_dq=block)
    out = ga.mha(prep(q), prep(k), prep(v), seg, sm_scale=float(scale), causal=True, block_sizes=bs,
                 interpret=interpret)
    return out[:, :t, :, :dv]


def causal_attention(q, k, v, *, scale: float, segment_ids=None, chunk: int = 256, platform: str | None = None,
                     key_mask=None, q_offset=None, kv_segment_ids=None):
    """q [B, T, H, Dq], k [B, T, Hk, Dq], v [B, T, Hk, Dv] (H % Hk == 0) -> [B, T, H, Dv] in q's dtype.

    Causal; `segment_ids` [B, T] keeps attention inside each packed document. Softmax in float32.
    `platform` (default: jax.default_backend()) picks the kernel (module docstring); under a
    multi-device mesh the jnp flash kernel runs on every platform (Pallas calls do not partition);
    `chunk` is the jnp kernel's block. No [T, S] array forward or backward on any platform.
    `key_mask` [B, T, T] bool (DSA's top-k set as a dense mask, `dense.topk_key_mask`): only the
    jnp flash kernel takes one, so it runs on every platform then (a [T, S] input by definition;
    `mla` uses it on CPU at short T only).
    `q_offset` / `kv_segment_ids` (context parallelism, glm5_jax.attention.context): the T local
    queries sit at global positions q_offset.. of the S gathered keys; the jnp flash kernel runs then
    on every platform (TODO(kernels): splash / Triton with a query offset).
    """
    b, t, h, _ = q.shape
    s, hk = k.shape[1], k.shape[2]
    if h % hk:
        raise ValueError(f"query heads {h} must be a multiple of key heads {hk}")
    if q_offset is not None:
        return flash_attention(q, k, v, scale=scale, segment_ids=segment_ids, block=chunk, q_offset=q_offset,
                               kv_segment_ids=kv_segment_ids)
    if s != t:
        raise ValueError(f"causal_attention needs S == T (training / prefill), got T={t}, S={s}; "
                         "attention over a cache is cached_attention")
    platform = platform or jax.default_backend()
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r}; allowed: {', '.join(PLATFORMS)} (cuda / rocm mean gpu)")
    if key_mask is not None:
        return flash_attention(q, k, v, scale=scale, segment_ids=segment_ids, block=chunk, key_mask=key_mask)
    if platform != "cpu" and jax.sharding.get_abstract_mesh().size > 1:
        # Pallas custom calls cannot be partitioned automatically; under a multi-device mesh
        # (glm5_jax.sharding.use_mesh) the jnp flash path runs, which GSPMD partitions.
        # TODO(kernels): splash / Triton inside shard_map over the batch axes.
        platform = "cpu"
    if platform == "tpu":
        return splash_attention(q, k, v, scale=scale, segment_ids=segment_ids)
    if platform == "gpu":
        return gpu_flash_attention(q, k, v, scale=scale, segment_ids=segment_ids)
    return flash_attention(q, k, v, scale=scale, segment_ids=segment_ids, block=chunk)


# ----------------------------------------------------------------------------- attention over a cache
def write_cache(buf, wpos, new, layer=None, slot=None):
    """buf [B, S, ...] with new [B, T, ...] written at slots wpos [B, T]; wpos < 0 or >= S is dropped.
    With `layer` (an int32 scalar), buf is a layer stack [L, B, S, ...] and row `layer` is written. With
    `slot` [B] (int32), buf has one more axis [.., B, P, S, ...] and batch row b writes its row slot[b] of P
    (the serving engine's prefill: one row per batch shard, written in place into that shard's slots).

    One scatter of the T new rows, in place where buf is donated or carried by a loop (never a copy of the
    buffer). Its batch index is an iota, not a vmap batching dim: a batching dim at axis 1 of a stack makes
    XLA (CPU and TPU) transpose the whole buffer to put it first, while the iota form compiles in place, and
    on TPU GSPMD partitions it along a sharded B without communication (docs/inference.md, "Cache layout
    and DSA decode")."""
    lead = () if layer is None else (layer,)
    rows = jnp.arange(wpos.shape[0])[:, None]
    sub = () if slot is None else (slot[:, None],)
    s = buf.shape[len(lead) + 1 + len(sub)]
    wpos = jnp.where(wpos < 0, s, wpos)
    return buf.at[lead + (rows,) + sub + (wpos,)].set(new.astype(buf.dtype), mode="drop")


def gather_slots(buf, idx, layer=None, slot=None):
    """buf [B, S, ...] (or a stack [L, B, S, ...] with `layer`; [.., B, P, S, ...] with `slot` [B] as in
    `write_cache`), idx [B, T, K] slots in range -> [B, T, K, ...]: only the selected rows are read (straight
    from the stack: no slice of the layer). The batch index is an iota for the reason `write_cache` gives."""
    lead = () if layer is None else (layer,)
    rows = jnp.arange(idx.shape[0])[:, None, None]
    sub = () if slot is None else (slot[:, None, None],)
    return buf.at[lead + (rows,) + sub + (idx,)].get(mode="promise_in_bounds")


def write_pages(buf, pages, wpos, new, layer=None):
    """A page pool buf [num_pages, page_size, ...] (a stack [L, num_pages, page_size, ...] with `layer`) with
    new [B, T, ...] written at positions wpos [B, T] of each batch row, through its page table pages [B, n]
    (position p: page pages[b, p // page_size], offset p % page_size); wpos < 0 or past the table is
    dropped. One scatter, in place where the pool is donated or carried by a loop."""
    lead = () if layer is None else (layer,)
    ps, n = buf.shape[len(lead) + 1], pages.shape[1]
    ok = (wpos >= 0) & (wpos < n * ps)
    page = jnp.take_along_axis(pages, jnp.clip(wpos // ps, 0, n - 1), axis=1)
    page = jnp.where(ok, page, buf.shape[len(lead)])                  # out of range: dropped
    return buf.at[lead + (page, wpos % ps)].set(new.astype(buf.dtype), mode="drop")


class LayerCache(NamedTuple):
    """One attention layer's cache as the attention modules see it: `buffers` {name: [B, S, ...]} (an MTP
    depth's), or the buffers of a whole layer stack {name: [L, B, S, ...]} with `layer` the row of this layer
    (the layer scan carries the stacks and the layer index, so a step writes its new rows into the stack in
    place and reads only what it needs: `rows` for every slot, `gather` for selected slots).

    Paged (`pages` [B, n] int32, the serving runtime's page tables): the buffers are a pool of pages
    {name: [L, num_pages, page_size, ...]} and batch row b's position p lives in page pages[b, p // page_size]
    at offset p % page_size, so a row sees S = n * page_size positions; rows share pages by reference. Under a
    mesh with batch shards the pool's pages and the batch rows are both split over the batch axes (shard s
    holds pages s * per .. (s + 1) * per - 1, per = num_pages / shards) and a row's table holds pages of its
    own shard only: every write and read runs per shard (`batch_local`, page p at local index p % per), with
    no cross-chip traffic (data-parallel attention over the pool; glm5_jax.infer.runtime places them so)."""
    buffers: dict
    layer: Any = None
    slot: Any = None          # [B] int32: the buffers hold P rows per batch row ([.., B, P, S, ...]); b uses slot[b]
    pages: Any = None         # [B, n] int32 page table per batch row (the buffers are a page pool)

    def write(self, name: str, wpos, new) -> "LayerCache":
        """This call's rows new [B, T, ...] at slots wpos [B, T] (< 0: not written)."""
        buf = self.buffers[name]
        if self.pages is not None:
            stack = self.layer is not None
            buf = batch_local(lambda b, p, w, x, *l: write_pages(b, p % b.shape[len(l)], w, x, *l), buf, self.pages, wpos, new,
                              *((self.layer,) if stack else ()), axes=(int(stack), 0, 0, 0) + ((None,) if stack else ()),
                              out_axes=int(stack))
        else:
            buf = write_cache(buf, wpos, new, self.layer, self.slot)
        return self._replace(buffers=dict(self.buffers, **{name: buf}))

    def rows(self, name: str):
        """The layer's whole buffer [B, S, ...] (for a stack, an index of its layer row: XLA fuses that
        dynamic slice into its consumers on TPU; with `slot`, each batch row's own row; paged, each batch
        row's pages in position order)."""
        buf = self.buffers[name]
        if self.pages is not None:
            def rows(buf, pages, *layer):                 # one gather straight from the stack: no layer slice
                g = buf[layer + (pages % buf.shape[len(layer)],)]                 # [B, n, page_size, ...]
                return g.reshape(g.shape[0], g.shape[1] * g.shape[2], *g.shape[3:])
            stack = self.layer is not None
            return batch_local(rows, buf, self.pages, *((self.layer,) if stack else ()),
                               axes=(int(stack), 0) + ((None,) if stack else ()), out_axes=0)
        buf = buf if self.layer is None else buf[self.layer]
        return buf if self.slot is None else buf[jnp.arange(buf.shape[0]), self.slot]

    def gather(self, name: str, idx):
        """The rows at slots idx [B, T, K] (in range) -> [B, T, K, ...]."""
        if self.pages is not None:
            def gather(buf, pages, idx, *lead):
                ps, b = buf.shape[len(lead) + 1], idx.shape[0]
                pages = pages % buf.shape[len(lead)]
                page = jnp.take_along_axis(pages, (idx // ps).reshape(b, -1), axis=1).reshape(idx.shape)
                return buf.at[lead + (page, idx % ps)].get(mode="promise_in_bounds")
            stack = self.layer is not None
            return batch_local(gather, self.buffers[name], self.pages, idx, *((self.layer,) if stack else ()),
                               axes=(int(stack), 0, 0) + ((None,) if stack else ()), out_axes=0)
        return gather_slots(self.buffers[name], idx, self.layer, self.slot)

    def size(self, name: str) -> int:
        """S, the number of slots (positions a batch row sees)."""
        if self.pages is not None:
            buf = self.buffers[name]
            return self.pages.shape[1] * buf.shape[1 + (self.layer is not None)]
        return self.buffers[name].shape[(1 if self.layer is None else 2) + (self.slot is not None)]


def batch_local(fn, *args, axes, out_axes):
    """fn(*args) on each batch shard's part (`jax.shard_map` over the batch axes of the current mesh; a plain
    call without a mesh or with one batch shard). axes[i]: the axis of args[i] split over the batch axes
    (None: replicated; a pytree argument uses one axis for all its leaves); out_axes likewise for the
    outputs (an int, or a tuple for several). Indices inside fn are the shard's own: the page-pool reads and
    writes of a paged cache, the serving runtime's per-shard row gathers (glm5_jax.infer.programs)."""
    from jax.sharding import PartitionSpec as P
    mesh = jax.sharding.get_abstract_mesh()
    names = () if mesh.empty else tuple(a for a in BATCH_AXES if dict(mesh.shape).get(a, 1) > 1)
    if not names:
        return fn(*args)
    spec = lambda ax: P() if ax is None else P(*([None] * ax + [names]))
    outs = tuple(map(spec, out_axes)) if isinstance(out_axes, tuple) else spec(out_axes)
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(a) for a in axes), out_specs=outs,
                         check_vma=False)(*args)


def row_major(x, axes):
    """x [B, T, F] with its default row-major layout required, and its logical sharding `axes` on both sides
    (under a mesh the constraint is applied per device, inside a shard_map over those axes: the partitioner
    cannot split a layout constraint and all-gathered the batch-sharded projection over every chip). For a
    projection's output over a cache (decode: a few tokens
    a chip): left free, the TPU compiler lays out a head-split output (q_b, the indexer's wq_b) for the
    per-head einsums that read it, and to produce that layout it copies the projection's weight out of the
    scanned layer stack into a transposed layout at every layer of every step (35 GB a glm5 step,
    docs/inference.md); pinned, the weight is read in place and only the small output is relaid."""
    import flax.linen as nn
    from jax.experimental.layout import Layout, with_layout_constraint

    pin = lambda a: with_layout_constraint(a, Layout(tuple(range(a.ndim))))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return pin(x)
    spec = nn.logical_to_mesh_axes(tuple(axes))
    return jax.shard_map(pin, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(x)


def visible_slots(positions, size: int):
    """[B, T, S] bool: cache slot s is visible from a query at position p iff s <= p (slot == position)."""
    return jnp.arange(size)[None, None, :] <= positions[..., None]


def masked_softmax(logits, mask):
    """Softmax over the last axis where mask; a row with no visible entry gives zeros, never NaN."""
    logits = jnp.where(mask, logits, NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    d = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(d == 0, 1.0, d)


def cached_attention(q, k, v, positions, *, scale: float):
    """q [B, T, H, D] over a K/V cache k [B, S, Hk, D], v [B, S, Hk, Dv] -> [B, T, H, Dv]; the query
    at position p sees the slots 0..p. k / v: `LayerCache.rows` (MHA / GQA layers)."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    logits = jnp.einsum("btkgd,bskd->btkgs", q.reshape(b, t, hk, h // hk, d), k).astype(jnp.float32)
    probs = masked_softmax(logits * scale, visible_slots(positions, k.shape[1])[:, :, None, None, :])
    return jnp.einsum("btkgs,bskd->btkgd", probs.astype(v.dtype), v).reshape(b, t, h, v.shape[-1])
