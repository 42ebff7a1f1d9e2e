"""Interleaved rotary position embedding, as GLM-5 / DeepSeek lay it out.

Pairs (x0, x1), (x2, x3), ... are rotated by one frequency each; the result is written
de-interleaved, `[even parts rotated ; odd parts rotated]`, exactly as the HF reference does. Queries
and keys get the same permutation, so dot products equal those of the interleaved layout.
"""

from __future__ import annotations

import jax.numpy as jnp


def inv_frequencies(dim: int, theta: float):
    return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def rope_angles(positions, dim: int, theta: float, scaling: dict | None = None):
    """positions [B, T] (int) -> (cos, sin) each [B, T, dim // 2] in float32.

    `scaling` is the context-extension hook: {"type": "linear", "factor": f} divides positions by f.
    """
    pos = positions.astype(jnp.float32)
    if scaling:
        pos = pos / float(scaling["factor"])
    freqs = pos[..., None] * inv_frequencies(dim, theta)
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x, cos, sin):
    """x [B, T, H, D] (or [B, T, D] with cos/sin [B, T, D/2]) -> same shape, rotated."""
    if x.ndim == cos.ndim + 1:
        cos, sin = cos[..., None, :], sin[..., None, :]
    cos = cos.astype(x.dtype)
    sin = sin.astype(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
