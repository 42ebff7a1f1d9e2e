"""Shared building blocks: dtypes, initialisers with logical axis names, RMSNorm, LayerNorm, Dense."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str):
    return DTYPES[name]


def init_normal(stddev: float, axes: Sequence[str | None]):
    """A normal initialiser whose parameter carries logical axis names (for sharding rules)."""
    return nn.with_logical_partitioning(nn.initializers.normal(stddev), tuple(axes))


def constrain(x, axes: Sequence[str | None]):
    """Logical sharding constraint on an activation; a no-op outside a mesh with axis rules."""
    return nn.with_logical_constraint(x, tuple(axes))


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) computed in float32, cast back, times a learnt scale (HF order)."""
    eps: float = 1e-5
    param_dtype: jnp.dtype = jnp.float32
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
                           (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return scale.astype(x.dtype) * y.astype(x.dtype)


class LayerNorm(nn.Module):
    """Standard LayerNorm (mean and variance) with scale and bias; the indexer's key norm."""
    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (d,), self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)), (d,), self.param_dtype)
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


@jax.custom_vjp
def _dot_nn_kernel_grad(x, w):
    """x [N, I] @ w [I, O] (float32 result) whose kernel gradient runs as an NN GEMM on XLA CPU:
    x is transposed into its own buffer first (optimization_barrier keeps XLA from folding the
    transpose back into the dot). XLA CPU runs the dot that contracts dimension 0 of both operands
    on Eigen at ~2.3x the time of the same product after the copy (LM head at N=4096, I=256,
    O=8192: 0.63 s vs 0.27 s, one core, docs/training.md)."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _dot_nn_fwd(x, w):
    return _dot_nn_kernel_grad(x, w), (x, w)


def _dot_nn_bwd(res, g):
    x, w = res
    dx = jnp.dot(g, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.dot(jax.lax.optimization_barrier(x.T), g.astype(x.dtype), preferred_element_type=jnp.float32)
    return dx, dw.astype(w.dtype)


_dot_nn_kernel_grad.defvjp(_dot_nn_fwd, _dot_nn_bwd)


class Dense(nn.Module):
    """Bias-free linear layer, kernel [in, out] with logical axes (in_axis, out_axis).

    out_dtype (default: dtype) is the dot's accumulation and result dtype: the LM head multiplies
    bf16 operands into float32 logits without materialising a float32 copy of its kernel."""
    features: int
    axes: tuple[str | None, str | None]
    stddev: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    out_dtype: jnp.dtype | None = None
    nn_kernel_grad: bool = False   # CPU, float32 out, no mesh: `_dot_nn_kernel_grad` (the LM head)

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", init_normal(self.stddev, self.axes), (x.shape[-1], self.features),
                            self.param_dtype)
        # a 2-D [tokens, in] operand: with [B, T, in] the kernel gradient contracts two dims and
        # XLA:CPU ran it ~1.5x slower (LM head fwd+bwd at B=4 T=1024 V=8192, tools.bench_vs_hf)
        x2 = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        if (self.nn_kernel_grad and self.out_dtype == jnp.float32 and jax.default_backend() == "cpu"
                and jax.sharding.get_abstract_mesh().size <= 1):
            out = _dot_nn_kernel_grad(x2, kernel.astype(self.dtype))
        else:
            out = jnp.dot(x2, kernel.astype(self.dtype), preferred_element_type=self.out_dtype)
        out = out.reshape(*x.shape[:-1], self.features)
        return out if self.out_dtype is None else out.astype(self.out_dtype)
