"""Weight-only INT4 quantisation: QAT fake quantisation, post-training quantisation and the packed export.

One quantiser serves training and export, so the QAT forward and the dequantised export are the same
numbers (bit for bit):

* ``quantize(w, cfg) -> (codes, scales)``: group-wise symmetric quantisation along the *input* axis
  (axis -2 of every matrix here: dense kernels are [..., in, out], expert stacks [..., E, in, out]).
  Each run of ``group_size`` consecutive input rows of one output column shares one float32 scale
  ``max|w| / qmax`` (qmax = 2**(bits-1) - 1 = 7 for int4); codes are integers in [-qmax, qmax].
* ``dequantize(codes, scales)``: ``codes * scale`` in float32, cast to the weight dtype.
* ``fake_quant_ste(w, cfg)``: ``dequantize(quantize(w))`` in the forward, identity gradient
  (straight-through estimator). Written ``q + (w - stop_gradient(w))`` rather than the textbook
  ``w + stop_gradient(q - w)``: ``w - w`` is exactly 0, so the forward value is exactly ``q``, while
  ``w + (q - w)`` is q only up to one rounding, which would break bit-identity with the export.
* ``qat_params(params, cfg)``: the transform applied to the parameter tree before ``model.apply``:
  leaves whose path matches ``cfg.pattern`` (default: the routed and shared experts, the matrices
  GLM-5 ships in int4) are fake-quantised, everything else passes through. PTQ is the same function
  applied once to trained weights (no gradient involved).
* ``export_int4(params, cfg)`` -> {path: {"packed" uint8 [..., in*out/2] (two codes per byte, low
  nibble first, code + 8 so the nibble is unsigned), "scales" float32 [..., in/group, out], "shape",
  "dtype"}}; ``load_int4(params, export)`` puts the dequantised weights back into a parameter tree.

Why symmetric: weights are (nearly) zero-centred, a zero point per group doubles the metadata and
adds a subtraction to every dequantisation, and the int4 GEMM kernels GLM-5-style deployments use
(W4A16, weight-only) are symmetric; the code -8 is left unused so that +w and -w quantise alike.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.optim import path_to_str

__all__ = ["QuantConfig", "EXPERTS", "ALL_LINEAR", "quantize", "dequantize", "fake_quant", "fake_quant_ste", "qat_params",
           "ptq_params", "quantized_paths", "export_int4", "load_int4", "pack_int4", "unpack_int4"]

EXPERTS = r"moe/(experts|shared_experts)/"        # GLM-5 quantises the MoE experts
# every linear layer's matrix except the router and the DSA indexer (small, precision-sensitive, and
# kept in high precision by the usual weight-only recipes); the embedding is a lookup, never selected
ALL_LINEAR = r"^(?!.*(router|indexer)).*(kernel|experts/\w+)$"


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    bits: int = 4
    group_size: int = 32              # input rows per scale; 0 = one scale per output column (whole input)
    pattern: str = EXPERTS            # regex on the leaf path ("moe_layers/layer_0/moe/experts/up_proj")

    def __post_init__(self):
        if not 2 <= self.bits <= 8:
            raise ValueError(f"QuantConfig.bits={self.bits!r} is invalid: must be in 2..8 (export packs bits=4 only)")
        if self.group_size < 0:
            raise ValueError(f"QuantConfig.group_size={self.group_size!r} is invalid: must be >= 0 "
                             "(0 = one group over the whole input dimension)")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"QuantConfig.pattern={self.pattern!r} is not a valid regex: {e}") from None

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1


def _groups(w, cfg: QuantConfig, name: str = "weight"):
    """[..., in, out] -> [..., in/g, g, out] (g = group size)."""
    if w.ndim < 2:
        raise ValueError(f"{name}: only matrices are quantised, got shape {w.shape}")
    n_in = w.shape[-2]
    g = cfg.group_size or n_in
    if n_in % g:
        raise ValueError(f"{name}: QuantConfig.group_size={cfg.group_size} does not divide the input dimension "
                         f"{n_in} (shape {w.shape}); choose a divisor of {n_in} or 0 for one group")
    return w.reshape(*w.shape[:-2], n_in // g, g, w.shape[-1])


def quantize(w, cfg: QuantConfig, name: str = "weight"):
    """w [..., in, out] -> (codes int8 [..., in, out] in [-qmax, qmax], scales float32 [..., in/g, out])."""
    wg = _groups(jnp.asarray(w), cfg, name).astype(jnp.float32)
    amax = jnp.max(jnp.abs(wg), axis=-2, keepdims=True)
    scale = jnp.where(amax > 0, amax / cfg.qmax, 1.0)
    codes = jnp.clip(jnp.round(wg / scale), -cfg.qmax, cfg.qmax).astype(jnp.int8)
    return codes.reshape(w.shape), scale[..., 0, :]


def dequantize(codes, scales, dtype=jnp.float32):
    """codes [..., in, out], scales [..., in/g, out] -> weights [..., in, out] (``dtype``)."""
    n_in, n_groups = codes.shape[-2], scales.shape[-2]
    cg = codes.reshape(*codes.shape[:-2], n_groups, n_in // n_groups, codes.shape[-1]).astype(jnp.float32)
    return (cg * scales[..., None, :]).reshape(codes.shape).astype(dtype)


def fake_quant(w, cfg: QuantConfig, name: str = "weight"):
    """dequantize(quantize(w)): the weight the int4 model actually uses (no gradient through round)."""
    return dequantize(*quantize(w, cfg, name), dtype=w.dtype)


def fake_quant_ste(w, cfg: QuantConfig, name: str = "weight"):
    """fake_quant in the forward, identity gradient (see the module doc for why this form)."""
    q = jax.lax.stop_gradient(fake_quant(w, cfg, name))
    return q + (w - jax.lax.stop_gradient(w))


def _selected(path_str: str, x, cfg: QuantConfig) -> bool:
    return (re.search(cfg.pattern, path_str) is not None and getattr(x, "ndim", 0) >= 2
            and jnp.issubdtype(x.dtype, jnp.floating))


def quantized_paths(params, cfg: QuantConfig) -> list:
    """The leaf paths ``cfg.pattern`` selects (matrices only); an empty list is an error in qat_params."""
    return [path_to_str(p) for p, x in jax.tree_util.tree_leaves_with_path(params) if _selected(path_to_str(p), x, cfg)]


def _map_selected(fn, params, cfg: QuantConfig):
    if not quantized_paths(params, cfg):
        raise ValueError(f"QuantConfig.pattern={cfg.pattern!r} selects no matrix of the parameter tree")

    def f(path, x):
        s = path_to_str(path)
        return fn(x, cfg, s) if _selected(s, x, cfg) else x
    return jax.tree_util.tree_map_with_path(f, params)


def qat_params(params, cfg: QuantConfig):
    """The parameter tree the QAT forward uses: selected matrices fake-quantised, straight-through grads."""
    return _map_selected(fake_quant_ste, params, cfg)


def ptq_params(params, cfg: QuantConfig):
    """Post-training quantisation: the same quantiser applied once (the weights an int4 export holds)."""
    return _map_selected(fake_quant, params, cfg)


def pack_int4(codes) -> np.ndarray:
    """codes [..., in, out] in [-8, 7] -> uint8 [..., in*out/2]: each matrix flattened row-major, then
    byte = (c0 + 8) | (c1 + 8) << 4 for consecutive codes (low nibble first)."""
    c = np.asarray(codes, np.int16)
    if c.min(initial=0) < -8 or c.max(initial=0) > 7:
        raise ValueError("int4 codes must lie in [-8, 7]")
    flat = (c + 8).astype(np.uint8).reshape(*c.shape[:-2], -1)
    if flat.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of elements per matrix, got shape {c.shape}")
    return flat[..., 0::2] | (flat[..., 1::2] << 4)


def unpack_int4(packed, shape) -> np.ndarray:
    """Inverse of pack_int4: uint8 [..., n/2] -> int8 codes of ``shape``."""
    p = np.asarray(packed, np.uint8)
    out = np.empty((*p.shape[:-1], p.shape[-1] * 2), np.int8)
    out[..., 0::2] = (p & 0x0F).astype(np.int8) - 8
    out[..., 1::2] = (p >> 4).astype(np.int8) - 8
    return out.reshape(shape)


def export_int4(params, cfg: QuantConfig) -> Dict[str, dict]:
    """The int4 weights (packed two per byte) and float32 scales of every selected matrix (numpy)."""
    if cfg.bits != 4:
        raise ValueError(f"export_int4 packs 4-bit codes; QuantConfig.bits={cfg.bits}")
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        s = path_to_str(path)
        if _selected(s, x, cfg):
            codes, scales = quantize(x, cfg, s)
            out[s] = {"packed": pack_int4(jax.device_get(codes)), "scales": np.asarray(jax.device_get(scales)),
                      "shape": tuple(x.shape), "dtype": str(x.dtype)}
    if not out:
        raise ValueError(f"QuantConfig.pattern={cfg.pattern!r} selects no matrix of the parameter tree")
    return out


def load_int4(params, export: Dict[str, dict]):
    """``params`` with every exported matrix replaced by its dequantised int4 weights."""
    missing = set(export) - {path_to_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    if missing:
        raise ValueError(f"export holds paths the parameter tree lacks: {sorted(missing)}")

    def f(path, x):
        e = export.get(path_to_str(path))
        if e is None:
            return x
        if tuple(e["shape"]) != tuple(x.shape):
            raise ValueError(f"{path_to_str(path)}: export shape {e['shape']} != parameter shape {x.shape}")
        codes = jnp.asarray(unpack_int4(e["packed"], e["shape"]))
        return dequantize(codes, jnp.asarray(e["scales"]), dtype=x.dtype)
    return jax.tree_util.tree_map_with_path(f, params)
