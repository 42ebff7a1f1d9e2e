"""Grouped matrix multiplication for the routed experts: rows sorted by group, each row times its own
group's matrix, with a backward whose weight gradient is a grouped TRANSPOSED matmul (each group
contracts over its own rows only).

    grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G], impl=...) -> [M, N]

Rows are laid out group after group (group g owns rows [sum(sizes[:g]), sum(sizes[:g+1]))); rows past
sum(group_sizes) belong to no group and come out 0 (their gradients too). Contract of
`jax.lax.ragged_dot(lhs, rhs, group_sizes)`, which is the reference (tests/test_gmm.py).

impl (ModelConfig.moe_kernel):
- "auto": megablox on TPU, `lax.ragged_dot` elsewhere. Why not ragged_dot on TPU: the TPU compiler
  lowers ragged_dot's forward and dX as grouped kernels, but its transpose for dW as a dense product over
  all G local groups in which every group contracts over all M rows (G x the FLOPs and bytes needed;
  docs/scaleout.md, "Compiled step budget").
- "megablox": `jax.experimental.pallas.ops.tpu.megablox` (ships with jax): `gmm` for the forward and
  dX (rhs transposed in the kernel), `tgmm` for dW. Mosaic on TPU; interpret mode on CPU (tests). There
  is no GPU lowering of these kernels: asking for them on GPU is an error at lowering, never a silent
  fallback to the dense form (the
  Mosaic call fails to lower there).
- "ragged_dot": `jax.lax.ragged_dot` on every platform (the reference; on TPU the dense-dW lowering).

The megablox kernels carry a Pallas cost estimate (flops = 2 M K N, bytes accessed) in their backend
config; tools/budget.py counts it.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

MOE_KERNELS = ("auto", "megablox", "ragged_dot")


def _tile(dim: int, prefer: int, align: int) -> int:
    """The largest tile <= prefer that divides dim and is a multiple of align, else the whole dim
    (Mosaic blocks: multiples of (8, 128) or the full dimension)."""
    for t in range(min(prefer, dim) // align * align, 0, -align):
        if dim % t == 0:
            return t
    return dim


def tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(tm, tk, tn) for megablox: row tiles of up to 512 (m is padded to a multiple), K and N tiles of up
    to 1024 lanes (MaxText's megablox defaults: 512 / 1024 / 1024)."""
    tm = min(512, -(-m // 8) * 8)
    return tm, _tile(k, 1024, 128), _tile(n, 1024, 128)


def _backend():
    # the module (its package re-exports a function of the same name, ops.gmm)
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _pad_rows(x, m_pad: int):
    return x if x.shape[0] == m_pad else jnp.pad(x, ((0, m_pad - x.shape[0]), (0, 0)))


def _valid_rows(m: int, group_sizes):
    return (jnp.arange(m) < jnp.sum(group_sizes))[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _megablox(lhs, rhs, group_sizes, interpret: bool):
    return _megablox_fwd(lhs, rhs, group_sizes, interpret)[0]


def _megablox_fwd(lhs, rhs, group_sizes, interpret):
    mb = _backend()
    (m, k), n = lhs.shape, rhs.shape[-1]
    tm, tk, tn = tiling(m, k, n)
    m_pad = -(-m // tm) * tm
    out = mb.gmm(_pad_rows(lhs, m_pad), rhs, group_sizes, lhs.dtype, (tm, tk, tn), interpret=interpret)[:m]
    # rows past the last group are never visited by the kernel (undefined memory): zero them
    return jnp.where(_valid_rows(m, group_sizes), out, 0), (lhs, rhs, group_sizes)


def _megablox_bwd(interpret, res, g):
    mb = _backend()
    lhs, rhs, group_sizes = res
    (m, k), n, groups = lhs.shape, rhs.shape[-1], rhs.shape[0]
    valid = _valid_rows(m, group_sizes)
    g = jnp.where(valid, g, 0).astype(lhs.dtype)
    tm, tk, tn = tiling(m, n, k)                       # dX = g [M, N] x rhs[g]^T [N, K]
    m_pad = -(-m // tm) * tm
    dlhs = mb.gmm(_pad_rows(g, m_pad), rhs, group_sizes, lhs.dtype, (tm, tk, tn), transpose_rhs=True,
                  interpret=interpret)[:m]
    tm, tk, tn = tiling(m, k, n)                       # dW[g] = lhs[rows of g]^T [K, m_g] x g [m_g, N]
    m_pad = -(-m // tm) * tm
    drhs = mb.tgmm(_pad_rows(lhs, m_pad).swapaxes(0, 1), _pad_rows(g, m_pad), group_sizes, rhs.dtype,
                   (tm, tk, tn), num_actual_groups=groups, interpret=interpret)
    return jnp.where(valid, dlhs, 0), drhs, None


_megablox.defvjp(_megablox_fwd, _megablox_bwd)


def grouped_matmul(lhs, rhs, group_sizes, *, impl: str = "auto"):
    """lhs [M, K] rows sorted by group, rhs [G, K, N], group_sizes int32 [G] -> [M, N] in lhs's dtype
    (float32 accumulation). Module docstring: the layout and the impls."""
    if impl not in MOE_KERNELS:
        raise ValueError(f"moe_kernel must be one of {', '.join(MOE_KERNELS)}, got {impl!r}")
    group_sizes = group_sizes.astype(jnp.int32)
    ragged = lambda a, w, s: jax.lax.ragged_dot(a, w, s)
    if impl == "ragged_dot":
        return ragged(lhs, rhs, group_sizes)
    tpu = lambda a, w, s: _megablox(a, w, s, False)
    if impl == "auto":
        return jax.lax.platform_dependent(lhs, rhs, group_sizes, tpu=tpu, default=ragged)
    # "megablox": the kernels on TPU, interpret mode on CPU; on GPU the Mosaic call fails to lower (loud)
    return jax.lax.platform_dependent(lhs, rhs, group_sizes, tpu=tpu, cpu=lambda a, w, s: _megablox(a, w, s, True),
                                      default=tpu)
