"""Muon (momentum orthogonalised by Newton-Schulz) as an optax transformation.

Update for a matrix leaf W (kernel layout [in, out], any leading axes are batch axes):

    m_t   = beta * m_{t-1} + (1 - beta) * g_t                   (EMA momentum, float32)
    u_t   = beta * m_t + (1 - beta) * g_t                       (Nesterov look-ahead)
    O_t   = NS5(u_t / ||u_t||_F)                                (per matrix, float32)
    out_t = rms_scale * sqrt(max(fan_in, fan_out)) * O_t        (AdamW-matched RMS, Moonlight)

Learning rate and decoupled weight decay are applied outside (see ``make_optimizer``), so the
final parameter step is ``-lr * (out_t + wd * W)``.

Muon Split: a leaf may be given a :class:`HeadSplit`; its last axis is then viewed as
``[heads, sum(segments)]`` and every (head, segment) slice is orthogonalised (and RMS-scaled
with its own fan-in/fan-out) as an independent matrix.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


# --------------------------------------------------------------------------------------------
# Newton-Schulz
# --------------------------------------------------------------------------------------------
def _ns_matrix(x: jax.Array, coeffs, steps: int, eps: float) -> jax.Array:
    """Quintic Newton-Schulz on one [m, n] matrix (float32)."""
    a, b, c = coeffs
    transposed = x.shape[0] > x.shape[1]
    if transposed:  # iterate on the wide orientation: the Gram matrix is then min(m, n)^2
        x = x.T
    x = x / (jnp.sqrt(jnp.sum(x * x)) + eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.T if transposed else x


def newton_schulz(x: jax.Array, *, coeffs: Sequence[float] = NS_COEFFS, steps: int = NS_STEPS,
                  eps: float = 1e-7) -> jax.Array:
    """Approximately orthogonalise the last two axes of ``x`` (leading axes are batch axes).

    Computed in float32 on each matrix normalised by its Frobenius norm; returns float32.
    Singular vectors are preserved; every singular value s (after normalisation) becomes
    p^steps(s) with p(s) = a s + b s^3 + c s^5, which for s >~ 0.01 lies in [0.682, 1.135].
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs rank >= 2, got shape {x.shape}")
    lead, (m, n) = x.shape[:-2], x.shape[-2:]
    flat = x.astype(jnp.float32).reshape((-1, m, n))
    coeffs = tuple(float(v) for v in coeffs)
    out = jax.vmap(lambda mat: _ns_matrix(mat, coeffs, steps, eps))(flat)
    return out.reshape(lead + (m, n))


# --------------------------------------------------------------------------------------------
# Split description
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """View the last axis as [num_heads, sum(segments)]; orthogonalise each (head, segment)."""

    num_heads: int
    segments: tuple[int, ...]

    @property
    def head_dim(self) -> int:
        return sum(self.segments)


def _rms_factor(fan_in: int, fan_out: int, rms_scale: Optional[float]) -> float:
    if rms_scale is None:
        return 1.0
    return float(rms_scale) * math.sqrt(max(fan_in, fan_out))


def orthogonalize_leaf(x: jax.Array, split: Optional[HeadSplit] = None, *,
                       rms_scale: Optional[float] = 0.2, coeffs=NS_COEFFS,
                       steps: int = NS_STEPS, eps: float = 1e-7) -> jax.Array:
    """NS-orthogonalise a (possibly stacked) kernel and apply the RMS scale; float32 out."""
    if x.ndim < 2:
        raise ValueError(f"Muon needs a matrix, got shape {x.shape}")
    m, n = x.shape[-2:]
    if split is None:
        o = newton_schulz(x, coeffs=coeffs, steps=steps, eps=eps)
        return o * _rms_factor(m, n, rms_scale)
    h, hd = split.num_heads, split.head_dim
    if n != h * hd:
        raise ValueError(f"HeadSplit {split} does not fit last axis {n} of shape {x.shape}")
    lead = x.shape[:-2]
    x4 = x.reshape(lead + (m, h, hd))
    pieces, off = [], 0
    for seg in split.segments:
        part = x4[..., off:off + seg]                      # [*lead, m, h, seg]
        part = jnp.moveaxis(part, -2, -3)                  # [*lead, h, m, seg]  (head = batch)
        o = newton_schulz(part, coeffs=coeffs, steps=steps, eps=eps)
        o = o * _rms_factor(m, seg, rms_scale)
        pieces.append(jnp.moveaxis(o, -3, -2))             # back to [*lead, m, h, seg]
        off += seg
    out = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)
    return out.reshape(x.shape)


# --------------------------------------------------------------------------------------------
# Path helpers (shared with partition.py)
# --------------------------------------------------------------------------------------------
def key_to_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_to_str(path) -> str:
    return "/".join(key_to_str(k) for k in path)


SplitFn = Callable[[str, tuple], Optional[HeadSplit]]


# --------------------------------------------------------------------------------------------
# The transformation
# --------------------------------------------------------------------------------------------
class MuonState(NamedTuple):
    count: jax.Array   # int32 scalar
    mu: Any            # float32 momentum, same tree as params


def scale_by_muon(*, beta: float = 0.95, nesterov: bool = True, bias_correction: bool = False,
                  rms_scale: Optional[float] = 0.2, coeffs: Sequence[float] = NS_COEFFS,
                  steps: int = NS_STEPS, eps: float = 1e-7, split_fn: Optional[SplitFn] = None,
                  mu_dtype=jnp.float32) -> optax.GradientTransformation:
    """Muon direction (momentum -> Newton-Schulz -> RMS scale). No learning rate, no decay.

    ``split_fn(path, shape) -> HeadSplit | None`` chooses the Muon-Split view per leaf (path is the
    '/'-joined key path). ``bias_correction=True`` reproduces optax.contrib.muon's bias-corrected
    Nesterov combination exactly; the default (False) is the original Muon/Moonlight form. Both
    give the same direction on step 1 and converge to the same one as beta^t -> 0.
    """
    coeffs = tuple(float(c) for c in coeffs)

    def init_fn(params):
        mu = jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype), params)
        return MuonState(count=jnp.zeros([], jnp.int32), mu=mu)

    def update_fn(updates, state, params=None):
        del params
        count = state.count + 1
        mu = jax.tree.map(lambda m, g: beta * m + (1.0 - beta) * g.astype(mu_dtype),
                          state.mu, updates)
        if bias_correction:
            t = count.astype(jnp.float32)
            c_mu = 1.0 / (1.0 - beta ** (t + 1.0))
            c_g = 1.0 / (1.0 - beta ** t)
        else:
            c_mu = c_g = 1.0
        if nesterov:
            look = jax.tree.map(lambda m, g: beta * c_mu * m + (1.0 - beta) * c_g *
                                g.astype(jnp.float32), mu, updates)
        else:
            look = mu

        def one(path, u, g):
            split = split_fn(path_to_str(path), tuple(u.shape)) if split_fn else None
            o = orthogonalize_leaf(u, split, rms_scale=rms_scale, coeffs=coeffs, steps=steps,
                                   eps=eps)
            return o.astype(g.dtype)

        new_updates = jax.tree_util.tree_map_with_path(one, look, updates)
        return new_updates, MuonState(count=count, mu=jax.tree.map(
            lambda m: m.astype(mu_dtype), mu))

    return optax.GradientTransformation(init_fn, update_fn)


def muon(learning_rate, *, weight_decay: float = 0.1, beta: float = 0.95,
         rms_scale: Optional[float] = 0.2, split_fn: Optional[SplitFn] = None,
         bias_correction: bool = False, nesterov: bool = True,
         eps: float = 1e-7) -> optax.GradientTransformation:
    """Muon on every leaf (all leaves must be matrices, possibly stacked): direction, decoupled
    weight decay (lr * wd * W), learning rate (float or schedule)."""
    return optax.chain(
        scale_by_muon(beta=beta, nesterov=nesterov, bias_correction=bias_correction,
                      rms_scale=rms_scale, split_fn=split_fn, eps=eps),
        optax.add_decayed_weights(weight_decay) if weight_decay else optax.identity(),
        optax.scale_by_learning_rate(learning_rate),
    )
