"""Hugging Face interop: GLM-5 (`glm_moe_dsa`) safetensors checkpoints <-> this package's params.

Names map one path component at a time (`attn` -> `self_attn`, `kernel` -> `weight` transposed, ...).
Decoder layers live in scanned stacks (`config.layer_stacks`): `<stack>/layer_<j>/...` carries a leading
[repeats] axis whose slice r is HF layer `model.layers.<stack.layer_index(r, j)>`; loading stacks the
per-layer tensors, saving slices them. A stack's sub-layer j is always full or always shared
(indexer), so shared-indexer layers have no indexer parameters here and none in HF. Routed experts
are stored per expert (`mlp.experts.<e>.gate_proj.weight`) as the released checkpoint does; MTP
block k lives at `model.layers.<num_layers + k>.*` with DeepSeek-V3 names (`enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, and copies of `embed_tokens` / `shared_head.head`).
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterator

import jax
import numpy as np
from flax import traverse_util

from glm5_jax.config import ModelConfig
from glm5_jax.model import abstract_params

_RENAME = {"attn": "self_attn", "moe": "mlp", "router": "gate", "q_a_norm": "q_a_layernorm",
           "kv_a_norm": "kv_a_layernorm", "kv_a_proj": "kv_a_proj_with_mqa", "input_norm": "input_layernorm",
           "post_attn_norm": "post_attention_layernorm", "scale": "weight", "kernel": "weight",
           "embedding": "weight"}
_TOP = {"embed": "model.embed_tokens", "final_norm": "model.norm"}
_MTP = {"final_norm": "shared_head.norm"}
_INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, unexpected or has the wrong shape."""


def hf_entries(path: tuple[str, ...], shape: tuple[int, ...], config: ModelConfig) -> Iterator[tuple[str, tuple, bool, tuple]]:
    """(hf_key, hf_shape, transposed, index) for each HF tensor that makes up one of our parameters.

    `index` selects the tensor's slice of our leaf (`leaf[index]`): a stacked decoder leaf
    `<stack>/layer_<j>/...` [repeats, ...] yields one entry per repeat r (HF layer
    `stack.layer_index(r, j)`), routed experts [.., E, in, out] one per expert as well.
    """
    head, rest = path[0], list(path[1:])
    stacks = {s.name: s for s in config.layer_stacks}
    if head in stacks:
        stack, j = stacks[head], _sub_layer(path)
        for r in range(shape[0]):
            prefix = f"model.layers.{stack.layer_index(r, j)}"
            for key, hf_shape, transposed, index in _entries(prefix, path, rest[1:], shape[1:]):
                yield key, hf_shape, transposed, (r,) + index
        return
    if head in _TOP:
        prefix = _TOP[head]
    elif head == "lm_head":
        prefix = "lm_head"
    elif head.startswith("mtp_"):
        prefix = f"model.layers.{config.num_layers + int(head[4:])}"
        if rest[0] == "layer":
            rest = rest[1:]
        elif rest[0] in _MTP:
            prefix, rest = f"{prefix}.{_MTP[rest[0]]}", rest[1:]
    else:
        raise CheckpointError(f"no HF name for parameter {'/'.join(path)}; top-level names are "
                              f"{', '.join(sorted(set(_TOP) | set(stacks) | {'lm_head', 'mtp_<k>'}))}")
    yield from _entries(prefix, path, rest, shape)


def _sub_layer(path: tuple[str, ...]) -> int:
    if len(path) < 3 or not re.fullmatch(r"layer_\d+", path[1]):
        raise CheckpointError(f"no HF name for parameter {'/'.join(path)}: a stack's children are layer_<j>")
    return int(path[1][6:])


def _entries(prefix: str, path: tuple[str, ...], rest: list[str], shape: tuple[int, ...]):
    """Entries of one layer's (or top-level) parameter of per-layer `shape`; index into that shape."""
    transposed = path[-1] == "kernel"
    if _is_routed_expert(path):
        name = rest[-1]                                     # experts/gate_proj [E, in, out]
        base = ".".join(_RENAME.get(p, p) for p in rest[:-1])
        for e in range(shape[0]):
            yield f"{prefix}.{base}.{e}.{name}.weight", (shape[2], shape[1]), True, (e,)
        return
    key = ".".join([prefix] + [_RENAME.get(p, p) for p in rest])
    yield key, (tuple(reversed(shape)) if transposed else tuple(shape)), transposed, ()


def _is_routed_expert(p: tuple[str, ...]) -> bool:
    return "experts" in p and "shared_experts" not in p


def _mtp_extra_keys(config: ModelConfig, n_blocks: int) -> list[str]:
    return [f"model.layers.{config.num_layers + k}.{n}" for k in range(n_blocks)
            for n in ("embed_tokens.weight", "shared_head.head.weight")]


class _Reader:
    """Lazy reader over one safetensors file or a sharded set with an index."""

    def __init__(self, path: str):
        from safetensors import safe_open
        self._open = safe_open
        index = os.path.join(path, _INDEX_FILE)
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                self.where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.exists(single):
            with safe_open(single, framework="numpy") as f:
                self.where = {k: single for k in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or {_INDEX_FILE} in {path}")
        self._handles = {}

    def keys(self):
        return set(self.where)

    def get(self, key: str) -> np.ndarray:
        file = self.where[key]
        if file not in self._handles:
            self._handles[file] = self._open(file, framework="numpy")
        return self._handles[file].get_tensor(key)


def load_checkpoint(path: str | os.PathLike, **config_overrides) -> tuple[ModelConfig, dict]:
    """Read `config.json` + safetensors at `path` -> (ModelConfig, params as numpy arrays).

    Missing MTP tensors turn MTP off (mtp_depth=0) rather than failing, since HF models do not
    carry the MTP layer; every other missing, unexpected or misshapen tensor raises CheckpointError.
    """
    path = os.fspath(path)
    config = ModelConfig.from_hf(path, **config_overrides)
    reader = _Reader(path)
    if config.mtp_depth and f"model.layers.{config.num_layers}.eh_proj.weight" not in reader.keys():
        config = config.replace(mtp_depth=0)
    shapes = traverse_util.flatten_dict(abstract_params(config))
    params, used = {}, set()
    for p, leaf in shapes.items():
        leaf = leaf.unbox() if hasattr(leaf, "unbox") else leaf
        value = np.empty(tuple(leaf.shape), leaf.dtype)
        for key, hf_shape, transposed, index in hf_entries(p, tuple(leaf.shape), config):
            if key not in reader.where:
                raise CheckpointError(f"checkpoint {path} lacks tensor {key!r} (expected shape {list(hf_shape)})")
            arr = reader.get(key)
            if tuple(arr.shape) != hf_shape:
                raise CheckpointError(f"tensor {key!r} has shape {list(arr.shape)}; expected {list(hf_shape)}")
            used.add(key)
            value[index] = arr.T if transposed else arr
        params[p] = value
    n_mtp = (1 if config.mtp_share else config.mtp_depth) if config.mtp_depth else 0
    extra = reader.keys() - used - set(_mtp_extra_keys(config, n_mtp))
    extra = {k for k in extra if not k.endswith("rotary_emb.inv_freq")}
    if extra:
        raise CheckpointError(f"checkpoint {path} has {len(extra)} tensors this config does not use, "
                              f"e.g. {sorted(extra)[:5]}; check config.json")
    return config, traverse_util.unflatten_dict(params)


def save_checkpoint(config: ModelConfig, params, path: str | os.PathLike, *, max_shard_bytes: int | None = None) -> None:
    """Write `config.json` and safetensors (one file, or shards + index when max_shard_bytes is set)."""
    from safetensors.numpy import save_file
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    flat = traverse_util.flatten_dict(params)
    tensors: dict[str, np.ndarray] = {}
    for p, value in flat.items():
        value = np.asarray(jax.device_get(value))
        for key, _, transposed, index in hf_entries(p, value.shape, config):
            arr = value[index]
            tensors[key] = np.ascontiguousarray(arr.T if transposed else arr)
    n_mtp = (1 if config.mtp_share else config.mtp_depth) if config.mtp_depth else 0
    for k in range(n_mtp):                       # DeepSeek-V3-style copies inside the MTP layer
        base = f"model.layers.{config.num_layers + k}"
        tensors[f"{base}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        if "lm_head.weight" in tensors:
            tensors[f"{base}.shared_head.head.weight"] = tensors["lm_head.weight"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_hf(), f, indent=2)
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return
    shards, cur, size = [], {}, 0
    for k in sorted(tensors):
        if cur and size + tensors[k].nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = tensors[k]
        size += tensors[k].nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name))
        weight_map.update({k: name for k in shard})
    with open(os.path.join(path, _INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}, f, indent=2)
