"""Small helpers shared across glm5_jax (one definition each): pytree path names, padding, NEG_INF."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Masked attention / index scores: -inf (not a large finite number) so a fully masked row is
# detectable and exp() of it is exactly 0. Defined once, beside the kernels that need it too.
from pallas_kernels.dsa_xla import NEG_INF  # noqa: F401


def key_to_str(k) -> str:
    """One pytree path entry (DictKey, GetAttrKey, SequenceKey, ...) as its plain name."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_to_str(path) -> str:
    """A `jax.tree_util` key path as the '/'-joined name used by optimizer labels and patterns,
    e.g. "moe_layers/layer_0/attn/q_b_proj/kernel"."""
    return "/".join(key_to_str(k) for k in path)


def pad_to(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """`x` padded at the end of `axis` with `value` up to length `size` (>= its current length)."""
    pad = size - x.shape[axis]
    if pad < 0:
        raise ValueError(f"pad_to: axis {axis} of shape {x.shape} is longer than {size}")
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)
