"""Hugging Face interop: GLM-5 (`glm_moe_dsa`) safetensors checkpoints <-> this package's params.

Names map one path component at a time (`attn` -> `self_attn`, `kernel` -> `weight` transposed, ...).
Decoder layers live in scanned stacks (`config.layer_stacks`): `<stack>/layer_<j>/...` carries a leading
[repeats] axis whose slice r is HF layer `model.layers.<stack.layer_index(r, j)>`; loading stacks the
per-layer tensors, saving slices them. A stack's sub-layer j is always full or always shared
(indexer), so shared-indexer layers have no indexer parameters here and none in HF. Routed experts
are stored per expert (`mlp.experts.<e>.gate_proj.weight`) as the released checkpoint does; MTP
block k lives at `model.layers.<num_layers + k>.*` with DeepSeek-V3 names (`enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, and copies of `embed_tokens` / `shared_head.head`).

Loading streams (docs/checkpoints.md): safetensors files are read with plain positioned reads (no mmap,
whose touched pages would stay resident), tensor by tensor and, on a mesh, shard by shard: every leaf is
a `jax.make_array_from_callback` whose callback reads only the HF tensors (and only their rows) that
land in one device's shard, so the host never holds more than one tensor's worth beyond the result.
FP8 tensors (float8_e4m3fn with `<name>_scale_inv` block scales, the DeepSeek-V3 / GLM-5-FP8 layout)
are dequantised as they are read. Saving writes one HF tensor at a time through the same naming.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterator

import jax
import ml_dtypes
import numpy as np
from flax import traverse_util

from glm5_jax.config import ModelConfig
from glm5_jax.errors import Glm5Error
from glm5_jax.model import abstract_params

_RENAME = {"attn": "self_attn", "moe": "mlp", "router": "gate", "q_a_norm": "q_a_layernorm",
           "kv_a_norm": "kv_a_layernorm", "kv_a_proj": "kv_a_proj_with_mqa", "input_norm": "input_layernorm",
           "post_attn_norm": "post_attention_layernorm", "scale": "weight", "kernel": "weight",
           "embedding": "weight"}
_TOP = {"embed": "model.embed_tokens", "final_norm": "model.norm"}
_MTP = {"final_norm": "shared_head.norm"}
_INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names <-> numpy (ml_dtypes for bfloat16 / float8, which numpy lacks)
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_FP8 = {np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)}
_READ_CHUNK = 64 << 20          # bytes read at once when only some columns of a tensor are wanted


class CheckpointError(Glm5Error):
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


def _norm_index(index, shape) -> tuple[slice, ...]:
    """Concrete unit-step slices, one per dim (jax callbacks pass slice(None) for whole dims)."""
    index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
    out = []
    for s, d in zip(index, shape):
        start, stop, step = s.indices(d)
        if step != 1:
            raise CheckpointError(f"strided reads are not supported (index {index}, shape {shape})")
        out.append(slice(start, stop))
    return tuple(out)


class _File:
    """One safetensors file read with positioned reads: header (8-byte length + JSON) then raw
    little-endian C-order data. Reads take a row range (leading dim) in one go, or row chunks of at
    most _READ_CHUNK bytes when only some columns are wanted, so a shard costs its size plus a chunk."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "rb")
        n = int.from_bytes(self._f.read(8), "little")
        header = json.loads(self._f.read(n))
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.meta = {}
        for key, m in header.items():
            if m["dtype"] not in _ST_DTYPES:
                raise CheckpointError(f"tensor {key!r} in {path} has dtype {m['dtype']}; supported: {', '.join(_ST_DTYPES)}")
            self.meta[key] = (np.dtype(_ST_DTYPES[m["dtype"]]), tuple(m["shape"]), m["data_offsets"][0])

    def _rows(self, key: str, a: int, b: int) -> np.ndarray:
        dtype, shape, begin = self.meta[key]
        row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self._f.seek(self.base + begin + a * row)
        raw = np.fromfile(self._f, np.uint8, (b - a) * row)
        if raw.size != (b - a) * row:
            raise CheckpointError(f"{self.path} is truncated: tensor {key!r} rows {a}:{b} are missing")
        return raw.view(dtype).reshape((b - a,) + shape[1:])

    def read(self, key: str, index=None) -> np.ndarray:
        dtype, shape, _ = self.meta[key]
        if not shape:
            return self._rows(key, 0, 1).reshape(())
        index = _norm_index(index, shape)
        r, rest = index[0], index[1:]
        if all(s == slice(0, d) for s, d in zip(rest, shape[1:])):
            return self._rows(key, r.start, r.stop)
        out = np.empty((r.stop - r.start,) + tuple(s.stop - s.start for s in rest), dtype)
        row = max(int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize, 1)
        step = max(1, _READ_CHUNK // row)
        for a in range(r.start, r.stop, step):
            b = min(r.stop, a + step)
            out[a - r.start:b - r.start] = self._rows(key, a, b)[(slice(None),) + rest]
        return out

    def close(self) -> None:
        self._f.close()


class _Reader:
    """The tensors of one safetensors file or of a sharded set with an index; FP8 weights come back
    dequantised (float32) with their `_scale_inv` block scales."""

    def __init__(self, path: str, block: tuple[int, int] = (128, 128)):
        index = os.path.join(path, _INDEX_FILE)
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
            files = [os.path.join(path, n) for n in names]
        elif os.path.exists(single):
            files = [single]
        else:
            raise FileNotFoundError(f"no model.safetensors or {_INDEX_FILE} in {path}")
        self.block = tuple(block)
        self.files = [_File(f) for f in files]
        # the headers (not the index) say where each tensor is: a stale index cannot misdirect a read
        self.where = {k: f for f in self.files for k in f.meta}

    def keys(self) -> set[str]:
        return set(self.where)

    def shape(self, key: str) -> tuple:
        return self.where[key].meta[key][1]

    def is_fp8(self, key: str) -> bool:
        return self.where[key].meta[key][0] in _FP8

    def scale_key(self, key: str) -> str:
        return key + "_scale_inv"

    def read(self, key: str, index=None) -> np.ndarray:
        f = self.where[key]
        if not self.is_fp8(key):
            return f.read(key, index)
        shape = self.shape(key)
        if len(shape) != 2:
            raise CheckpointError(f"FP8 tensor {key!r} has shape {list(shape)}; only 2-D weights carry block scales")
        sk = self.scale_key(key)
        if sk not in self.where:
            raise CheckpointError(f"FP8 tensor {key!r} has no block scales {sk!r}")
        (r, c), (bo, bi) = _norm_index(index, shape), self.block
        want = (-(-shape[0] // bo), -(-shape[1] // bi))
        if self.shape(sk) != want:
            raise CheckpointError(f"block scales {sk!r} have shape {list(self.shape(sk))}; expected {list(want)} "
                                  f"for {list(shape)} in {bo}x{bi} blocks (quantization_config.weight_block_size)")
        q = f.read(key, (r, c)).astype(np.float32)
        r0 = r.start // bo
        s = self.where[sk].read(sk, (slice(r0, -(-r.stop // bo)), slice(None))).astype(np.float32)
        s = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)
        return q * s[r.start - r0 * bo:r.stop - r0 * bo, c.start:c.stop]

    def close(self) -> None:
        for f in self.files:
            f.close()


def read_hf_config(path: str | os.PathLike) -> dict:
    """config.json at `path` (a folder or the file) with `indexer_types` filled in the way HF's
    GlmMoeDsaConfig derives it: from `index_topk_pattern` ("FSSF..." or a list), else from
    `index_topk_freq` / `index_skip_topk_offset` (layer i is full iff max(i - offset + 1, 0) % freq == 0;
    no fields = every layer full)."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"no HF config at {file}")
    with open(file) as f:
        raw = json.load(f)
    if raw.get("indexer_types") is None and raw.get("glm5_jax_attention", "dsa") == "dsa":
        n = raw["num_hidden_layers"]
        pattern = raw.get("index_topk_pattern")
        if pattern is not None:
            names = {"F": "full", "S": "shared"}
            if isinstance(pattern, str) and set(pattern) - set(names):
                raise CheckpointError(f"config.json index_topk_pattern={pattern!r}: letters must be F (full) or S (shared)")
            types = [names[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
            if len(types) != n:
                raise CheckpointError(f"config.json index_topk_pattern has {len(types)} entries; "
                                      f"num_hidden_layers={n} needs one per layer")
        else:
            freq = max(int(raw.get("index_topk_freq", 1)), 1)
            offset = int(raw.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
        raw["indexer_types"] = types
    return raw


def checkpoint_dtype(raw: dict) -> str:
    """The parameter dtype the checkpoint declares (`torch_dtype`, or `dtype` in newer transformers);
    float32 when it declares none."""
    d = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    return str(d).replace("torch.", "")


def _block_size(raw: dict) -> tuple[int, int]:
    q = raw.get("quantization_config") or {}
    return tuple(q.get("weight_block_size") or (128, 128))


def _plan(reader: _Reader, config: ModelConfig, path: str):
    """{leaf path: (abstract leaf, [(hf_key, hf_shape, transposed, index)])}, every key checked to
    exist with its shape; raises CheckpointError on a missing, misshapen or unused tensor."""
    shapes = traverse_util.flatten_dict(abstract_params(config))
    plan, used = {}, set()
    for p, leaf in shapes.items():
        leaf = leaf.unbox() if hasattr(leaf, "unbox") else leaf
        entries = list(hf_entries(p, tuple(leaf.shape), config))
        for key, hf_shape, _, _ in entries:
            if key not in reader.where:
                raise CheckpointError(f"checkpoint {path} lacks tensor {key!r} (expected shape {list(hf_shape)})")
            if reader.shape(key) != hf_shape:
                raise CheckpointError(f"tensor {key!r} has shape {list(reader.shape(key))}; expected {list(hf_shape)}")
            used.add(key)
            if reader.is_fp8(key):
                used.add(reader.scale_key(key))
        plan[p] = (leaf, entries)
    n_mtp = (1 if config.mtp_share else config.mtp_depth) if config.mtp_depth else 0
    extra = reader.keys() - used - set(_mtp_extra_keys(config, n_mtp))
    extra = {k for k in extra if not k.endswith("rotary_emb.inv_freq")}
    if extra:
        raise CheckpointError(f"checkpoint {path} has {len(extra)} tensors this config does not use, "
                              f"e.g. {sorted(extra)[:5]}; check config.json")
    return plan


def _read_leaf(reader: _Reader, entries, shape, dtype, index=None) -> np.ndarray:
    """`leaf[index]` assembled from the HF tensors that fall inside it, each read only over the part
    `index` selects (its transpose for kernels), cast to `dtype` as it is copied in."""
    index = _norm_index(index, shape)
    out = np.empty(tuple(s.stop - s.start for s in index), dtype)
    for key, _, transposed, pre in entries:
        if not all(s.start <= i < s.stop for i, s in zip(pre, index)):
            continue
        rest = index[len(pre):]
        arr = reader.read(key, tuple(reversed(rest)) if transposed else rest)
        out[tuple(i - s.start for i, s in zip(pre, index))] = arr.T if transposed else arr
    return out


class _bytes_bar:
    """Progress over tensors: bytes done / total, rate and ETA, and tensors done, on stderr (glm5_jax.progress)."""

    def __init__(self, what: str, shapes, unit: str, quiet: bool):
        from glm5_jax.progress import bar
        self.n, self.total, self.unit = 0, len(shapes), unit
        self.bar = bar(sum(_nbytes(s, d) for s, d in shapes), desc=what, unit="B", unit_scale=True, quiet=quiet)

    def step(self, shape, dtype) -> None:
        self.n += 1
        self.bar.set_postfix_str(f"{self.n}/{self.total} {self.unit}", refresh=False)
        self.bar.update(_nbytes(shape, dtype))

    def close(self) -> None:
        self.bar.close()


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def read_params(path: str | os.PathLike, config: ModelConfig, mesh=None, rules=None, progress: bool = False):
    """The params of `config` from the safetensors at `path`: host numpy arrays (mesh None) or jax
    arrays laid out on `mesh` by logical sharding rules (glm5_jax.sharding.param_shardings; `rules`
    default LOGICAL_RULES, the training layout; SERVE_RULES for serving), each device's shard read
    straight from the files. Leaves take the dtypes of abstract_params(config)
    (config.param_dtype); FP8 tensors are dequantised on the way. progress: bytes and arrays done, rate and
    ETA on stderr."""
    path = os.fspath(path)
    reader = _Reader(path, _block_size(read_hf_config(path)))
    try:
        plan = _plan(reader, config, path)
        bar = _bytes_bar("reading", [(tuple(leaf.shape), leaf.dtype) for leaf, _ in plan.values()], "arrays",
                         quiet=not progress)
        if mesh is None:
            params = {}
            for p, (leaf, entries) in plan.items():
                params[p] = _read_leaf(reader, entries, tuple(leaf.shape), leaf.dtype)
                bar.step(tuple(leaf.shape), leaf.dtype)
        else:
            from glm5_jax.sharding import LOGICAL_RULES, param_shardings
            shardings = traverse_util.flatten_dict(param_shardings(config, mesh, rules or LOGICAL_RULES))
            params = {}
            for p, (leaf, entries) in plan.items():
                shape, dtype = tuple(leaf.shape), leaf.dtype
                params[p] = jax.make_array_from_callback(
                    shape, shardings[p], lambda idx, e=entries, s=shape, d=dtype: _read_leaf(reader, e, s, d, idx))
                bar.step(shape, dtype)
        bar.close()
    finally:
        reader.close()
    return traverse_util.unflatten_dict(params)


def checkpoint_config(path: str | os.PathLike, dtype: str | None = None, **config_overrides) -> ModelConfig:
    """The ModelConfig load_checkpoint returns for `path`, without reading any tensor (see there)."""
    path = os.fspath(path)
    raw = read_hf_config(path)
    config_overrides.setdefault("param_dtype", dtype or checkpoint_dtype(raw))
    config = ModelConfig.from_hf(raw, **config_overrides)
    config.validate()
    if config.mtp_depth:
        reader = _Reader(path)
        has_mtp = f"model.layers.{config.num_layers}.eh_proj.weight" in reader.keys()
        reader.close()
        if not has_mtp:
            config = config.replace(mtp_depth=0)
    return config


def load_checkpoint(path: str | os.PathLike, mesh=None, dtype: str | None = None, rules=None, progress: bool = False,
                    **config_overrides) -> tuple[ModelConfig, dict]:
    """Read `config.json` + safetensors at `path` -> (ModelConfig, params).

    mesh: None -> host numpy arrays; a jax Mesh -> arrays sharded by the logical rules (`rules`: default
    the training layout, glm5_jax.sharding.SERVE_RULES for serving), streamed shard by shard (read_params).
    dtype: the parameters' dtype (float32 | bfloat16 | float16); default the checkpoint's `torch_dtype` (float32 if
    it names none), so a bfloat16 checkpoint stays bfloat16. It becomes the returned config's param_dtype unless
    `param_dtype` is among the overrides.
    Missing MTP tensors turn MTP off (mtp_depth=0) rather than failing, since HF models do not
    carry the MTP layer; every other missing, unexpected or misshapen tensor raises CheckpointError.
    """
    config = checkpoint_config(path, dtype, **config_overrides)
    return config, read_params(path, config, mesh, rules, progress=progress)


def _host_slicer(value):
    """index -> numpy `value[index]`; a jax array is sliced on device (one compile per leaf: the index
    is a traced argument) so only that slice is copied to the host."""
    if not isinstance(value, jax.Array):
        value = np.asarray(value)
        return lambda index: np.asarray(value[index])
    take = jax.jit(lambda x, i: x[tuple(i[k] for k in range(i.shape[0]))])
    return lambda index: np.asarray(take(value, np.asarray(index, np.int32))) if index else np.asarray(value)


def _write_safetensors(file: str, items: list[tuple[str, tuple, np.dtype, object]], bar=None) -> None:
    """Write (key, shape, dtype, produce) tensors to `file`, calling each produce() only when its bytes
    are written, so one tensor at a time is in memory."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, shape, dtype, _ in items:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[key] = {"dtype": _ST_NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                 # the format pads the header to 8 bytes
    with open(file, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for key, shape, dtype, produce in items:
            arr = np.ascontiguousarray(produce(), dtype=dtype)
            if arr.shape != tuple(shape):
                raise CheckpointError(f"tensor {key!r} came out with shape {arr.shape}; expected {shape}")
            f.write(arr.tobytes())
            if bar is not None:
                bar.step(shape, dtype)


_EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_FLOATS = {np.dtype(v) for v in _EXPORT_DTYPES.values()} | {np.dtype(np.float64)}


def export_dtype(config: ModelConfig, dtype: str | None = "auto") -> str | None:
    """The dtype save_checkpoint writes: 'auto' = the compute dtype (config.dtype) when the params are
    float32 master weights computed in a narrower dtype (param_dtype float32, dtype bfloat16 / float16: the
    mixed-precision training setting), else None (each leaf as stored); or an explicit float32 | bfloat16 |
    float16."""
    if dtype == "auto":
        return config.dtype if config.param_dtype == "float32" and config.dtype != "float32" else None
    if dtype is not None and dtype not in _EXPORT_DTYPES:
        raise ValueError(f"save_checkpoint dtype={dtype!r}; allowed: auto, None, {', '.join(_EXPORT_DTYPES)}")
    return dtype


def save_checkpoint(config: ModelConfig, params, path: str | os.PathLike, *, max_shard_bytes: int | None = None,
                    dtype: str | None = "auto", progress: bool = False) -> None:
    """Write `config.json` and safetensors (one file, or shards + index when max_shard_bytes is set),
    one HF tensor at a time: params may be host arrays or (sharded) jax arrays. `dtype` (export_dtype):
    float32 masters of a bf16-compute run are written in bf16 (rounded to nearest even) by default, and
    config.json's torch_dtype names what was written. progress: bytes and tensors written, rate and ETA on
    stderr."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    out_dtype = export_dtype(config, dtype)
    if out_dtype is not None:
        config = config.replace(param_dtype=out_dtype)     # torch_dtype in config.json
    flat = traverse_util.flatten_dict(params)
    items: dict[str, tuple] = {}
    for p, value in flat.items():
        take = _host_slicer(value)
        leaf_dtype = np.dtype(value.dtype)
        if out_dtype is not None and leaf_dtype in _FLOATS:
            cast = np.dtype(_EXPORT_DTYPES[out_dtype])
            take = (lambda t, c: lambda i: t(i).astype(c))(take, cast)
            leaf_dtype = cast
        for key, hf_shape, transposed, index in hf_entries(p, tuple(value.shape), config):
            produce = (lambda t=take, i=index: t(i).T) if transposed else (lambda t=take, i=index: t(i))
            items[key] = (key, hf_shape, leaf_dtype, produce)
    n_mtp = (1 if config.mtp_share else config.mtp_depth) if config.mtp_depth else 0
    for k in range(n_mtp):                       # DeepSeek-V3-style copies inside the MTP layer
        base = f"model.layers.{config.num_layers + k}"
        items[f"{base}.embed_tokens.weight"] = (f"{base}.embed_tokens.weight",) + items["model.embed_tokens.weight"][1:]
        if "lm_head.weight" in items:
            items[f"{base}.shared_head.head.weight"] = (f"{base}.shared_head.head.weight",) + items["lm_head.weight"][1:]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_hf(), f, indent=2)
    nbytes = lambda it: _nbytes(it[1], it[2])
    bar = _bytes_bar("writing", [(it[1], it[2]) for it in items.values()], "tensors", quiet=not progress)
    if max_shard_bytes is None:
        _write_safetensors(os.path.join(path, "model.safetensors"), [items[k] for k in sorted(items)], bar)
        bar.close()
        return
    shards, cur, size = [], [], 0
    for k in sorted(items):
        if cur and size + nbytes(items[k]) > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(items[k])
        size += nbytes(items[k])
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(os.path.join(path, name), shard, bar)
        weight_map.update({it[0]: name for it in shard})
    bar.close()
    with open(os.path.join(path, _INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": sum(nbytes(it) for it in items.values())}, "weight_map": weight_map},
                  f, indent=2)
