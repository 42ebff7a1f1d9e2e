"""Interleaved rotary position embedding, as GLM-5 / DeepSeek lay it out, with context-extension scaling.

Pairs (x0, x1), (x2, x3), ... are rotated by one frequency each; the result is written
de-interleaved, `[even parts rotated ; odd parts rotated]`, exactly as the HF reference does. Queries
and keys get the same permutation, so dot products equal those of the interleaved layout.

Scaling (`ModelConfig.rope_scaling`, a dict here; None = `default`: plain RoPE with any `theta`):

* `linear` {factor}: every inverse frequency divided by `factor` (= positions divided by it).
* `yarn` {factor, original_max_position_embeddings, beta_fast=32, beta_slow=1, mscale, mscale_all_dim,
  attention_factor, truncate=True}: DeepSeek-V3-style YaRN as transformers' `glm_moe_dsa` computes it.
  Per frequency pair i, blend the original frequency (extrapolation) and the frequency / factor
  (interpolation) with a linear ramp over the pair index between the dims where a pair turns
  `beta_fast` and `beta_slow` times over `original_max_position_embeddings` tokens. Two scalars
  come with it and are applied where the reference applies them:
    - `rope_attention_factor`: cos and sin are multiplied by it (so the rope part of every q.k --
      MLA's and the DSA indexer's -- scales by its square). Explicit `attention_factor`, else
      mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set and non-zero,
      else mscale(factor, 1); mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1.
    - `softmax_scale`: the attention softmax scale head_dim^-0.5 is multiplied by
      mscale(factor, mscale_all_dim)^2 when `mscale_all_dim` is set and non-zero (the main attention
      only: the indexer keeps its Di^-0.5, as in the reference).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}


def _mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_ramp_bounds(dim: int, theta: float, scaling: dict) -> tuple[float, float]:
    """(low, high) pair-index bounds of YaRN's blend: pairs below `low` keep their frequency, pairs
    above `high` are divided by the factor; pair i rotates L / (2 pi theta^(2i/dim)) times over the
    original context L, and the bounds are where that count equals beta_fast and beta_slow."""
    length = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or YARN_DEFAULTS["beta_fast"]
    beta_slow = scaling.get("beta_slow") or YARN_DEFAULTS["beta_slow"]
    at = lambda rotations: dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = at(beta_fast), at(beta_slow)
    if scaling.get("truncate", YARN_DEFAULTS["truncate"]):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def inv_frequencies(dim: int, theta: float, scaling: dict | None = None):
    """[dim // 2] float32 inverse frequencies theta^(-2i/dim), adjusted by `scaling` (see module doc)."""
    wave = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    kind = (scaling or {}).get("type", "default")
    if kind == "linear":
        return 1.0 / (float(scaling["factor"]) * wave)
    if kind == "yarn":
        low, high = yarn_ramp_bounds(dim, theta, scaling)
        if low == high:
            high += 0.001                                  # as the reference: no zero-width ramp
        ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
        keep = 1.0 - ramp                                  # 1: original frequency, 0: interpolated
        return (1.0 / (float(scaling["factor"]) * wave)) * (1.0 - keep) + (1.0 / wave) * keep
    return 1.0 / wave


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by (1.0 except for yarn)."""
    if not scaling or scaling.get("type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return _mscale(factor, float(m)) / _mscale(factor, float(m_all))
    return _mscale(factor)


def softmax_scale(head_dim: int, scaling: dict | None = None) -> float:
    """The attention softmax scale for a q.k over `head_dim` numbers: head_dim^-0.5, times
    mscale(factor, mscale_all_dim)^2 under a scaled RoPE that sets a non-zero mscale_all_dim."""
    scale = head_dim ** -0.5
    if scaling and scaling.get("type", "default") != "default" and scaling.get("mscale_all_dim"):
        scale *= _mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return scale


def rope_angles(positions, dim: int, theta: float, scaling: dict | None = None):
    """positions [B, T] (int) -> (cos, sin) each [B, T, dim // 2] in float32, both multiplied by
    `rope_attention_factor(scaling)`. `scaling`: None (default RoPE) or a rope_scaling dict."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_frequencies(dim, theta, scaling)
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    att = rope_attention_factor(scaling)
    if att != 1.0:
        cos, sin = cos * att, sin * att
    return cos, sin


def apply_rope(x, cos, sin):
    """x [B, T, H, D] (or [B, T, D] with cos/sin [B, T, D/2]) -> same shape, rotated."""
    if x.ndim == cos.ndim + 1:
        cos, sin = cos[..., None, :], sin[..., None, :]
    cos = cos.astype(x.dtype)
    sin = sin.astype(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
