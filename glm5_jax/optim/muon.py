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

    def body(_, x):
        gram = x @ x.T
        poly = b * gram + c * (gram @ gram)
        return a * x + poly @ x

    # a rolled loop keeps the HLO (and compile time) small: one body per matrix shape
    x = jax.lax.fori_loop(0, steps, body, x)
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


def _leaf_to_pieces(x: jax.Array, split: Optional[HeadSplit]) -> list[jax.Array]:
    """Float32 batches of independent matrices [N, m, n] making up one leaf."""
    if x.ndim < 2:
        raise ValueError(f"Muon needs a matrix, got shape {x.shape}")
    x = x.astype(jnp.float32)
    m, n = x.shape[-2:]
    if split is None:
        return [x.reshape((-1, m, n))]
    h, hd = split.num_heads, split.head_dim
    if n != h * hd:
        raise ValueError(f"HeadSplit {split} does not fit last axis {n} of shape {x.shape}")
    x4 = x.reshape(x.shape[:-2] + (m, h, hd))
    pieces, off = [], 0
    for seg in split.segments:
        part = jnp.moveaxis(x4[..., off:off + seg], -2, -3)   # [*lead, h, m, seg] (head = batch)
        pieces.append(part.reshape((-1, m, seg)))
        off += seg
    return pieces


def _pieces_to_leaf(pieces: list[jax.Array], shape: tuple,
                    split: Optional[HeadSplit]) -> jax.Array:
    if split is None:
        return pieces[0].reshape(shape)
    lead, m = tuple(shape[:-2]), shape[-2]
    h = split.num_heads
    outs = [jnp.moveaxis(p.reshape(lead + (h, m, p.shape[-1])), -3, -2) for p in pieces]
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)
    return out.reshape(shape)


def _orthogonalize_batches(batches: list[jax.Array], *, rms_scale, coeffs, steps, eps,
                           group: bool, groupable: Optional[list[bool]] = None
                           ) -> list[jax.Array]:
    """NS + RMS scale for a list of [N_i, m_i, n_i] batches. When ``group``, the groupable
    batches of equal (m, n) are concatenated into one batch first (fewer, larger matmuls and a
    much smaller program); the results are the same."""
    coeffs = tuple(float(v) for v in coeffs)
    ns = jax.vmap(lambda mat: _ns_matrix(mat, coeffs, steps, eps))
    out: list[Optional[jax.Array]] = [None] * len(batches)
    groups: dict[tuple, list[int]] = {}
    for i, bt in enumerate(batches):
        ok = group and (groupable is None or groupable[i])
        groups.setdefault(("g",) + tuple(bt.shape[1:]) if ok else (i,), []).append(i)
    for idx in groups.values():
        m, n = batches[idx[0]].shape[1:]
        fac = _rms_factor(m, n, rms_scale)
        if len(idx) == 1:
            out[idx[0]] = ns(batches[idx[0]]) * fac
            continue
        cat = jnp.concatenate([batches[i] for i in idx], axis=0)
        res = ns(cat) * fac
        off = 0
        for i in idx:
            nb = batches[i].shape[0]
            out[i] = res[off:off + nb]
            off += nb
    return out


def orthogonalize_leaf(x: jax.Array, split: Optional[HeadSplit] = None, *,
                       rms_scale: Optional[float] = 0.2, coeffs=NS_COEFFS,
                       steps: int = NS_STEPS, eps: float = 1e-7) -> jax.Array:
    """NS-orthogonalise a (possibly stacked) kernel and apply the RMS scale (each independent
    matrix uses its own fan-in/fan-out); float32 out, same shape as ``x``."""
    pieces = _leaf_to_pieces(x, split)
    outs = _orthogonalize_batches(pieces, rms_scale=rms_scale, coeffs=coeffs, steps=steps,
                                  eps=eps, group=False)
    return _pieces_to_leaf(outs, x.shape, split)


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
                  mu_dtype=jnp.float32, group_same_shapes: bool = True) -> optax.GradientTransformation:
    """Muon direction (momentum -> Newton-Schulz -> RMS scale). No learning rate, no decay.

    ``split_fn(path, shape) -> HeadSplit | None`` chooses the Muon-Split view per leaf (path is the
    '/'-joined key path). ``bias_correction=True`` reproduces optax.contrib.muon's bias-corrected
    Nesterov combination exactly; the default (False) is the original Muon/Moonlight form. Both
    give the same direction on step 1 and converge to the same one as beta^t -> 0.
    ``group_same_shapes``: concatenate the independent matrices of equal shape that come from 2-D
    leaves (the same projection in every unrolled layer, Muon-Split head pieces) into one batched
    NS call. Stacked leaves (experts) keep their own call. Results are identical; set False if
    concatenating differently-sharded leaves is undesirable.
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

        flat_look, treedef = jax.tree_util.tree_flatten_with_path(look)
        flat_g = treedef.flatten_up_to(updates)
        splits, batches, owners, groupable = [], [], [], []
        for i, (path, u) in enumerate(flat_look):
            sp = split_fn(path_to_str(path), tuple(u.shape)) if split_fn else None
            splits.append(sp)
            for piece in _leaf_to_pieces(u, sp):
                batches.append(piece)
                owners.append(i)
                # stacked leaves (experts, scanned layers) are already one big batch; never
                # concatenate them with others (size, and their sharding along the batch axis)
                groupable.append(u.ndim == 2)
        outs = _orthogonalize_batches(batches, rms_scale=rms_scale, coeffs=coeffs, steps=steps,
                                      eps=eps, group=group_same_shapes, groupable=groupable)
        per_leaf: list[list[jax.Array]] = [[] for _ in flat_look]
        for o, w in zip(outs, owners):
            per_leaf[w].append(o)
        new_leaves = [_pieces_to_leaf(per_leaf[i], u.shape, splits[i]).astype(g.dtype)
                      for i, ((_, u), g) in enumerate(zip(flat_look, flat_g))]
        new_updates = jax.tree_util.tree_unflatten(treedef, new_leaves)
        return new_updates, MuonState(count=count, mu=jax.tree.map(
            lambda m: m.astype(mu_dtype), mu))

    return optax.GradientTransformation(init_fn, update_fn)


def muon(learning_rate, *, weight_decay: float = 0.1, beta: float = 0.95,
         rms_scale: Optional[float] = 0.2, split_fn: Optional[SplitFn] = None,
         bias_correction: bool = False, nesterov: bool = True, eps: float = 1e-7,
         group_same_shapes: bool = True) -> optax.GradientTransformation:
    """Muon on every leaf (all leaves must be matrices, possibly stacked): direction, decoupled
    weight decay (lr * wd * W), learning rate (float or schedule)."""
    return optax.chain(
        scale_by_muon(beta=beta, nesterov=nesterov, bias_correction=bias_correction,
                      rms_scale=rms_scale, split_fn=split_fn, eps=eps,
                      group_same_shapes=group_same_shapes),
        optax.add_decayed_weights(weight_decay) if weight_decay else optax.identity(),
        optax.scale_by_learning_rate(learning_rate),
    )
