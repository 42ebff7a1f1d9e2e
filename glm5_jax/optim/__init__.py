"""Optimizers for glm5-jax: AdamW, Muon, Muon Split, with path-based parameter assignment.

    tx, labels = make_optimizer("muon_split", params, learning_rate=3e-4,
                                split_spec=MuonSplitSpec(heads, qk_nope, qk_rope, v_head),
                                warmup_steps=100, total_steps=10_000)
    print(optimizer_table(params, labels, split_spec))
    opt_state = tx.init(params)
    updates, opt_state = tx.update(grads, opt_state, params)   # params REQUIRED (weight decay)
    params = optax.apply_updates(params, updates)
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from glm5_jax.utils import path_to_str

from .muon import (HeadSplit, MuonState, NS_COEFFS, NS_STEPS, muon, newton_schulz,
                   orthogonalize_leaf, scale_by_muon)
from .partition import (LABELS, OPTIMIZER_NAMES, MuonSplitSpec, check_optimizer_name,
                        frozen_predicate, make_split_fn, optimizer_table, partition_params, slice_masks)
from .schedules import warmup_cosine

__all__ = [
    "make_optimizer", "partition_params", "frozen_predicate", "slice_masks", "scale_slices", "optimizer_table", "MuonSplitSpec", "HeadSplit",
    "scale_by_muon", "muon", "newton_schulz", "orthogonalize_leaf", "warmup_cosine",
    "path_to_str", "OPTIMIZER_NAMES", "LABELS", "MuonState", "NS_COEFFS", "NS_STEPS",
]


def _zero_masked(labels, zero_labels=("zero", "frozen")) -> optax.GradientTransformation:
    """Set gradients of frozen / router-bias leaves to 0 (so they do not enter the clip norm)."""
    mask = jax.tree.map(lambda lab: lab in zero_labels, labels)
    return optax.masked(optax.set_to_zero(), mask)


def scale_slices(masks) -> optax.GradientTransformation:
    """Multiply each update by its slice mask (zero for frozen layer slices of a stacked leaf)."""
    def update(updates, state, params=None):
        return jax.tree.map(lambda u, m: u * jnp.asarray(m, u.dtype), updates, masks), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(name: str, params, *, learning_rate, weight_decay: float = 0.1,
                   b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                   muon_momentum: float = 0.95, split_spec: Any = None,
                   grad_clip: Optional[float] = 1.0, warmup_steps: int = 0,
                   total_steps: Optional[int] = None, min_lr_ratio: float = 0.1,
                   trainable: Optional[Callable[[str], bool]] = None,
                   frozen_patterns: Optional[Iterable[str]] = None,
                   slice_paths: Optional[Callable[[str], Optional[list]]] = None,
                   muon_rms_scale: float = 0.2, mu_dtype=None, param_specs: Any = None):
    """Build the optimizer. Returns ``(optax.GradientTransformation, labels)``.

    name: 'adamw' | 'muon' | 'muon_split' (ValueError otherwise).
    learning_rate: float peak LR (wrapped in ``warmup_cosine(lr, warmup_steps, total_steps,
      min_lr_ratio)`` when warmup_steps > 0 or total_steps is given) or an optax schedule.
      Muon and AdamW groups share the schedule (Muon's RMS is matched to AdamW's).
    split_spec: MuonSplitSpec or any config with num_heads (or num_attention_heads),
      qk_nope_head_dim, qk_rope_head_dim, v_head_dim. Required for 'muon_split'.
    grad_clip: global-norm clip over all trainable grads (None/0 disables).
    trainable / frozen_patterns: freeze leaves by '/'-joined path (zero update, no state).
    slice_paths: per-layer names of a stacked leaf's slices (glm5_jax.model.layer_slice_paths); with
      it, stacked leaves are frozen per layer ("layer_0/attn" freezes layer 0 of its stack only:
      its gradient is zeroed before the clip norm and its update, weight decay included, after).
    param_specs: the params' PartitionSpecs (a pytree like ``params``, e.g.
      glm5_jax.train.state.param_specs). With it, Muon / Muon Split traced under a mesh of more than
      one device orthogonalise every matrix where its shards live (glm5_jax.optim.distributed); the
      state and the math are the single-device optimizer's.
    ``tx.update`` must be called with ``params`` (decoupled weight decay needs them).
    """
    check_optimizer_name(name)
    spec = None
    if name == "muon_split":
        if split_spec is None:
            raise ValueError("optimizer 'muon_split' needs split_spec (MuonSplitSpec or a config "
                             "with num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)")
        spec = MuonSplitSpec.from_any(split_spec)
    labels = partition_params(params, name, trainable=trainable, frozen_patterns=frozen_patterns,
                              slice_paths=slice_paths)
    masks = slice_masks(params, trainable=trainable, frozen_patterns=frozen_patterns, slice_paths=slice_paths)

    if callable(learning_rate):
        lr = learning_rate
    elif warmup_steps or total_steps is not None:
        lr = warmup_cosine(learning_rate, warmup_steps, total_steps, min_lr_ratio)
    else:
        lr = float(learning_rate)

    def adamw_tx(wd):
        return optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd, mu_dtype=mu_dtype)

    spec_fn = None
    if param_specs is not None:
        is_spec = lambda x: isinstance(x, P)
        flat_specs = jax.tree_util.tree_leaves(param_specs, is_leaf=is_spec)
        flat_paths = [path_to_str(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        if len(flat_specs) != len(flat_paths):
            raise ValueError(f"param_specs has {len(flat_specs)} leaves, params {len(flat_paths)}: it must be a "
                             "PartitionSpec pytree with the params' structure")
        spec_fn = dict(zip(flat_paths, flat_specs)).get

    def muon_tx(split_fn):
        return muon(lr, weight_decay=weight_decay, beta=muon_momentum, rms_scale=muon_rms_scale,
                    split_fn=split_fn, spec_fn=spec_fn)

    transforms = {
        "adamw": adamw_tx(weight_decay),
        "adamw_nodecay": adamw_tx(0.0),
        "zero": optax.set_to_zero(),
        "frozen": optax.set_to_zero(),
        "muon": muon_tx(None),
        "muon_split": muon_tx(make_split_fn(spec) if spec is not None else None),
    }
    used = set(jax.tree.leaves(labels))
    transforms = {k: v for k, v in transforms.items() if k in used}
    if not transforms:  # empty tree
        return optax.identity(), labels
    parts = [_zero_masked(labels)] + ([scale_slices(masks)] if masks is not None else [])
    if grad_clip:
        parts.append(optax.clip_by_global_norm(float(grad_clip)))
    parts.append(optax.partition(transforms, labels))
    if masks is not None:
        parts.append(scale_slices(masks))
    return optax.chain(*parts), labels
