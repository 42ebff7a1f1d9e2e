"""tools.aot --program=decode|prefill: the serving engine's own programs compiled for a TPU topology.

    python -m tools.aot --program=decode --preset=glm5 --topology=v5p:4x4x4 --batch=128 --max_model_len=131072
        [--mesh=expert:64] [--prefill_chunk=512] [--set model.FIELD=V] --json

The programs are `glm5_jax.infer.programs.Programs`'s: `--kv_cache=paged` the runtime's step (what
`serve.Engine` runs); `--kv_cache=slots` (the default) the slot-cache `decode()` (one token for each of the
`--batch` cache slots) and `prefill(width, chunk, echo=False)` (one row of `--prefill_chunk` prompt tokens
per batch shard), the programs the engine ran before the paged runtime, kept for today's figure.
`--speculative=mtp` is refused (the speculative paged step is not compiled here yet). Each is lowered with
`Programs.abstract_args` (ShapeDtypeStructs carrying the serving shardings) under the mesh and compiled by
libtpu; nothing is allocated. The slot cache holds `--max_model_len` positions per slot.

Default mesh: every chip on `expert` (attention data-parallel with batch / chips sequences a chip, routed
experts expert-parallel: docs/inference.md, "Sharding for serving").

The report adds to tools.aot's per-chip memory: `weights` / `cache` (the per-chip bytes of all parameters
and of the engine state the program takes) and `engine_total` = weights + cache + temporaries (what the
engine holds while the program runs: jit drops parameters a program does not use, e.g. the MTP blocks
from plain decode, from its arguments, but the engine keeps them); `fits` needs both the strict total
and engine_total within HBM. To the budget: `min_bytes_per_step` (`min_step_bytes` below, the closed form of
docs/inference.md "Decode and prefill on a pod"), `bytes_over_min` = bytes_accessed / min_bytes_per_step,
`hbm_roofline_step_seconds` = min_bytes_per_step / HBM bandwidth, and for decode `tpot_s` (the estimated
step: one token per sequence) and `output_tokens_per_s_per_chip` beside their roofline values.
"""

from __future__ import annotations

import dataclasses
import math

PROGRAMS = ("train", "decode", "prefill", "step")
SPECULATIVE = ("none", "mtp")
KV_CACHES = ("slots", "paged")
PREFILL_CHUNK = 512          # serve.Engine's default prefill_chunk: prompt tokens a row prefills per call
PAGE_SIZE = 64               # --kv_cache=paged: positions a page
HEADROOM = 1.25              # --kv_cache=paged: pool = HEADROOM x batch x mean context (the lengths' spread)
RESERVE_GIB = 6.0            # --batch=auto: HBM a chip kept for the step's temporaries


@dataclasses.dataclass(frozen=True)
class ServeAotConfig:
    """What --set reaches for a serving program: model.FIELD (ModelConfig) only."""
    model: object


def resolve_serving(program: str, preset_name: str, topology: str, *, mesh: str | None = None,
                    batch: int | str | None = None, max_model_len: int | None = None, speculative: str = "none",
                    num_draft: int = 2, prefill_chunk: int = PREFILL_CHUNK, overrides: tuple[str, ...] = (),
                    kv_cache: str = "slots", mean_context: int | None = None, page_size: int = PAGE_SIZE) -> dict:
    """The serving program to compile; every check that needs no compiler (AotError, MeshError).
    kv_cache="paged": the paged runtime's step (`paged_resolve`)."""
    from glm5_jax.config import PRESETS, ConfigError, preset
    from glm5_jax.overrides import OverrideError, apply_overrides
    from glm5_jax.parallel.plan import abstract_mesh
    from glm5_jax.sharding import MeshError, check_serving_mesh, parse_mesh_spec, resolve_mesh_shape
    from tools.tpu_compile import CHIPS, AotError, parse_topology

    if program not in ("decode", "prefill", "step"):
        raise AotError(f"--program={program!r}; allowed: {', '.join(PROGRAMS)}")
    if kv_cache not in KV_CACHES:
        raise AotError(f"--kv_cache={kv_cache!r}; allowed: {', '.join(KV_CACHES)}")
    if kv_cache == "paged" and (program not in ("decode", "step") or speculative != "none"):
        raise AotError(f"--kv_cache=paged compiles --program=decode | step without speculation, not "
                       f"--program={program} --speculative={speculative}")
    if speculative != "none":
        raise AotError(f"--speculative={speculative}: the engine's MTP speculation is a step of the paged runtime "
                       "now, which tools.aot does not compile yet (docs/inference.md, known gaps); leave it out")
    if kv_cache == "slots" and (program == "step" or mean_context is not None):
        raise AotError("--program=step and --mean_context need --kv_cache=paged")
    if isinstance(batch, str):
        if batch != "auto" and not batch.isdigit():
            raise AotError(f"--batch={batch!r}: an integer or auto")
        batch = batch if batch == "auto" else int(batch)
    if batch == "auto" and kv_cache != "paged":
        raise AotError("--batch=auto needs --kv_cache=paged (the largest batch whose page pool fits)")
    if preset_name not in PRESETS:
        raise AotError(f"--preset={preset_name!r} is unknown; allowed: {', '.join(PRESETS)}")
    if speculative not in SPECULATIVE:
        raise AotError(f"--speculative={speculative!r}; allowed: {', '.join(SPECULATIVE)}")
    kind, shape = parse_topology(topology)
    n_dev = math.prod(shape)
    mesh = mesh or f"expert:{n_dev}"
    try:
        sizes = resolve_mesh_shape(parse_mesh_spec(mesh), n_dev)
    except MeshError as e:
        raise AotError(f"--mesh={mesh!r} on --topology={topology} ({n_dev} devices): {e}") from e
    try:
        cfg = apply_overrides(ServeAotConfig(preset(preset_name)), tuple(overrides)).model
    except (OverrideError, ConfigError) as e:
        raise AotError(str(e)) from e
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if kv_cache == "paged":
        return paged_resolve(program, preset_name, topology, kind, n_dev, sizes, cfg, shards, batch=batch,
                             max_model_len=max_model_len or 131072, mean_context=mean_context,
                             page_size=page_size, prefill_chunk=prefill_chunk)
    batch = batch or shards
    max_model_len = max_model_len or 4096
    if max_model_len < 2 or batch < 1:
        raise AotError(f"--max_model_len={max_model_len} must be >= 2 and --batch={batch} >= 1")
    if prefill_chunk < 1:
        raise AotError(f"--prefill_chunk={prefill_chunk} must be >= 1")
    n = int(num_draft) if speculative == "mtp" else 0
    if n:
        from glm5_jax.infer.speculative import check_num_draft
        try:
            check_num_draft(cfg, n)
        except ValueError as e:
            raise AotError(f"--speculative=mtp --num_draft={num_draft}: {e}") from e
    check_serving_mesh(cfg, abstract_mesh(sizes), batch)          # MeshError: a Glm5Error, exit 2
    return {"program": program, "program_name": ("spec_" if n else "") + program, "preset": preset_name,
            "topology": topology, "chip": kind, "devices": n_dev,
            "mesh": sizes, "model": cfg, "batch": int(batch), "max_model_len": int(max_model_len),
            # the engine's cache: the last verification writes up to n + 1 slots past the context
            "cache_size": int(max_model_len) + (n + 2 if n else 0), "num_draft": n, "shards": shards,
            "prefill_width": min(int(prefill_chunk), int(max_model_len) - 1), "hbm_bytes": CHIPS[kind][0],
            "kv_cache": "slots"}


def paged_resolve(program, preset_name, topology, kind, n_dev, sizes, cfg, shards, *, batch, max_model_len,
                  mean_context, page_size, prefill_chunk) -> dict:
    """--kv_cache=paged: the paged runtime's step (`Programs.paged_step`, echo off) for sequences of mean
    context L = mean_context: a pool of HEADROOM x batch x L positions in pages of `page_size` (the headroom
    for the spread of lengths around the mean), page tables of the runtime's width for HEADROOM x L
    (`runtime.page_table_widths` with that width among its widths: the smallest >= it). decode: one token
    row per sequence (`batch` rows); step: each batch shard's decodes plus one prefill chunk of
    `prefill_chunk` rows (shards x (batch / shards + chunk) rows). batch="auto": the largest multiple of the
    batch shards whose pool fits in a chip's HBM beside the weights (as laid out) and RESERVE_GIB."""
    import jax

    from glm5_jax.infer import cache as kv
    from glm5_jax.infer.programs import serving_config
    from glm5_jax.infer.runtime import page_table_widths
    from glm5_jax.model import abstract_params
    from glm5_jax.parallel.plan import abstract_mesh
    from glm5_jax.sharding import SERVE_RULES, check_serving_mesh, param_shardings
    from tools.tpu_compile import CHIPS, AotError
    import flax.linen as nn

    if not mean_context or not 1 <= mean_context < max_model_len:
        raise AotError(f"--kv_cache=paged needs --mean_context in 1 .. --max_model_len - 1 ({max_model_len - 1}), "
                       f"got {mean_context}")
    if page_size < 1 or prefill_chunk < 1:
        raise AotError(f"--page_size={page_size} and --prefill_chunk={prefill_chunk} must be >= 1")
    amesh, hbm = abstract_mesh(sizes), CHIPS[kind][0]
    scfg = serving_config(cfg, amesh)
    params = nn.unbox(abstract_params(scfg))
    shard = lambda a, s: math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
    weights = sum(jax.tree.leaves(jax.tree.map(shard, params, param_shardings(scfg, amesh, SERVE_RULES))))
    one = jax.eval_shape(lambda: kv.init_cache(scfg, 1, 1)["layers"])
    per_token = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(one))      # every layer's pool bytes
    table_len = -(-max_model_len // page_size)
    need = -(-math.ceil(HEADROOM * mean_context) // page_size)
    table = next(t for t in page_table_widths(scfg, table_len, page_size, (need,)) if t >= need)
    auto = batch == "auto"
    if auto:
        per_seq = HEADROOM * mean_context * per_token                  # one sequence's share of a chip's pool
        b = int((hbm - weights - RESERVE_GIB * 2**30) // per_seq)
        if b < 1:
            raise AotError(f"--batch=auto: the weights ({weights / 2**30:.2f} GiB a chip) leave no room for one "
                           f"sequence of mean context {mean_context} on {kind}")
        batch = b * shards
    batch = int(batch or shards)
    check_serving_mesh(cfg, amesh, batch)
    num_pages = -(-math.ceil(HEADROOM * batch * mean_context / page_size) // shards) * shards
    width = batch if program == "decode" else shards * (batch // shards + prefill_chunk)
    return {"program": program, "program_name": "paged_" + program, "preset": preset_name, "topology": topology,
            "chip": kind, "devices": n_dev, "mesh": sizes, "model": cfg, "batch": batch,
            "max_model_len": int(max_model_len), "cache_size": table * page_size, "num_draft": 0, "shards": shards,
            "prefill_width": prefill_chunk if program == "step" else 0, "hbm_bytes": hbm, "kv_cache": "paged",
            "paged": {"mean_context": int(mean_context), "page_size": int(page_size), "headroom": HEADROOM,
                      "num_pages": num_pages, "pool_tokens": num_pages * page_size, "table_pages": table,
                      "width": width, "batch_auto": auto, "weights_bytes_planned": int(weights),
                      "pool_bytes_per_token": int(per_token), "reserve_gib": RESERVE_GIB if auto else None}}


def _shard_bytes(tree) -> int:
    """Bytes one device holds of ShapeDtypeStructs that carry shardings (device 0's shard of each)."""
    import jax
    return int(sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree)))


def _is_routed(path: str) -> bool:
    return "/experts/" in path and "shared_experts" not in path


def min_step_bytes(cfg, params, *, tokens: int, queries: int, rows: int, context: int, mtp_depths: int = 0) -> dict:
    """The HBM bytes one chip must read (and write) in one step of a serving program, at the floor:

    weights: every parameter shard the chip holds is read once, except the embedding table (only the
      step's `tokens` rows are gathered) and the MTP blocks (read only when `mtp_depths` > 0, once: the
      depths share them); a routed-expert shard is read only if one of the step's `tokens` routes to
      it: each local expert with probability 1 - (1 - k / E)^tokens under balanced routing;
    cache: for each of the chip's `rows` sequences at `context` cached positions, every attention layer
      (and each MTP depth) reads, for `queries` new tokens, dense MLA / MHA: all `context` rows of its
      cache; DSA: the indexer keys of all `context` positions (full-indexer layers) and the
      min(context, queries x index_topk) selected [latent | k_rope] rows; and writes `queries` new rows.
    `params`: the parameters' ShapeDtypeStructs with their serving shardings (the chip's shard sizes)."""
    import jax

    from glm5_jax.layers.common import dtype_of
    itemsize = jax.numpy.dtype(dtype_of(cfg.dtype)).itemsize
    by = {"attention_and_dense": 0.0, "routed_experts": 0.0, "embedding_rows": 0.0, "mtp": 0.0}
    hit = 1.0 - (1.0 - cfg.experts_per_tok / cfg.num_experts) ** tokens if cfg.num_experts else 1.0
    for kp, a in jax.tree_util.tree_leaves_with_path(params):
        path = "/".join(str(getattr(k, "key", k)) for k in kp)
        b = math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
        if path.startswith("embed/"):
            by["embedding_rows"] += min(tokens, a.shape[0]) * a.shape[1] * a.dtype.itemsize
        elif path.startswith("mtp_"):
            by["mtp"] += (b * (hit if _is_routed(path) else 1.0)) if mtp_depths else 0.0
        else:
            by["routed_experts" if _is_routed(path) else "attention_and_dense"] += b * (hit if _is_routed(path) else 1.0)
    types = cfg.layer_indexer_types or ("full",) * cfg.num_layers
    layers = [t == "full" for t in types] + [cfg.attention == "dsa"] * mtp_depths    # per layer: reads index keys
    if cfg.is_mla:
        row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize
        sel = min(context, queries * cfg.index_topk) if cfg.attention == "dsa" else context
        idx = cfg.index_head_dim * itemsize if cfg.attention == "dsa" else 0
        per_row = sum(sel * row + (context * idx if full else 0) + queries * (row + (idx if full else 0))
                      for full in layers)
    else:
        row = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
        per_row = len(layers) * (context + queries) * row
    by["cache_rows"] = float(rows * per_row)
    total = sum(by.values())
    return {"min_bytes_per_step": total, "min_bytes_by_part": by, "routed_expert_hit_fraction": hit,
            "cache_share": by["cache_rows"] / total if total else 0.0}


def forward_flops_per_token(cfg, context: int) -> float:
    """Model FLOPs of one new token at `context` cached positions: 2 x active matmul params + attention
    and indexer scores over its keys (glm5_jax.flops.estimate, whose attention averages (T + 1) / 2 keys:
    T = 2 context - 1 gives `context` keys)."""
    from glm5_jax.flops import estimate
    e = estimate(cfg, 2 * context - 1)
    return 2.0 * (e["active_params"] - cfg.vocab_size * cfg.d_model) + e["attention_flops_per_token_fwd"] \
        + e["indexer_flops_per_token_fwd"]


def compile_serving(r: dict, *, log=None, save_hlo: str | None = None) -> dict:
    """Lower and compile a resolve_serving()d program for its topology -> the report's compiled part."""
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from glm5_jax.infer.programs import Programs
    from glm5_jax.sharding import MESH_AXES
    from tools.tpu_compile import compile_lowered, memory_report, topology_devices
    from tools.budget import CHIP_PEAKS, step_budget

    log = log or (lambda msg: None)
    sizes = r["mesh"]
    mesh = Mesh(np.asarray(topology_devices(r["topology"])).reshape([sizes[a] for a in MESH_AXES]), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))
    n = r["num_draft"]
    paged = r.get("paged")
    pr = Programs(r["model"], mesh, max_batch=r["batch"], size=paged["page_size"] if paged else r["cache_size"],
                  num_draft=n)
    cfg, b, ctx = pr.config, r["batch"], r["cache_size"]
    if paged:       # the runtime's step: decodes (one row a sequence) [+ a prefill chunk a batch shard]
        w, ctx = paged["width"], paged["mean_context"]
        name, fn = r["program_name"], pr.paged_step(paged["num_pages"], paged["page_size"], w, False)
        args = pr.abstract_args("paged_step", width=w, num_pages=paged["num_pages"], page_size=paged["page_size"],
                                table=paged["table_pages"])
        tokens, queries, rows = w, 1, b // pr.shards
    elif r["program"] == "decode":
        name = r["program_name"]
        fn, args = (pr.spec_decode(True), pr.abstract_args("spec_decode")) if n else \
            (pr.decode(), pr.abstract_args("decode"))
        tokens, queries, rows = b * (n + 1 if n else 1), n + 1 if n else 1, b // pr.shards
    else:
        w = r["prefill_width"]
        name, fn, args = "prefill", pr.prefill(w, w, False), pr.abstract_args("prefill", width=w, chunk=w)
        if n:   # the engine prefills with spec_prefill: also the MTP caches, trunk hidden states and tokens
            a, state = args, pr.abstract_args("spec_decode")[1]
            name, fn = r["program_name"], pr.spec_prefill(w, w)
            args = (a[0], state, a[2], a[3], a[4]) + a[6:]       # spec_prefill takes no echo targets
        tokens, queries, rows = pr.shards * w, w, 1
    log(f"{name}: {b} sequences x {ctx} positions on {pr.shards} batch shards; lowering")
    compiled, lower_s, compile_s = compile_lowered(lambda: pr.call(fn.lower, *args), log=log, save_hlo=save_hlo)
    mem = memory_report(compiled)
    state = args[1]
    pd = mem["per_device_bytes"]
    pd.update(weights=_shard_bytes(args[0]), cache=_shard_bytes(state))
    # what the engine holds while this program runs: every parameter (jit prunes the ones a program does not
    # use, e.g. the MTP blocks from plain decode, from its arguments; the engine keeps them), its state and
    # the program's temporaries
    pd["engine_total"] = pd["weights"] + pd["cache"] + pd["temporaries"]
    model_flops = tokens * forward_flops_per_token(r["model"], ctx) / r["devices"]
    budget = step_budget(compiled, r["chip"], model_flops)
    floor = min_step_bytes(cfg, args[0], tokens=tokens, queries=queries, rows=rows, context=ctx,
                           mtp_depths=n)
    if paged and r["program"] == "step":   # + each shard's prefill chunk: `chunk` queries of one sequence at L
        chunk = min_step_bytes(cfg, args[0], tokens=tokens, queries=r["prefill_width"], rows=1, context=ctx)
        floor["min_bytes_by_part"]["cache_rows"] += chunk["min_bytes_by_part"]["cache_rows"]
        floor["min_bytes_per_step"] += chunk["min_bytes_by_part"]["cache_rows"]
        floor["cache_share"] = floor["min_bytes_by_part"]["cache_rows"] / floor["min_bytes_per_step"]
    hbm_bw = CHIP_PEAKS[r["chip"]]["hbm_bytes_per_s"]
    roof = floor["min_bytes_per_step"] / hbm_bw
    budget.update(floor, bytes_over_min=round(budget["bytes_accessed"] / floor["min_bytes_per_step"], 4),
                  hbm_roofline_step_seconds=roof, tokens_per_step_per_chip=tokens / r["devices"])
    step = budget["estimated_step_seconds"]
    if r["program"] in ("decode", "step"):
        # one verified token per sequence per step (with MTP: the floor, every draft rejected)
        budget.update(tpot_s=step, output_tokens_per_s_per_chip=b / r["devices"] / step if step else None,
                      roofline_tpot_s=roof, roofline_output_tokens_per_s_per_chip=b / r["devices"] / roof)
        if n:
            budget["tpot_s_all_drafts_accepted"] = step / (n + 1)
    if r["program"] != "decode":
        p_tok = tokens if r["program"] == "prefill" else pr.shards * r["prefill_width"]
        budget.update(prefill_tokens_per_s_per_chip=p_tok / r["devices"] / step if step else None)
    return {**mem, "lower_seconds": round(lower_s, 1), "compile_seconds": round(compile_s, 1),
            "batch_shards": pr.shards, "sequences_per_shard": pr.per_shard, "budget": budget,
            "serving_config": {"moe_impl": cfg.moe_impl, "moe_capacity_factor": cfg.moe_capacity_factor}}


def format_serving(p: dict) -> list[str]:
    """The human-readable lines of a serving program's report (tools.aot.format_report adds memory)."""
    b = p.get("budget")
    if not b:
        return []
    gib = b["min_bytes_per_step"] / 2**30
    lines = [f"  floor (docs/inference.md): {gib:.2f} GiB a step (cache rows {b['cache_share']:.1%}); compiled / "
             f"floor = {b['bytes_over_min']}; HBM roofline {b['hbm_roofline_step_seconds'] * 1e3:.2f} ms"]
    if "tpot_s" in b:
        lines.append(f"  TPOT ~{b['tpot_s'] * 1e3:.2f} ms -> {b['output_tokens_per_s_per_chip']:.1f} output tokens/s "
                     f"a chip (roofline {b['roofline_tpot_s'] * 1e3:.2f} ms, "
                     f"{b['roofline_output_tokens_per_s_per_chip']:.1f} tokens/s)")
    else:
        lines.append(f"  prefill ~{b['prefill_tokens_per_s_per_chip']:.0f} prompt tokens/s a chip")
    return lines
