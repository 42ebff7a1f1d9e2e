"""KV caches and the cached attention paths (prefill, decode and speculative verification).

Layout (one dict per decoder layer, every buffer [B, S, ...] with S = the fixed cache size):
  * mla / dsa: "latent" [B, S, kv_lora] (after kv_a_norm) and "k_rope" [B, S, qk_rope] (after RoPE):
    the compressed MLA cache, kv_lora + qk_rope numbers per token (512 + 64 at GLM-5 scale);
    dsa "full" indexer layers add "k_idx" [B, S, index_head_dim] (after LayerNorm and RoPE).
    "shared" indexer layers keep no indexer keys: they reuse the previous full layer's selection.
  * mha / gqa: "k" [B, S, kv_heads, head_dim] (after RoPE) and "v" [B, S, kv_heads, head_dim].

Cache slot == absolute token position of its row (prompts are RIGHT-padded, see decode.py), so a
query at position p sees exactly the slots 0..p; slots past a row's frontier may hold garbage
(pad tokens, rejected drafts) and are never visible before they are overwritten.

MLA decoding is ABSORBED: with kv_b = [W_UK | W_UV] per head,
    q_nope . k_nope = q_nope . (latent W_UK) = (q_nope W_UK^T) . latent,
    sum_s p_s v_s = (sum_s p_s latent_s) W_UV,
so queries are projected into the latent space once and attention runs over the
(kv_lora + qk_rope)-wide cache; K/V are never expanded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.layers.common import dtype_of
from glm5_jax.layers.rope import apply_rope
from pallas_kernels import reference as ref

NEG_INF = -jnp.inf


# ----------------------------------------------------------------------------- allocation
def layer_cache(config, batch: int, size: int, indexer: bool) -> dict:
    """Zeroed cache of one attention layer ([B, S, ...] buffers in the compute dtype)."""
    c, dt = config, dtype_of(config.dtype)
    if c.is_mla:
        out = {"latent": jnp.zeros((batch, size, c.kv_lora_rank), dt),
               "k_rope": jnp.zeros((batch, size, c.qk_rope_head_dim), dt)}
        if indexer:
            out["k_idx"] = jnp.zeros((batch, size, c.index_head_dim), dt)
        return out
    shape = (batch, size, c.num_kv_heads, c.head_dim)
    return {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}


def init_cache(config, batch: int, size: int, mtp_depths: int = 0) -> dict:
    """{"layers": [per main layer], "mtp": [per MTP depth]} (MTP layers are dsa 'full' when dsa)."""
    types = config.layer_indexer_types
    layers = [layer_cache(config, batch, size, bool(types) and types[i] == "full")
              for i in range(config.num_layers)]
    mtp = [layer_cache(config, batch, size, config.attention == "dsa") for _ in range(mtp_depths)]
    return {"layers": layers, "mtp": mtp}


def cache_numbers_per_token(config) -> int:
    """Cached numbers per token summed over the main layers (e.g. GLM-5: 78 * 576 + indexer keys)."""
    types = config.layer_indexer_types
    total = 0
    for i in range(config.num_layers):
        if config.is_mla:
            total += config.kv_lora_rank + config.qk_rope_head_dim
            if types and types[i] == "full":
                total += config.index_head_dim
        else:
            total += 2 * config.num_kv_heads * config.head_dim
    return total


def write(buf, wpos, new):
    """buf [B, S, ...] with new [B, T, ...] written at slots wpos [B, T]; wpos < 0 or >= S is dropped."""
    s = buf.shape[1]
    wpos = jnp.where(wpos < 0, s, wpos)
    rows = jnp.arange(buf.shape[0])[:, None]
    return buf.at[rows, wpos].set(new.astype(buf.dtype), mode="drop")


def visible(pos, size: int):
    """[B, T, S] bool: slot s is visible from a query at position pos (s <= pos)."""
    return jnp.arange(size)[None, None, :] <= pos[..., None]


# ----------------------------------------------------------------------------- numerics helpers
def dense(x, kernel, dt):
    return jnp.dot(x.astype(dt), kernel.astype(dt))


def rms_norm(x, scale, eps):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * y.astype(x.dtype)


def layer_norm(x, scale, bias, eps=1e-6):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _softmax_rows(logits, mask):
    logits = jnp.where(mask, logits, NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    d = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(d == 0, 1.0, d)          # a row with no visible key gives zeros, never NaN


# ----------------------------------------------------------------------------- attention kinds
def gqa_attention(config, p, x, cos, sin, pos, wpos, lc):
    """mha / gqa over the K/V cache. x [B, T, D] -> (out [B, T, D], new layer cache)."""
    c, dt = config, dtype_of(config.dtype)
    b, t, _ = x.shape
    h, hk, hd = c.num_heads, c.num_kv_heads, c.head_dim
    q = dense(x, p["q_proj"]["kernel"], dt).reshape(b, t, h, hd)
    k = dense(x, p["k_proj"]["kernel"], dt).reshape(b, t, hk, hd)
    v = dense(x, p["v_proj"]["kernel"], dt).reshape(b, t, hk, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    lc = {"k": write(lc["k"], wpos, k), "v": write(lc["v"], wpos, v)}
    s = lc["k"].shape[1]
    logits = jnp.einsum("btkgd,bskd->btkgs", q.reshape(b, t, hk, h // hk, hd), lc["k"]).astype(jnp.float32)
    probs = _softmax_rows(logits * hd ** -0.5, visible(pos, s)[:, :, None, None, :])
    out = jnp.einsum("btkgs,bskd->btkgd", probs.astype(lc["v"].dtype), lc["v"]).reshape(b, t, h * hd)
    return dense(out, p["o_proj"]["kernel"], dt), lc


def mla_project(config, p, x, cos, sin):
    """MLA projections of x [B, T, D]: q_nope [B,T,H,dn], q_rope [B,T,H,dr] (roped), q_latent,
    latent [B,T,kv_lora] (normed), k_rope [B,T,dr] (roped)."""
    c, dt = config, dtype_of(config.dtype)
    b, t, _ = x.shape
    h, dn, dr, r = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    q_latent = rms_norm(dense(x, p["q_a_proj"]["kernel"], dt), p["q_a_norm"]["scale"], 1e-6)
    q = dense(q_latent, p["q_b_proj"]["kernel"], dt).reshape(b, t, h, dn + dr)
    kv = dense(x, p["kv_a_proj"]["kernel"], dt)
    latent = rms_norm(kv[..., :r], p["kv_a_norm"]["scale"], 1e-6)
    return q[..., :dn], apply_rope(q[..., dn:], cos, sin), q_latent, latent, apply_rope(kv[..., r:], cos, sin)


def split_kv_b(config, p):
    """kv_b kernel [kv_lora, H*(dn+dv)] -> (W_UK [kv_lora, H, dn], W_UV [kv_lora, H, dv])."""
    c = config
    w = p["kv_b_proj"]["kernel"].reshape(c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
    return w[..., :c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]


def absorbed_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale, *, mask=None, indices=None):
    """Absorbed MLA attention over a latent cache.

    q_nope [B,T,H,dn], q_rope [B,T,H,dr], latent [B,S,r], k_rope [B,S,dr], w_uk [r,H,dn], w_uv [r,H,dv];
    either mask [B,T,S] (dense over the cache) or indices [B,T,K] (-1 = none; DSA: only the selected
    slots are gathered) -> [B,T,H,dv].
    """
    dt = latent.dtype
    q_lat = jnp.einsum("bthd,rhd->bthr", q_nope, w_uk.astype(q_nope.dtype)).astype(dt)
    if indices is None:
        logits = (jnp.einsum("bthr,bsr->bths", q_lat, latent).astype(jnp.float32)
                  + jnp.einsum("bthd,bsd->bths", q_rope.astype(dt), k_rope).astype(jnp.float32))
        probs = _softmax_rows(logits * scale, mask[:, :, None, :]).astype(dt)
        o_lat = jnp.einsum("bths,bsr->bthr", probs, latent)
    else:
        valid = indices >= 0
        safe = jnp.where(valid, indices, 0)
        gather = jax.vmap(lambda buf, i: buf[i])             # [S, d], [T, K] -> [T, K, d]
        lat_g, kr_g = gather(latent, safe), gather(k_rope, safe)
        logits = (jnp.einsum("bthr,btkr->bthk", q_lat, lat_g).astype(jnp.float32)
                  + jnp.einsum("bthd,btkd->bthk", q_rope.astype(dt), kr_g).astype(jnp.float32))
        probs = _softmax_rows(logits * scale, valid[:, :, None, :]).astype(dt)
        o_lat = jnp.einsum("bthk,btkr->bthr", probs, lat_g)
    return jnp.einsum("bthr,rhd->bthd", o_lat, w_uv.astype(dt))


def indexer_topk_cached(config, p, x, q_latent, cos, sin, pos, wpos, lc):
    """DSA indexer at decode: write this step's indexer keys, exact top-k over visible slots 0..pos.
    Returns (indices [B, T, min(topk, S)] int32 with -1 where fewer keys are visible, new cache)."""
    c, dt = config, dtype_of(config.dtype)
    b, t, _ = x.shape
    hi, di, r = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
    q = dense(q_latent, p["wq_b"]["kernel"], dt).reshape(b, t, hi, di)
    k = layer_norm(dense(x, p["wk"]["kernel"], dt), p["k_norm"]["scale"], p["k_norm"]["bias"])
    q = jnp.concatenate([apply_rope(q[..., :r], cos, sin), q[..., r:]], axis=-1) * (di ** -0.5)
    k = jnp.concatenate([apply_rope(k[..., :r], cos, sin), k[..., r:]], axis=-1)
    w = jnp.dot(x.astype(jnp.float32), p["weights_proj"]["kernel"].astype(jnp.float32)) * (hi ** -0.5)
    lc = dict(lc, k_idx=write(lc["k_idx"], wpos, k))
    s = lc["k_idx"].shape[1]
    scores = jnp.where(visible(pos, s), ref.index_scores(q, lc["k_idx"], w), NEG_INF)
    vals, idx = jax.lax.top_k(scores, min(c.index_topk, s))        # ties -> lower slot, as in training
    return jnp.where(vals == NEG_INF, -1, idx).astype(jnp.int32), lc


def mla_attention(config, p, x, cos, sin, pos, wpos, lc, indexer_type=None, prev_indices=None):
    """mla / dsa with the absorbed latent cache. Returns (out [B,T,D], new cache, indices or None)."""
    c, dt = config, dtype_of(config.dtype)
    b, t, _ = x.shape
    q_nope, q_rope, q_latent, latent, k_rope = mla_project(c, p, x, cos, sin)
    lc = dict(lc, latent=write(lc["latent"], wpos, latent), k_rope=write(lc["k_rope"], wpos, k_rope))
    indices = None
    if indexer_type == "full":
        indices, lc = indexer_topk_cached(c, p["indexer"], x, q_latent, cos, sin, pos, wpos, lc)
    elif indexer_type == "shared":
        if prev_indices is None:
            raise ValueError("a 'shared' indexer layer needs the top-k indices of a previous 'full' layer")
        indices = prev_indices
    w_uk, w_uv = split_kv_b(c, p)
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    mask = None if indices is not None else visible(pos, lc["latent"].shape[1])
    out = absorbed_attention(q_nope, q_rope, lc["latent"], lc["k_rope"], w_uk, w_uv, scale,
                             mask=mask, indices=indices)
    return dense(out.reshape(b, t, -1), p["o_proj"]["kernel"], dt), lc, indices
