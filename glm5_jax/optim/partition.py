"""Assign every parameter leaf an optimizer label from its path (see BUILD_NOTES.md layout).

Paths are '/'-joined key paths of the scanned layout: decoder layers sit under a layer stack
(`moe_layers/layer_0/attn/q_b_proj/kernel`, leading axis [repeats]); rules match path components,
never layer indices, so the same rules hold for every stack and for the MTP block.

Labels:
  muon           Muon on the whole matrix (leading axes = stacked layers / experts, one each)
  muon_split     Muon Split: q_b_proj per head, kv_b_proj per head split into K and V parts
  adamw          AdamW with weight decay (lm_head, indexer weights_proj, all leaves for 'adamw')
  adamw_nodecay  AdamW without weight decay (embeddings, norm scales, biases, leaves 1-D per layer)
  zero           exactly zero update, no state, no decay (moe/router/e_score_correction_bias)
  frozen         exactly zero update, no state (user-frozen leaves)
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Iterable, Optional

import jax
import numpy as np

from glm5_jax.utils import path_to_str

from .newton_schulz import HeadSplit

OPTIMIZER_NAMES = ("adamw", "muon", "muon_split")
LABELS = ("muon", "muon_split", "adamw", "adamw_nodecay", "zero", "frozen")
# first path component of a scanned layer stack (ModelConfig.layer_stacks names): its leaves carry
# a leading [repeats] layer axis
_STACK = re.compile(r"^(dense|moe)_layers(_tail)?$")


@dataclasses.dataclass(frozen=True)
class MuonSplitSpec:
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def from_any(cls, obj) -> "MuonSplitSpec":
        """Accept a MuonSplitSpec, a mapping, or any config object with the four fields
        (``num_attention_heads`` is accepted for ``num_heads``)."""
        if isinstance(obj, cls):
            return obj
        get = (lambda k: obj.get(k)) if isinstance(obj, dict) else (
            lambda k: getattr(obj, k, None))
        heads = get("num_heads")
        if heads is None:
            heads = get("num_attention_heads")
        vals = dict(num_heads=heads, qk_nope_head_dim=get("qk_nope_head_dim"),
                    qk_rope_head_dim=get("qk_rope_head_dim"), v_head_dim=get("v_head_dim"))
        missing = [k for k, v in vals.items() if v is None]
        if missing:
            raise ValueError(f"split_spec {obj!r} lacks fields {missing}")
        return cls(**{k: int(v) for k, v in vals.items()})

    @property
    def q_split(self) -> HeadSplit:
        return HeadSplit(self.num_heads, (self.qk_nope_head_dim + self.qk_rope_head_dim,))

    @property
    def kv_split(self) -> HeadSplit:
        return HeadSplit(self.num_heads, (self.qk_nope_head_dim, self.v_head_dim))


def _name_parts(path: str) -> list[str]:
    return path.split("/")


def is_q_b_proj(path: str) -> bool:
    parts = _name_parts(path)
    return "q_b_proj" in parts and "indexer" not in parts


def is_kv_b_proj(path: str) -> bool:
    return "kv_b_proj" in _name_parts(path)


def make_split_fn(spec: MuonSplitSpec) -> Callable[[str, tuple], Optional[HeadSplit]]:
    def split_fn(path: str, shape: tuple) -> Optional[HeadSplit]:
        if is_q_b_proj(path):
            return spec.q_split
        if is_kv_b_proj(path):
            return spec.kv_split
        return None
    return split_fn


def _base_label(path: str, ndim: int, optimizer_name: str) -> str:
    parts = _name_parts(path)
    last = parts[-1]
    if last == "e_score_correction_bias":
        return "zero"
    per_layer_ndim = ndim - 1 if _STACK.match(parts[0]) else ndim     # the layer axis is a batch axis
    if per_layer_ndim <= 1 or last in ("scale", "bias") or last.endswith("_bias"):
        return "adamw_nodecay"
    if last == "embedding" or any("embed" == p or p.endswith("_embed") or p == "embed_tokens"
                                  for p in parts):
        return "adamw_nodecay"
    if any(p in ("lm_head", "shared_head") for p in parts) or "weights_proj" in parts:
        return "adamw"
    if optimizer_name == "adamw":
        return "adamw"
    if optimizer_name == "muon_split" and (is_q_b_proj(path) or is_kv_b_proj(path)):
        return "muon_split"
    return "muon"


def frozen_predicate(trainable: Optional[Callable[[str], bool]],
                     frozen_patterns: Optional[Iterable[str]]) -> Callable[[str], bool]:
    """path -> frozen?: `trainable(path)` is False, or a regex of `frozen_patterns` is found in the
    '/'-joined path (the one rule every optimizer builder should share)."""
    pats = [re.compile(p) for p in (frozen_patterns or ())]

    def is_frozen(path: str) -> bool:
        if trainable is not None and not trainable(path):
            return True
        return any(p.search(path) for p in pats)
    return is_frozen


SlicePaths = Callable[[str], Optional[list]]


def _frozen_slices(path: str, is_frozen, slice_paths: Optional[SlicePaths]) -> Optional[list]:
    """Per-slice frozen flags of a stacked leaf (None for a leaf outside a stack). A stacked leaf is
    judged by the per-layer names of its slices (`slice_paths`, e.g. glm5_jax.model.layer_slice_paths:
    "layer_<i>/attn/..."), so a pattern can freeze one layer of a stack."""
    names = slice_paths(path) if slice_paths is not None else None
    return None if names is None else [is_frozen(n) for n in names]


def partition_params(params, optimizer_name: str, *,
                     trainable: Optional[Callable[[str], bool]] = None,
                     frozen_patterns: Optional[Iterable[str]] = None,
                     slice_paths: Optional[SlicePaths] = None):
    """Pytree (same structure as ``params``) of label strings, one per leaf (see module doc).

    ``trainable(path) -> bool`` and/or ``frozen_patterns`` (regexes searched in the '/'-joined
    path) mark leaves 'frozen'. With ``slice_paths``, stacked leaves are judged per layer slice
    (see `slice_masks`): a leaf is 'frozen' when every slice is."""
    check_optimizer_name(optimizer_name)
    is_frozen = frozen_predicate(trainable, frozen_patterns)

    def label(path, leaf):
        p = path_to_str(path)
        flags = _frozen_slices(p, is_frozen, slice_paths)
        if (all(flags) if flags is not None else is_frozen(p)):
            return "frozen"
        return _base_label(p, len(getattr(leaf, "shape", ())), optimizer_name)

    return jax.tree_util.tree_map_with_path(label, params)


def slice_masks(params, *, trainable: Optional[Callable[[str], bool]] = None,
                frozen_patterns: Optional[Iterable[str]] = None, slice_paths: Optional[SlicePaths] = None):
    """Pytree of update multipliers: 1.0 for whole leaves, a float32 [repeats, 1, ...] array of 0/1
    for stacked leaves with some (not all) layer slices frozen; None when there is no such leaf."""
    is_frozen = frozen_predicate(trainable, frozen_patterns)
    found = False

    def mask(path, leaf):
        nonlocal found
        flags = _frozen_slices(path_to_str(path), is_frozen, slice_paths)
        if flags is None or all(flags) or not any(flags):
            return 1.0
        found = True
        shape = (len(flags),) + (1,) * (len(leaf.shape) - 1)
        return np.asarray([0.0 if f else 1.0 for f in flags], np.float32).reshape(shape)

    tree = jax.tree_util.tree_map_with_path(mask, params)
    return tree if found else None


def check_optimizer_name(name: str) -> None:
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZER_NAMES)}")


def describe_split(path: str, shape: tuple, label: str,
                   split_spec: Optional[MuonSplitSpec] = None) -> str:
    """Human-readable 'how split' text for the table."""
    if label not in ("muon", "muon_split"):
        return "-"
    lead, (m, n) = tuple(shape[:-2]), tuple(shape[-2:])
    parts = _name_parts(path)
    names = (["layers"] if _STACK.match(parts[0]) else []) + (["expert"] if "experts" in parts else [])
    names = ["batch"] * (len(lead) - len(names)) + names[-len(lead):] if lead else []
    batch_txt = "".join(f" x{k} ({what})" for k, what in zip(lead, names))
    if label == "muon":
        return f"[{m},{n}]{batch_txt}"
    if split_spec is None:
        return "per head" + batch_txt
    if is_q_b_proj(path):
        s = split_spec.q_split
        return f"per head {s.num_heads}x[{m},{s.head_dim}]{batch_txt}"
    s = split_spec.kv_split
    return (f"per head {s.num_heads}x(K[{m},{s.segments[0]}] + V[{m},{s.segments[1]}])"
            f"{batch_txt}")


def optimizer_table(params, labels, split_spec: Any = None) -> str:
    """The table printed at run start: path, shape, optimizer label, how split, plus totals."""
    spec = MuonSplitSpec.from_any(split_spec) if split_spec is not None else None
    flat_p = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_l = jax.tree_util.tree_leaves(labels)
    if len(flat_p) != len(flat_l):
        raise ValueError(f"labels have {len(flat_l)} leaves, params {len(flat_p)}")
    rows = []
    counts: dict[str, int] = {}
    for (path, leaf), lab in zip(flat_p, flat_l):
        p = path_to_str(path)
        shape = tuple(getattr(leaf, "shape", ()))
        rows.append((p, "[" + ",".join(map(str, shape)) + "]", lab,
                     describe_split(p, shape, lab, spec)))
        counts[lab] = counts.get(lab, 0) + math.prod(shape)
    header = ("path", "shape", "optimizer", "split")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    lines = [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r).rstrip() for r in rows]
    total = sum(counts.values())
    lines.append("")
    for lab in LABELS:
        if lab in counts:
            lines.append(f"{lab:<14} {counts[lab]:>14,d} params "
                         f"({100.0 * counts[lab] / max(total, 1):5.1f}%)")
    lines.append(f"{'total':<14} {total:>14,d} params, {len(rows)} leaves")
    return "\n".join(lines)
