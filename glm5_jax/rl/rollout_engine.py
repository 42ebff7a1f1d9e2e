"""The RL rollout engine: batch sampling in the serving layout on a mesh, weights synced device to device.

Colocated RL (docs/rl.md, "RL on a mesh"): the training state and the rollouts share the devices. Before
each rollout ``sync(params, version)`` makes the rollout copy of the policy in the serving engine's
layout (``glm5_jax.infer.programs.Programs``: ``SERVE_RULES`` weights, the MoE's dropless all-to-all over
``expert``) straight from the training layout, device to device: one jitted program whose input is the
training arrays and whose output sharding is the serving one, so XLA moves the shards between devices
(an all-gather where the training layout splits what serving replicates) and nothing goes through the
host. The mismatch mode's fake quantisation (``rollout.rollout_params``: int8 ... int2, bf16) runs inside
that same program, on the mesh, so the quantised copy is only ever the sharded serving copy.

``generate`` runs the one generation runtime (``glm5_jax.infer.runtime.PagedRuntime``, driven by
``glm5_jax.infer.generation.run_batch``, as ``infer.generate`` is) on this mesh with the synced rollout copy:
the page pool split over the batch axes (data x fsdp x expert), attention data-parallel, the weights in the
serving layout. Row b of a batch samples its i-th token as row b of one draw over the batch with the key
fold_in(PRNGKey(seed), i) (``Seq.key_row``), ``infer.generate``'s scheme, so on one device the tokens and
log-probs equal ``infer.generate``'s bit for bit, and on any mesh they equal them up to float reduction
order. One runtime per batch shape (``generation.batch_runtime_args``) is kept, so its compiled steps serve
every RL step; ``release()`` drops the rollout copy and the runtimes' page pools after the rollouts, so the
update runs with the training state alone on the devices (no cache, no second copy); the next
``generate`` allocates the pool again.

Chunked (``reshard_chunk_bytes``, per device): the sync is a sequence of programs, each making at most that
many bytes of every device's serving shards (``sync_plan``): whole leaves grouped in tree order, and a
leaf larger than the bound that is a stack over a leading axis (a scanned layer stack [L, ...], ndim >= 3)
cut along that axis into slices of whole layers written in place into its serving buffer (donated to each
slice's program), so the gathers and the quantisation's scratch of one program cover one chunk, never the
whole policy (at glm5 size the one-program sync held 14 GiB of temporaries beside the copy). Every
mismatch mode treats each index of a >= 3-D leaf's leading axis on its own (scales reduce over the
matrix's input axis only), so a sliced leaf's copy is bit for bit the whole leaf's. A policy within one
chunk (every CPU run) runs the one-program sync as before.

Each sync reports the bytes it moves between devices (``reshard_bytes``: per device, the bytes of its
serving shards that it did not already hold in the training layout; the host moves none) and the
per-device memory of the rollout phase (``memory``).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm5_jax.batch import BATCH_AXES
from glm5_jax.infer import sampling
from glm5_jax.infer.decode import PREFILL_CHUNK, GenerateResult, prefill_chunks, prepare_prompts, resolve_max_len
from glm5_jax.infer.generation import batch_runtime_args, run_batch
from glm5_jax.infer.runtime import PagedRuntime
from glm5_jax.sharding import (
    SERVE_RULES,
    check_serving_mesh,
    single_device_mesh,
    use_mesh,
)

__all__ = ["RESHARD_CHUNK_BYTES", "RolloutEngine", "bytes_per_device", "reshard_bytes", "sync_plan"]

# the default bound on one sync program's output per device: the transient of a chunk (its gathered
# inputs, the quantiser's scratch) is a few times this, small beside a glm5 chip's 47 GiB rollout copy
RESHARD_CHUNK_BYTES = 1 << 30


def _slice_bounds(idx, shape):
    return [(s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(idx, shape)]


def _overlap(a, b) -> int:
    return math.prod(max(0, min(a1, b1) - max(a0, b0)) for (a0, a1), (b0, b1) in zip(a, b))


def reshard_bytes(src_tree, dst_shardings) -> dict:
    """Bytes each device must receive to hold ``src_tree`` (jax Arrays or sharded ShapeDtypeStructs) laid out by ``dst_shardings``:
    for every leaf and device, the bytes of its target shard minus those it already holds in the source
    layout. -> {device id: bytes} (0 where a device already holds its whole target shard)."""
    out: dict = {}
    for a, sh in zip(jax.tree.leaves(src_tree), jax.tree.leaves(dst_shardings)):
        shape, item = np.shape(a), np.dtype(a.dtype).itemsize
        src = getattr(a, "sharding", None)      # a jax Array, or a ShapeDtypeStruct carrying one (tools.aot)
        have = ({d.id: _slice_bounds(i, shape) for d, i in src.devices_indices_map(shape).items()}
                if src is not None else {})              # a host array: every device receives its shard
        for d, idx in sh.devices_indices_map(shape).items():
            want = _slice_bounds(idx, shape)
            need = math.prod(hi - lo for lo, hi in want)
            held = _overlap(want, have[d.id]) if d.id in have else 0
            out[d.id] = out.get(d.id, 0) + (need - held) * item
    return out


def _device_bytes(leaf, sharding) -> int:
    """Bytes of ``leaf``'s largest shard under ``sharding`` (what one device holds)."""
    return math.prod(sharding.shard_shape(tuple(leaf.shape))) * np.dtype(leaf.dtype).itemsize


def sync_plan(leaves, shardings, chunk_bytes: int) -> list:
    """The sync's programs for ``leaves`` (arrays or ShapeDtypeStructs) placed by ``shardings`` (the serving
    ones), each making at most ``chunk_bytes`` of every device's shards where a leaf allows it: a list of
    chunks, a chunk either ("leaves", [leaf indices]) (whole leaves in tree order, greedily grouped) or
    ("rows", index, rows) (a leaf larger than the bound, ndim >= 3, leading axis unsharded in serving: cut
    into slices of ``rows`` indices of that axis, the largest divisor of its length that fits, so one program
    serves every slice). A 2-D leaf or one whose leading axis is split is never cut (2-D: the int modes
    reduce a matrix over its rows), so a chunk exceeds the bound only by one such leaf."""
    plan, group, size = [], [], 0
    for i, (a, sh) in enumerate(zip(leaves, shardings)):
        b = _device_bytes(a, sh)
        n = a.shape[0] if len(a.shape) >= 3 else 0
        if b > chunk_bytes and n > 1 and sh.spec[:1] in ((), (None,)):
            rows = max(r for r in range(1, n + 1) if n % r == 0 and b // n * r <= max(chunk_bytes, b // n))
            if rows < n:
                plan.append(("rows", i, rows))
                continue
        if group and size + b > chunk_bytes:
            plan.append(("leaves", group))
            group, size = [], 0
        group, size = group + [i], size + b
    if group:
        plan.append(("leaves", group))
    return plan


def bytes_per_device(tree) -> dict:
    """{device id: bytes} of the shards of every jax Array in ``tree`` held by each device."""
    out: dict = {}
    for a in jax.tree.leaves(tree):
        for s in a.addressable_shards:
            out[s.device.id] = out.get(s.device.id, 0) + int(s.data.size) * a.dtype.itemsize
    return out


class RolloutEngine:
    """Batch rollouts of ``config`` on ``mesh`` (None: one device) in the serving layout; see module doc.

    ``sync(params, version)`` -> the sync's report; ``generate(prompts, ...)`` -> ``GenerateResult`` (as
    ``infer.generate``; the batch must split evenly over the batch shards); ``release()`` drops the copy."""

    def __init__(self, config, mesh=None, *, mismatch: str = "none", prefill_chunk: int = PREFILL_CHUNK,
                 reshard_chunk_bytes: int = RESHARD_CHUNK_BYTES):
        from glm5_jax.fields import require
        from glm5_jax.rl.rollout import MISMATCH_MODES
        from glm5_jax.infer.programs import serving_config
        from glm5_jax.sharding import param_shardings
        require("RolloutEngine: reshard_chunk_bytes", reshard_chunk_bytes, integer=True, min=1)
        if mismatch not in MISMATCH_MODES:
            raise ValueError(f"unknown mismatch mode {mismatch!r}; choose from {MISMATCH_MODES}")
        self.mesh = single_device_mesh() if mesh is None else mesh
        self.shards = math.prod(dict(self.mesh.shape).get(a, 1) for a in BATCH_AXES)
        check_serving_mesh(config, self.mesh, self.shards)
        self.config = serving_config(config, self.mesh)
        self.mismatch, self.prefill_chunk = mismatch, int(prefill_chunk)
        self.reshard_chunk_bytes = int(reshard_chunk_bytes)
        self.param_shardings = param_shardings(self.config, self.mesh, SERVE_RULES)
        self.rows = NamedSharding(self.mesh, P(BATCH_AXES))
        self.rep = NamedSharding(self.mesh, P())
        self.params, self.version = None, None
        self.last_sync: dict = {}
        self.last_memory: dict = {}
        self._runtimes: dict = {}           # batch shape -> PagedRuntime on this mesh (its compiled steps)
        self._temp: dict = {}
        self._sync_program = None
        self._chunk_programs: dict = {}

    # ------------------------------------------------------------------ weights
    def sync(self, params, version: int = 0) -> dict:
        """The rollout copy of ``params`` (jax Arrays in any layout on this mesh's devices) in the serving
        layout, under the mismatch mode, device to device, in the chunks of ``sync_plan``. Returns
        {"bytes_moved" (all devices), "bytes_moved_per_device" (the most any device receives), "host_bytes"
        (bytes copied in from host arrays among ``params``; 0 for device arrays: no array leaves the devices),
        "copy_bytes_per_device", "programs" (the programs run: chunks, a sliced leaf's slices each one),
        "seconds"}."""
        t0 = time.perf_counter()
        self.params = None                  # the old copy goes first: at most one rollout copy at a time
        moved = reshard_bytes(params, self.param_shardings)
        host = reshard_bytes([a for a in jax.tree.leaves(params) if not isinstance(a, jax.Array)],
                             [s for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(self.param_shardings))
                              if not isinstance(a, jax.Array)])
        leaves, treedef = jax.tree.flatten(params)
        shardings = jax.tree.leaves(self.param_shardings)
        plan = sync_plan(leaves, shardings, self.reshard_chunk_bytes)
        whole = len(plan) == 1 and plan[0][0] == "leaves"     # within one chunk: the one-program sync
        if whole and self.mismatch == "none":
            self.params, runs = jax.device_put(params, self.param_shardings), 1   # jax runs this as sync_program()
        else:
            here = set(self.mesh.devices.flat)     # leaves elsewhere (another device set, the host) come in first
            leaves = [a if isinstance(a, jax.Array) and a.sharding.device_set == here else jax.device_put(a, s)
                      for a, s in zip(leaves, shardings)]
            if whole:
                self.params, runs = self.sync_program()(treedef.unflatten(leaves)), 1
            else:
                out, runs = self._run_plan(plan, leaves, treedef)
                self.params = treedef.unflatten(out)
        jax.block_until_ready(self.params)
        copy = bytes_per_device(self.params)
        self.version = int(version)
        self.last_sync = {"bytes_moved": int(sum(moved.values())), "bytes_moved_per_device": int(max(moved.values())),
                          "host_bytes": int(sum(host.values())), "copy_bytes_per_device": int(max(copy.values())),
                          "programs": runs, "seconds": time.perf_counter() - t0}
        return self.last_sync

    def sync_program(self):
        """The sync as one jitted program: the mismatch mode's fake quantisation (identity for "none") with the
        serving shardings as its output shardings, so XLA reshards device to device inside it. ``sync`` runs it
        when the policy fits one chunk (mode "none": ``jax.device_put``, which jax runs as this identity
        program); ``lower_sync`` gives the chunked sync's programs."""
        if self._sync_program is None:
            from glm5_jax.rl.rollout import mismatch_params
            self._sync_program = jax.jit(functools.partial(mismatch_params, mode=self.mismatch),
                                         out_shardings=self.param_shardings)
        return self._sync_program

    def _chunk_program(self, chunk, treedef, src=None):
        """The jitted program of one ``sync_plan`` chunk. ("leaves", idx): [leaves] -> their serving copies.
        ("rows", i, rows): (buffer, leaf, start) -> (the buffer with rows [start, start + rows) of leaf i's copy
        written in, start + rows) (the buffer donated: the slices fill the one serving buffer in place; the
        offset stays on the devices, so no scalar crosses from the host). ``src``: leaf i's sharding, kept by
        its slice (sliced where it lies, so only the slice is gathered, never the whole leaf)."""
        from glm5_jax.rl.rollout import mismatch_params
        key = (chunk[0], tuple(chunk[1]) if chunk[0] == "leaves" else chunk[1:], treedef, src)
        if key in self._chunk_programs:
            return self._chunk_programs[key]
        shardings, n = jax.tree.leaves(self.param_shardings), treedef.num_leaves

        def quantised(pos: dict, xs):       # the mode on these leaves under their own tree paths
            sub = treedef.unflatten([xs[pos[j]] if j in pos else None for j in range(n)])
            return jax.tree.leaves(mismatch_params(sub, self.mismatch))

        if chunk[0] == "leaves":
            idx = list(chunk[1])
            prog = jax.jit(lambda xs: quantised({j: k for k, j in enumerate(idx)}, xs),
                           out_shardings=[shardings[j] for j in idx])
        else:
            i, rows = chunk[1], chunk[2]

            def write(buf, x, start):
                piece = jax.lax.dynamic_slice_in_dim(x, start, rows, 0)
                if isinstance(src, NamedSharding):    # else XLA gathers the whole leaf, then slices it
                    piece = jax.lax.with_sharding_constraint(piece, src)
                # resharded into the serving layout before the write: left free, XLA writes in the source
                # layout and then gathers the whole buffer (the full leaf, every slice)
                piece = jax.lax.with_sharding_constraint(quantised({i: 0}, [piece])[0], shardings[i])
                return jax.lax.dynamic_update_slice_in_dim(buf, piece, start, 0), start + rows

            prog = jax.jit(write, out_shardings=(shardings[i], self.rep), donate_argnums=0)
        self._chunk_programs[key] = prog
        return prog

    def _run_plan(self, plan, leaves, treedef):
        """Run ``plan``'s programs in order on the placed ``leaves`` -> (the serving copies, programs run)."""
        shardings, out, runs = jax.tree.leaves(self.param_shardings), [None] * len(leaves), 0
        for chunk in plan:
            prog = self._chunk_program(chunk, treedef, None if chunk[0] == "leaves" else leaves[chunk[1]].sharding)
            if chunk[0] == "leaves":
                for j, y in zip(chunk[1], prog([leaves[j] for j in chunk[1]])):
                    out[j] = y
                runs += 1
                continue
            i, rows = chunk[1], chunk[2]
            a, sh = leaves[i], shardings[i]
            key = ("buffer", a.shape, np.dtype(a.dtype).name, sh)      # the leaf's serving buffer and offset 0
            if key not in self._chunk_programs:
                self._chunk_programs[key] = jax.jit(functools.partial(_buffer, a.shape, a.dtype),
                                                    out_shardings=(sh, self.rep))
            buf, start = self._chunk_programs[key]()
            for _ in range(a.shape[0] // rows):
                buf, start = prog(buf, a, start)
                runs += 1
            out[i] = buf
        return out, runs

    def lower_sync(self, params) -> list:
        """The sync's programs lowered from ``params`` (ShapeDtypeStructs carrying the training shardings, or
        arrays): [(chunk, lowered, runs)], one entry per distinct program of ``sync_plan`` (``runs``: how many
        times a sync runs it; a sliced leaf's one program runs once per slice). A policy within one chunk:
        [(None, sync_program() lowered, 1)]. tools.aot --program=rl can compile these for a TPU topology: the
        chunked reshard's transient is the largest program's temporaries."""
        leaves, treedef = jax.tree.flatten(params)
        shardings = jax.tree.leaves(self.param_shardings)
        plan = sync_plan(leaves, shardings, self.reshard_chunk_bytes)
        if len(plan) == 1 and plan[0][0] == "leaves":
            return [(None, self.sync_program().lower(params), 1)]
        out = []
        for chunk in plan:
            src = None if chunk[0] == "leaves" else getattr(leaves[chunk[1]], "sharding", None)
            prog = self._chunk_program(chunk, treedef, src)
            if chunk[0] == "leaves":
                out.append((chunk, prog.lower([leaves[j] for j in chunk[1]]), 1))
            else:
                a, sh = leaves[chunk[1]], shardings[chunk[1]]
                buf = jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
                start = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.rep)
                out.append((chunk, prog.lower(buf, a, start), a.shape[0] // chunk[2]))
        return out

    def release(self) -> None:
        """Drop the rollout copy and every runtime's page pool (the update then has the devices to itself); the
        runtimes keep their compiled steps, and the next ``generate`` allocates a pool again."""
        self.params = None
        for rt in self._runtimes.values():
            rt.params, rt.pool = None, None

    # ------------------------------------------------------------------ programs
    def abstract_params(self):
        """The rollout copy's ShapeDtypeStructs carrying the serving shardings (nothing allocated)."""
        from glm5_jax.train.checkpoint import abstract_param_shapes
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract_param_shapes(self.config), self.param_shardings)

    def runtime_args(self, b: int, p: int, size: int, chunk: int | None = None) -> dict:
        """The PagedRuntime arguments of a batch of ``b`` prompts of at most ``p`` tokens and ``size`` cache
        positions each (``generation.batch_runtime_args`` with this engine's prefill chunk)."""
        return batch_runtime_args(b, p, size, self.prefill_chunk if chunk is None else int(chunk))

    def lower(self, which: str, b: int, p: int, size: int, *, chunk: int | None = None, params=None,
              programs=None):
        """The rollout's step program for ``b`` prompts of ``p`` tokens and ``size`` cache positions, lowered
        under the mesh from abstract arguments (nothing allocated): the runtime's ``Programs.paged_step``
        (row-keyed sampling, the full page table) at the width of a prefill step (which="prefill": the
        prefill budget, ``runtime_args``) or of a decode step (which="decode": ``b`` rows, one token each).
        tools.aot --program=rl compiles these for a TPU topology; ``generate`` measures their scratch.
        params: the rollout copy's arrays or ShapeDtypeStructs (default ``abstract_params()``); programs: a
        runtime's ``Programs`` (default: new ones for this mesh)."""
        from glm5_jax.infer.programs import Programs
        if which not in ("prefill", "decode"):
            raise ValueError(f"RolloutEngine.lower: which={which!r}; allowed: prefill, decode")
        kw = self.runtime_args(b, p, size, chunk)
        ps = kw["page_size"]
        pages, table = kw["kv_cache_tokens"] // ps, kw["max_model_len"] // ps
        width = kw["max_num_batched_tokens"] if which == "prefill" else b
        width = -(-width // self.shards) * self.shards
        progs = programs or Programs(self.config, self.mesh, max_batch=b, size=ps)
        prog = progs.paged_step(pages, ps, width, False, row_keys=True)
        sds = lambda a, s=None: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        params = jax.tree.map(sds, self.abstract_params() if params is None else params, self.param_shardings)
        spec, pool_sh = progs.pool_sharding(pages, ps)
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        f32 = jax.ShapeDtypeStruct((b,), jnp.float32)
        k, r = i32(width), i32(b)
        # PagedRuntime.plan's arguments: cow src / dst, tokens, pos, wpos, seq, tables, out_rows, temp, top_k,
        # top_p, seeds, counts, targets, krow
        args = (r, r, k, k, k, k, i32(b, table), r, f32, r, f32, jax.ShapeDtypeStruct((b,), jnp.uint32), r, k, r)
        with use_mesh(self.mesh, SERVE_RULES):
            return prog.lower(params, jax.tree.map(sds, spec, pool_sh), *args)

    def _runtime(self, b: int, p: int, size: int) -> tuple:
        """(the runtime of this batch shape on the mesh with the synced copy, its arguments)."""
        kw = self.runtime_args(b, p, size)
        key = tuple(sorted(kw.items()))
        rt = self._runtimes.get(key)
        if rt is None:
            rt = self._runtimes[key] = PagedRuntime(self.config, self.params, mesh=self.mesh, **kw)
        else:
            if rt.pool is None:                  # released after the last rollouts
                rt.reset()
            if rt.params is not self.params:
                rt.new_weights(self.params)      # already in the serving layout: nothing moves
        return rt, kw

    def generate(self, prompts, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, stop_tokens: Sequence[int] = (),
                 max_len: int | None = None) -> GenerateResult:
        """``infer.generate`` (same arguments, same sampling) on the synced rollout copy, on the mesh."""
        if self.params is None:
            raise RuntimeError("RolloutEngine.generate before sync(params): no rollout weights on the devices")
        sampling.validate(temperature, top_p, top_k)
        tokens, lens = prepare_prompts(self.config, prompts)
        b = tokens.shape[0]
        if b % self.shards:
            raise ValueError(f"{b} rollout rows do not split over the mesh's {self.shards} batch shards "
                             f"({'*'.join(BATCH_AXES)}); use a multiple of {self.shards}")
        size = resolve_max_len(tokens.shape[1], max_new_tokens, max_len)
        prefill_chunks(tokens.shape[1], self.prefill_chunk)     # a bad prefill_chunk fails before any compilation
        rt, kw = self._runtime(b, tokens.shape[1], size)
        out = run_batch(rt, [list(r[:n]) for r, n in zip(tokens, lens)], max_new_tokens=max_new_tokens,
                        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop_tokens=stop_tokens)
        pool = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(rt.pool)) // self.shards
        temp = self._temp_bytes(rt, b, tokens.shape[1], size)
        self.last_memory = {"cache_bytes_per_device": int(pool), "program_temp_bytes_per_device": temp,
                            "copy_bytes_per_device": self.last_sync.get("copy_bytes_per_device", 0)}
        return out

    def _temp_bytes(self, rt: PagedRuntime, b: int, p: int, size: int) -> int:
        """Scratch bytes per device of the batch's widest step (the prefill step), measured once per runtime."""
        if id(rt) not in self._temp:
            self._temp[id(rt)] = _temp_bytes(self.lower("prefill", b, p, size, params=self.params,
                                                        programs=rt.programs).compile())
        return self._temp[id(rt)]


def _buffer(shape, dtype):
    """A sliced leaf's serving buffer (its slices are written in) and the first slice's offset."""
    return jnp.zeros(shape, dtype), jnp.int32(0)


def _temp_bytes(compiled) -> int:
    """Scratch bytes per device of a compiled program (XLA's memory analysis; 0 where unavailable)."""
    try:
        m = compiled.memory_analysis()
        return int(m.temp_size_in_bytes) if m is not None else 0
    except Exception:           # noqa: BLE001 -- some backends do not implement the analysis
        return 0
