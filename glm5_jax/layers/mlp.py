"""SwiGLU feed-forward block: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.layers.common import Dense


class SwiGLU(nn.Module):
    hidden: int
    stddev: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    mlp_axis: str = "mlp"

    @nn.compact
    def __call__(self, x):
        kw = dict(stddev=self.stddev, dtype=self.dtype, param_dtype=self.param_dtype)
        gate = Dense(self.hidden, ("embed", self.mlp_axis), name="gate_proj", **kw)(x)
        up = Dense(self.hidden, ("embed", self.mlp_axis), name="up_proj", **kw)(x)
        return Dense(x.shape[-1], (self.mlp_axis, "embed"), name="down_proj", **kw)(jax.nn.silu(gate) * up)
