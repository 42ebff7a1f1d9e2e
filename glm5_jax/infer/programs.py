"""The serving engine's compiled programs, on a mesh (one device is the trivial mesh).

Layout (docs/inference.md, "Sharding for serving"): parameters by `glm5_jax.sharding.SERVE_RULES`
(attention weights replicated or split over `tensor`, routed experts over `expert`); the cache, the MTP
buffers and every per-slot array sharded over the batch axes (data, fsdp, expert), so each batch shard
owns `max_batch / shards` consecutive slots and their cache rows, and attention runs data-parallel. Each
program is jitted with explicit in / out shardings, donates the cache it updates, and is traced under
the mesh (`use_mesh`): activation constraints apply, the MoE runs its expert-parallel all-to-all
(`moe_impl="a2a"`, dropless in one worst-case round: a decode step routes a few tokens per chip).

Prefill runs one row per batch shard per call (`prefill`): row i prefills `length[i]` tokens at positions
`start[i]..` into local slot `lslot[i]` of shard i, in place: the model sees the cache as [repeats, shards,
slots per shard, S, ...] (a reshape of the batch-sharded axis, no data moved) and writes and gathers at
[layer, i, lslot[i], position] (`GLM5(cache_slots=)`), so no row is copied out and a prompt's cache never
leaves its shard (a shard with no request runs a dummy row that writes nothing). A reused prefix held by
another slot of the shard (`lsrc[i]`) is first copied within the shard, one layer at a time, inside
`jax.shard_map` over the batch axes (`copy_rows`). The speculative prefill's smaller per-row buffers (MTP
caches, hidden states, tokens) move with `take_rows` / `put_rows`.

`tools.aot --program=decode|prefill` compiles these same programs for a TPU topology (`abstract_args`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax.batch import BATCH_AXES
from glm5_jax.errors import Glm5Error
from glm5_jax.infer import cache as kv
from glm5_jax.infer.decode import final_norm, head, model_step, prefill_chunks
from glm5_jax.infer.sampling import batch_row_keys, sample_rows
from glm5_jax.attention.core import LayerCache, batch_local
from glm5_jax.infer.speculative import draft_sampler, mtp_window, verify
from glm5_jax.layers.common import dtype_of
from glm5_jax.parallel.distributed import multi_process, to_global
from glm5_jax.sharding import SERVE_RULES, check_serving_mesh, param_shardings, single_device_mesh, use_mesh

__all__ = ["Programs", "TOP_LOGPROBS", "serving_config"]

TOP_LOGPROBS = 20           # alternatives computed per position (OpenAI allows at most 20 top_logprobs)


def serving_config(config, mesh):
    """The config the engine's programs run: with experts over a multi-device `expert` axis the MoE is the
    explicit all-to-all, dropless in one round sized for the worst case (a decode step sends a few
    tokens per chip: the buffers are tiny, and no token of any row is ever dropped)."""
    if config.num_experts and dict(mesh.shape).get("expert", 1) > 1:
        return config.replace(moe_impl="a2a", moe_capacity_factor=0.0, moe_round_capacity_factor=0.0)
    return config


def kv_b_layouts(config, shardings, mesh):
    """The parameters' shardings for the programs' inputs: on TPU, MLA's kv_b kernels ([layers,] kv_lora,
    H (dn + dv)) as `Format`s with kv_lora minor, the layout the absorbed attention's two per-head matmuls
    (W_UK, W_UV) read them in; anything else, and every parameter off TPU, keeps its default layout. Left
    in the default layout, the TPU compiler copies each layer's kv_b out of the scanned stack into that
    layout at every decode step (a copy and a relaid copy: 4 x 29 MB a layer for glm5, docs/inference.md)."""
    concrete = isinstance(mesh, jax.sharding.Mesh)              # an AbstractMesh has no devices
    if not concrete or getattr(mesh.devices.flat[0], "platform", "cpu") != "tpu" or not config.is_mla:
        return shardings
    from jax.experimental.layout import Format, Layout
    from glm5_jax.model import abstract_params
    import flax.linen as nn
    shapes = nn.unbox(abstract_params(config))

    def one(path, s, a):
        keys = [getattr(k, "key", None) for k in path]
        if keys[-2:] != ["kv_b_proj", "kernel"]:
            return s
        return Format(Layout(tuple(range(a.ndim - 2)) + (a.ndim - 1, a.ndim - 2)), s)
    return jax.tree_util.tree_map_with_path(one, shardings, shapes)


def _row_keys(seeds, counts):
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, counts)


def _take(x, idx):
    """x[idx] for row indices idx of x's own batch shard (the paged step's rows, sequences and page tables are
    split over the batch shards in blocks, glm5_jax.infer.runtime places each sequence's rows in its shard's
    block): a gather local to each shard, global index i at local i % (rows a shard)."""
    return batch_local(lambda a, i: a[i % a.shape[0]], x, idx, axes=(0, 0), out_axes=0)


def _copy_pages(a, src, dst, lead=()):
    """Pages dst[c] >= 0 of a page pool a [*lead, num_pages, ...] become copies of pages src[c] (ids of one
    shard's pages when run per shard: `batch_local`; local index p % num_pages), one page at a time in place
    up to the last c with dst[c] >= 0 (the runtime lists a shard's copies first in its block; dst < 0 copies
    a page onto itself). A gather of the listed pages out of a layer stack made the TPU compiler slice the
    whole stacked pool ("mini-gather") every step: 26 GB a chip for glm5 (docs/inference.md)."""
    ax, m = len(lead), a.shape[len(lead)]
    last = jnp.max(jnp.where(dst >= 0, jnp.arange(dst.shape[0]) + 1, 0))

    def one(c, a):
        s = jnp.maximum(src[c], 0) % m
        page = jax.lax.dynamic_slice_in_dim(a, s, 1, axis=ax)
        return jax.lax.dynamic_update_slice_in_dim(a, page, jnp.where(dst[c] >= 0, dst[c] % m, s), axis=ax)
    return jax.lax.fori_loop(0, last, one, a)


def _top(model_lp, n):
    v, i = jax.lax.top_k(model_lp, min(n, model_lp.shape[-1]))
    return i.astype(jnp.int32), v


class Programs:
    """The jitted programs of one engine: ``max_batch`` slots of ``size`` cache positions on ``mesh``.

    Slot g lives on batch shard g // per_shard as local slot g % per_shard. ``num_draft`` > 0 adds the MTP
    speculative state (``hbuf`` [B, size, D] trunk hidden states, ``seq`` [B, size + 1] committed tokens)."""

    def __init__(self, config, mesh=None, *, max_batch: int, size: int, num_draft: int = 0, rules=SERVE_RULES):
        self.mesh = single_device_mesh() if mesh is None else mesh
        self.rules = rules
        self.shards = check_serving_mesh(config, self.mesh, max_batch)
        self.config = serving_config(config, self.mesh)
        self.max_batch, self.size, self.num_draft = int(max_batch), int(size), int(num_draft)
        self.per_shard = self.max_batch // self.shards
        self.params = param_shardings(self.config, self.mesh, rules)
        self.param_formats = kv_b_layouts(self.config, self.params, self.mesh)   # the programs' parameter inputs
        self.rep = NamedSharding(self.mesh, P())
        self.rows = NamedSharding(self.mesh, P(BATCH_AXES))      # any per-slot / per-row array: axis 0 over the batch
        # stacked layer buffers [repeats, B, S, ...]: B over the batch axes; mtp caches, hbuf, seq [B, ...]
        stacked, flat = NamedSharding(self.mesh, P(None, BATCH_AXES)), self.rows
        spec = self.abstract_state()
        self.state = {k: jax.tree.map(lambda a: flat, v) for k, v in spec.items()}
        self.state["cache"] = {"layers": jax.tree.map(lambda a: stacked, spec["cache"]["layers"]),
                               "mtp": jax.tree.map(lambda a: flat, spec["cache"]["mtp"])}
        self._jits: dict = {}

    # ------------------------------------------------------------------ layout

    def abstract_state(self) -> dict:
        """ShapeDtypeStructs of the engine's device state: {"cache": {"layers", "mtp"}[, "hbuf", "seq"]}."""
        b, n, c = self.max_batch, self.num_draft, self.config
        out = {"cache": jax.eval_shape(lambda: kv.init_cache(c, b, self.size, mtp_depths=n))}
        if n:
            out["hbuf"] = jax.ShapeDtypeStruct((b, self.size, c.d_model), dtype_of(c.dtype))
            out["seq"] = jax.ShapeDtypeStruct((b, self.size + 1), jnp.int32)
        return out

    def alloc(self) -> dict:
        """The zeroed device state, allocated in place on its shards (no host copy, no full array anywhere)."""
        return self._jit("alloc", lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.abstract_state()),
                         (), self.state)()

    def place_params(self, params):
        """`params` laid out by the serving rules (device to device; a no-op where they already are). Over
        several processes a leaf that is not yet a global array must hold the same value on every process."""
        want, got = jax.tree.structure(self.params), jax.tree.structure(params)
        if want != got:
            from flax import traverse_util
            flat = lambda t: {"/".join(k) for k in traverse_util.flatten_dict(t)} if isinstance(t, dict) else set()
            missing, extra = sorted(flat(self.params) - flat(params)), sorted(flat(params) - flat(self.params))
            raise Glm5Error(f"params do not match the model's parameter tree: missing {missing[:4]}, unexpected "
                            f"{extra[:4]} ({len(missing)} missing, {len(extra)} unexpected)")
        if not multi_process(self.mesh):
            return jax.device_put(params, self.param_formats)
        return jax.device_put(jax.tree.map(to_global, params, self.params), self.param_formats)

    def per_device_bytes(self, state) -> dict:
        """Bytes of each state array on one device (its addressable shard) and in total."""
        out = {}
        for path, a in jax.tree_util.tree_leaves_with_path(state):
            shard = a.addressable_shards[0].data
            out[jax.tree_util.keystr(path)] = (int(shard.size * shard.dtype.itemsize), int(a.size * a.dtype.itemsize))
        return out

    # ------------------------------------------------------------------ jit plumbing
    def _jit(self, key, fn, in_sh, out_sh, donate=()):
        if key not in self._jits:
            self._jits[key] = jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate)
        return self._jits[key]

    def call(self, fn, *args, replicated: bool = False):
        """fn(*args) traced under the mesh. Over several processes, host arguments (identical on every
        process) become global arrays: per-slot / per-row arrays split over the batch axes (every one
        replicated with `replicated`, as the paged step takes them), scalars replicated."""
        if multi_process(self.mesh):
            args = tuple(to_global(a, self.rows if np.ndim(a) and not replicated else self.rep)
                         if isinstance(a, (np.ndarray, np.generic)) else a for a in args)
        with use_mesh(self.mesh, self.rules):
            return fn(*args)

    def compiled_count(self) -> int:
        return sum(f._cache_size() for f in self._jits.values())

    def _specs(self, tree, axis: int):
        return jax.tree.map(lambda a: P(*([None] * axis), BATCH_AXES), tree)

    def take_rows(self, tree, lslot, axis: int):
        """Row lslot[i] of shard i of every leaf (batch at `axis`) -> leaves with one row per shard."""
        def f(t, s):
            return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, s[0], 1, axis=axis), t)
        specs = self._specs(tree, axis)
        return jax.shard_map(f, mesh=self.mesh, in_specs=(specs, P(BATCH_AXES)), out_specs=specs,
                             check_vma=False)(tree, lslot)

    def put_rows(self, tree, rows, lslot, axis: int):
        """Write one row per shard (`rows`, as take_rows returns) into local slot lslot[i] of shard i."""
        def f(t, r, s):
            return jax.tree.map(lambda a, x: jax.lax.dynamic_update_slice_in_dim(a, x, s[0], axis=axis), t, r)
        specs = self._specs(tree, axis)
        return jax.shard_map(f, mesh=self.mesh, in_specs=(specs, specs, P(BATCH_AXES)), out_specs=specs,
                             check_vma=False)(tree, rows, lslot)

    def copy_rows(self, layers, lsrc, lslot):
        """Stacked layer buffers with shard i's local slot lsrc[i] copied into its slot lslot[i] (a prefix
        reused from another slot of the shard), one layer of one leaf at a time (the transient is one layer's
        row), in place, every layer of every stack; nothing where lsrc[i] == lslot[i]."""
        def f(t, src, dst):
            def copy_leaf(a):        # every leaf over its own layer count (the dense prefix and the MoE body differ)
                return jax.lax.fori_loop(0, a.shape[0], lambda l, a: a.at[l, dst[0]].set(a[l, src[0]]), a)

            return jax.lax.cond(src[0] != dst[0], lambda t: jax.tree.map(copy_leaf, t), lambda t: t, t)
        specs = self._specs(layers, 1)
        return jax.shard_map(f, mesh=self.mesh, in_specs=(specs, P(BATCH_AXES), P(BATCH_AXES)), out_specs=specs,
                             check_vma=False)(layers, lsrc, lslot)

    def _per_shard(self, layers):
        """[repeats, B, S, ...] -> [repeats, shards, B / shards, S, ...]: splits the sharded batch axis into
        (shard, local slot) without moving data."""
        n = self.shards
        return jax.tree.map(lambda a: a.reshape(a.shape[0], n, a.shape[1] // n, *a.shape[2:]), layers)

    def _merged(self, layers):
        return jax.tree.map(lambda a: a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:]), layers)

    # ------------------------------------------------------------------ programs
    def decode(self):
        """(params, layers, tok, pos, active, temp, top_k, top_p, seeds, counts) [B] each -> (next tokens,
        sampling lps, model lps, top ids, top lps, layers): one token per slot at its position; idle slots
        write nothing."""
        cfg = self.config

        def fn(params, layers, tok, pos, active, temp, top_k, top_p, seeds, counts):
            x, layers = model_step(cfg, params, layers, tok[:, None], pos[:, None], jnp.where(active, pos, -1)[:, None])
            logits = head(cfg, params, final_norm(cfg, params, x[:, 0]))
            nxt, lp_s, model_lp = sample_rows(_row_keys(seeds, counts), logits, temp, top_k, top_p)
            ti, tv = _top(model_lp, TOP_LOGPROBS)
            return nxt, lp_s, jnp.take_along_axis(model_lp, nxt[:, None], axis=-1)[:, 0], ti, tv, layers

        lay = self.state["cache"]["layers"]
        return self._jit("decode", fn, (self.param_formats, lay) + (self.rows,) * 8, (self.rows,) * 5 + (lay,), (1,))

    def _trunk_rows(self, cfg, width, chunk, params, rows, tokens, start, length, slots=None):
        """The trunk over tokens [n, width] (the first length[i] real) at positions start[i].. of each row,
        in chunks (each writes its keys, then attends slots 0..p) -> (rows, pre-final-norm hidden [n, width, D]).
        slots [n]: `rows` are the per-shard cache [repeats, n, P, S, ...] and row i works in place on its slot."""
        nc, c = prefill_chunks(width, chunk)
        toks = jnp.pad(tokens, ((0, 0), (0, nc * c - width)))

        def one_chunk(r, i):
            j = i * c + jnp.arange(c, dtype=jnp.int32)[None]
            pos = start[:, None] + j
            x, r = model_step(cfg, params, r, jax.lax.dynamic_slice_in_dim(toks, i * c, c, axis=1), pos,
                              jnp.where(j < length[:, None], pos, -1), slots)
            return r, x

        rows, xs = jax.lax.scan(one_chunk, rows, jnp.arange(nc, dtype=jnp.int32))
        return rows, jnp.swapaxes(xs, 0, 1).reshape(tokens.shape[0], nc * c, -1)[:, :width]

    def _first_tokens(self, cfg, params, xs, length, temp, top_k, top_p, seed):
        x_last = jnp.take_along_axis(xs, jnp.maximum(length - 1, 0)[:, None, None], axis=1)[:, 0]
        logits = head(cfg, params, final_norm(cfg, params, x_last))
        tok, lp_s, model_lp = sample_rows(_row_keys(seed, jnp.zeros_like(length)), logits, temp, top_k, top_p)
        ti, tv = _top(model_lp, TOP_LOGPROBS)
        return tok, lp_s, jnp.take_along_axis(model_lp, tok[:, None], axis=-1)[:, 0], ti, tv

    def prefill(self, width: int, chunk: int, echo: bool):
        """(params, layers, lslot, lsrc, tokens [n, width], targets [n, width], start, length, temp, top_k,
        top_p, seed) with n = batch shards -> (first token, its sampling lp, its model lp, top ids, top lps,
        echo (lp of targets [n, width], top ids, top lps) or None, layers). Row i: shard i's local slot lsrc[i]
        is read, tokens[i, :length[i]] prefilled at positions start[i].., the row written to local slot lslot[i]."""
        cfg = self.config

        def fn(params, layers, lslot, lsrc, tokens, targets, start, length, temp, top_k, top_p, seed):
            layers = self._per_shard(self.copy_rows(layers, lsrc, lslot))
            layers, xs = self._trunk_rows(cfg, width, chunk, params, layers, tokens, start, length, lslot)
            first = self._first_tokens(cfg, params, xs, length, temp, top_k, top_p, seed)
            ech = None
            if echo:
                all_lp = jax.nn.log_softmax(head(cfg, params, final_norm(cfg, params, xs)), axis=-1)   # [n, W, V]
                ech = (jnp.take_along_axis(all_lp, targets[..., None], axis=-1)[..., 0],) + _top(all_lp, TOP_LOGPROBS)
            return (*first, ech, self._merged(layers))

        lay = self.state["cache"]["layers"]
        ech = (self.rows,) * 3 if echo else None
        return self._jit(("prefill", width, chunk, echo), fn, (self.param_formats, lay) + (self.rows,) * 10,
                         (self.rows,) * 5 + (ech, lay), (1,))

    def move_row(self):
        """(layers, dst, src) -> layers with global slot src's row copied into slot dst (one shard only:
        decode buckets, `Engine` allows them on a single batch shard)."""
        if self.shards != 1:
            raise ValueError("move_row copies rows inside one batch shard; this mesh has "
                             f"{self.shards} batch shards")

        def fn(layers, dst, src):
            row = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, src, 1, axis=1), layers)
            return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, dst, axis=1), layers, row)

        lay = self.state["cache"]["layers"]
        return self._jit("move_row", fn, (lay, self.rep, self.rep), lay, (0,))

    def decode_rows(self, rows: int):
        """`decode` over the first `rows` slots only (a decode bucket, single batch shard): those rows are
        sliced out and written back in place; the other slots are untouched."""
        if rows == self.max_batch:
            return self.decode()
        cfg = self.config

        def fn(params, layers, tok, pos, active, temp, top_k, top_p, seeds, counts):
            sub = jax.tree.map(lambda a: jax.lax.slice_in_dim(a, 0, rows, axis=1), layers)
            x, sub = model_step(cfg, params, sub, tok[:, None], pos[:, None], jnp.where(active, pos, -1)[:, None])
            layers = jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, 0, axis=1), layers, sub)
            logits = head(cfg, params, final_norm(cfg, params, x[:, 0]))
            nxt, lp_s, model_lp = sample_rows(_row_keys(seeds, counts), logits, temp, top_k, top_p)
            ti, tv = _top(model_lp, TOP_LOGPROBS)
            return nxt, lp_s, jnp.take_along_axis(model_lp, nxt[:, None], axis=-1)[:, 0], ti, tv, layers

        lay = self.state["cache"]["layers"]
        return self._jit(("decode", rows), fn, (self.param_formats, lay) + (self.rep,) * 8, (self.rep,) * 5 + (lay,), (1,))

    # ------------------------------------------------------------------ the paged runtime
    def pool_sharding(self, num_pages: int, page_size: int):
        """Shardings of a page pool {stack: {"layer_j": [repeats, num_pages, page_size, ...]}}: pages over
        the batch axes (each batch shard holds num_pages / shards of them)."""
        spec = jax.eval_shape(lambda: kv.init_cache(self.config, num_pages, page_size)["layers"])
        return spec, jax.tree.map(lambda a: NamedSharding(self.mesh, P(None, BATCH_AXES)), spec)

    def spec_pool_sharding(self, num_pages: int, page_size: int):
        """MTP speculation's pages beside the pool (`num_draft` > 0): {"mtp": per depth {"kv", "k_idx"}
        [num_pages, page_size, ...], "h": the trunk's pre-norm hidden state [num_pages, page_size, D]}, pages
        over the batch axes like the pool's."""
        c = self.config
        spec = jax.eval_shape(lambda: {"mtp": kv.init_cache(c, num_pages, page_size, self.num_draft)["mtp"],
                                       "h": jnp.zeros((num_pages, page_size, c.d_model), dtype_of(c.dtype))})
        return spec, jax.tree.map(lambda a: NamedSharding(self.mesh, P(BATCH_AXES)), spec)

    def alloc_pool(self, num_pages: int, page_size: int):
        """The zeroed page pool, allocated in place on its shards; with `num_draft` > 0, (pool, spec pool)."""
        specs = [self.pool_sharding(num_pages, page_size)]
        if self.num_draft:
            specs.append(self.spec_pool_sharding(num_pages, page_size))
        out = tuple(self._jit(("pool", num_pages, page_size, i),
                              lambda spec=spec: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), spec), (), sh)()
                    for i, (spec, sh) in enumerate(specs))
        return out if self.num_draft else out[0]

    def zero_tokens(self):
        """() -> zeros [max_batch] int32 laid out as a step's sampled tokens (the first step's `feed_tokens`
        input, so every step feeds from a device array of one layout: one compile a width)."""
        return self._jit("zero_tokens", lambda: jnp.zeros((self.max_batch,), jnp.int32), (), self.rows)

    def feed_tokens(self, width: int):
        """(prev [R], from_prev [width], tokens [width]) -> tokens with row k = prev[from_prev[k]] where
        from_prev[k] >= 0: a step's decode tokens taken from the previous step's sampled tokens on the device
        (overlapped steps: the previous step's outputs have not reached the host)."""
        return self._jit(("feed", width), lambda prev, src, tok: jnp.where(src >= 0, prev[jnp.maximum(src, 0)], tok),
                         (self.rows,) * 3, self.rows)

    def paged_step(self, num_pages: int, page_size: int, width: int, echo: bool, greedy: bool = False,
                   row_keys: bool = False):
        """One step of the paged runtime (glm5_jax.infer.runtime): `width` token rows, each one token of a
        running sequence (a decode token or one token of a prefill chunk) with its sequence's page table,
        so decodes and prefill chunks share one program, one weight read and one compile per width.

        (params, pool, cow_src [C], cow_dst [C], tokens [K], pos [K], wpos [K], seq [K], tables [R, n],
        out_rows [R], temp, top_k, top_p, seeds, counts [R], targets [K]) -> (next token, its sampling lp,
        its model lp, top ids, top lps [R], echo (lp of targets [K], top ids, top lps) or None, pool).
        First every page cow_dst[c] >= 0 becomes a copy of page cow_src[c] (copy-on-write of a shared
        partial page); then row k writes its keys at position wpos[k] (< 0: nothing) through the table of
        sequence seq[k] and attends its positions 0..pos[k] (every row of a layer writes before any reads,
        so a prefill chunk's rows see each other); sequence r samples from row out_rows[r].

        MTP speculation (`num_draft` = n > 0; `greedy` static: every speculating row greedy) adds the spec
        pool (after pool) and (spec [R] bool, e [R], wtok [R, 3n], draft_of [K], vrows [R, n + 1], mtp_tok
        [K, n], mtp_wpos [K]) after targets, and returns (tokens [R, n + 1], their lps, accepted [R], spec
        pool) after the pool. A speculating sequence r (last trunk position e[r]) first drafts n tokens: the
        MTP depths over its window e - 2n + 1 .. e (`speculative.mtp_window`: the window's hidden states
        from the spec pool, committed tokens wtok[r] at positions e - 2n + 1 .., its MTP entries rewritten);
        row k whose draft_of[k] >= 0 then takes draft draft_of[k] (flat [R * n]) as its token, so its rows
        vrows[r] verify [next token, drafts] at e + 1 .. e + n + 1 in the same trunk pass as the prefill
        chunks; every row's hidden state is written to the spec pool, and the MTP depths run over the rows
        with mtp_wpos >= 0 (a prefill's tokens; depth k reads the committed token mtp_tok[k, k - 1] at
        pos + k), writing their MTP entries. Verification is `speculative.verify` (greedy or rejection
        sampling with the key fold_in(PRNGKey(seed), count) split n + 1 ways, as the slot path).

        `row_keys` (static, no speculation) adds one last argument, krow [R] int32: sequence r with krow[r] >= 0
        samples as row krow[r] of one draw over the batch with its key (`sampling.batch_row_keys`:
        `infer.generate`'s and the RL rollouts' batch scheme), < 0 with its own key as without it."""
        cfg, n = self.config, self.num_draft
        if row_keys and n:
            raise ValueError("paged_step: row_keys samples without MTP speculation (num_draft=0)")

        def fn(params, pool, *rest):
            spool = krow = None
            if row_keys:
                *rest, krow = rest
            if n:
                spool, *rest = rest
            (cow_src, cow_dst, tokens, pos, wpos, seq, tables, out_rows, temp, top_k, top_p, seeds, counts,
             targets, *sp) = rest
            copy = lambda a, lead: batch_local(lambda *x: _copy_pages(*x, lead=lead), a, cow_src, cow_dst,
                                               axes=(len(lead), 0, 0), out_axes=len(lead))
            pool = jax.tree.map(lambda a: copy(a, (slice(None),)), pool)
            keys = _row_keys(seeds, counts)
            if n:
                spec, e, wtok, draft_of, vrows, mtp_tok, mtp_wpos = sp
                spool = jax.tree.map(lambda a: copy(a, ()), spool)
                win = e[:, None] - 2 * n + 1 + jnp.arange(2 * n, dtype=jnp.int32)
                wwin = jnp.where((win >= 0) & spec[:, None], win, -1)
                hwin = LayerCache({"h": spool["h"]}, pages=tables).gather("h", jnp.maximum(win, 0)[:, None])[:, 0]
                ks = draw = None
                if not greedy:
                    ks = jax.vmap(lambda k: jax.random.split(k, n + 1))(keys)
                    draw = draft_sampler(ks, temp, top_k, top_p)
                mtp = [LayerCache(m, pages=tables) for m in spool["mtp"]]
                drafts, mtp, _, q = mtp_window(cfg, n, params, mtp, hwin, wtok, win[:, 0], win, wwin, e, draw)
                tokens = jnp.where(draft_of >= 0, _take(drafts.reshape(-1), jnp.maximum(draft_of, 0)), tokens)
            x, pool = model_step(cfg, params, pool, tokens[:, None], pos[:, None], wpos[:, None],
                                 pages=_take(tables, seq))
            x = x[:, 0]
            logits = head(cfg, params, final_norm(cfg, params, _take(x, out_rows)))
            if krow is not None:
                keys = batch_row_keys(keys, krow, logits.shape[-1])
            # per batch shard: the partitioner all-gathers a batch-sharded top_k's operand (the [R, V] logits)
            nxt, lp_s, model_lp, ti, tv = batch_local(lambda *a: (s := sample_rows(*a)) + _top(s[2], TOP_LOGPROBS),
                                                      keys, logits, temp, top_k, top_p, axes=(0,) * 5,
                                                      out_axes=(0,) * 5)
            ech = None
            if echo:
                all_lp = jax.nn.log_softmax(head(cfg, params, final_norm(cfg, params, x)), axis=-1)   # [K, V]
                ech = (jnp.take_along_axis(all_lp, targets[:, None], axis=-1)[:, 0],) + _top(all_lp, TOP_LOGPROBS)
            out = (nxt, lp_s, jnp.take_along_axis(model_lp, nxt[:, None], axis=-1)[:, 0], ti, tv, ech, pool)
            if not n:
                return out
            rows = LayerCache({"h": spool["h"]}, pages=_take(tables, seq))
            h = rows.write("h", wpos[:, None], x[:, None]).buffers["h"]
            mtp = [LayerCache(m.buffers, pages=_take(tables, seq)) for m in mtp]

            def prefill_mtp(mtp):            # the MTP depths over a prefill's rows (their tokens are all known)
                p1 = pos[:, None]
                _, mtp, _, _ = mtp_window(cfg, n, params, mtp, x[:, None], mtp_tok, pos + 1, p1,
                                          mtp_wpos[:, None], pos + n, heads=False)
                return mtp

            mtp = jax.lax.cond(jnp.any(mtp_wpos >= 0), prefill_mtp, lambda m: m, mtp)
            vlogits = head(cfg, params, final_norm(cfg, params, _take(x, vrows)))                  # [R, n + 1, V]
            g, lp, a = verify(vlogits, drafts, q, None if greedy else ks[:, n], temp, top_k, top_p, greedy=greedy)
            spool = {"mtp": [m.buffers for m in mtp], "h": h}
            return out + ((g, lp, jnp.where(spec, a, 0)), spool)

        _, pool = self.pool_sharding(num_pages, page_size)
        ech = (self.rows,) * 3 if echo else None
        if not n:
            return self._jit(("paged_step", num_pages, page_size, width, echo) + (("row_keys",) if row_keys else ()), fn,
                             (self.param_formats, pool) + (self.rows,) * (14 + row_keys), (self.rows,) * 5 + (ech, pool), (1,))
        _, spool = self.spec_pool_sharding(num_pages, page_size)
        return self._jit(("paged_step", num_pages, page_size, width, echo, greedy), fn,
                         (self.param_formats, pool, spool) + (self.rows,) * 21,
                         (self.rows,) * 5 + (ech, pool, (self.rows,) * 3, spool), (1, 2))

    # ------------------------------------------------------------------ AOT
    def abstract_args(self, program: str, *, width: int = 0, chunk: int = 0, echo: bool = False, greedy: bool = True,
                      num_pages: int = 0, page_size: int = 0, table: int = 0):
        """ShapeDtypeStructs (with shardings) of a program's arguments, for `.lower(*args)` (tools.aot).
        paged_step (no speculation): `width` token rows, max_batch sequences, a pool of `num_pages` pages of
        `page_size` and page tables `table` pages wide."""
        sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        from glm5_jax.model import abstract_params
        import flax.linen as nn
        params = jax.tree.map(sds, nn.unbox(abstract_params(self.config)), self.param_formats)
        state = jax.tree.map(sds, self.abstract_state(), self.state)
        b, n = self.max_batch, self.shards
        vec = lambda m, dt: jax.ShapeDtypeStruct((m,), dt, sharding=self.rows)
        if program == "decode":
            i, f = vec(b, jnp.int32), vec(b, jnp.float32)
            return (params, state["cache"]["layers"], i, i, vec(b, jnp.bool_), f, i, f, vec(b, jnp.uint32), i)
        if program == "prefill":
            i, f = vec(n, jnp.int32), vec(n, jnp.float32)
            t = jax.ShapeDtypeStruct((n, width), jnp.int32, sharding=self.rows)
            return (params, state["cache"]["layers"], i, i, t, t, i, i, f, i, f, vec(n, jnp.uint32))
        if program == "spec_decode":
            i, f = vec(b, jnp.int32), vec(b, jnp.float32)
            return (params, state, i, vec(b, jnp.bool_), f, i, f, vec(b, jnp.uint32), i)
        if program == "paged_step" and not self.num_draft:
            spec, sh = self.pool_sharding(num_pages, page_size)
            ik, ir, fr = vec(width, jnp.int32), vec(b, jnp.int32), vec(b, jnp.float32)
            tables = jax.ShapeDtypeStruct((b, table), jnp.int32, sharding=self.rows)
            return (params, jax.tree.map(sds, spec, sh), ir, ir, ik, ik, ik, ik, tables, ir, fr, ir, fr,
                    vec(b, jnp.uint32), ir, ik)
        raise ValueError(f"program={program!r}: decode | prefill | spec_decode | paged_step (num_draft 0)")

