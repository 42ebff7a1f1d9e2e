"""The train step's side of tools.aot: flag defaults that were compiled and fit, resolve() to a config, and
compile_step() (lower the one train step, or another program of the same factory, for a TPU topology and
read its memory). tools.aot (the CLI) and tools.aot_rl (the RL phases) both build on it, so neither imports
the other's module at its level."""

from __future__ import annotations

import dataclasses
import math
import sys
import time

from glm5_jax.config import REMAT_POLICIES
from tools.tpu_compile import CHIPS, AotError, DoesNotFit, compile_lowered, memory_report, parse_topology, topology_devices

# (preset, topology) or (preset, topology, seq_len) -> flag defaults that were compiled and fit (see
# docs/scaleout.md). With --seq_len the (preset, topology, seq_len) entry wins over (preset, topology).
# Flags given on the command line win; `set` entries come before the command line's --set.
DEFAULTS: dict[tuple, dict] = {
    # all 78 layers, 128 x 4096 tokens per step; why each choice: docs/scaleout.md
    # remat custom: the mid-layer residual, the attention output and the routed experts' gate / up outputs
    # kept in host memory, so the backward recomputes no grouped matmul (87.5 GiB, useful 0.712)
    ("glm5", "v5p:4x4x8"): {"mesh": "fsdp:4,expert:32", "batch_size": 128, "seq_len": 4096, "remat": "custom",
                            "set": ("model.moe_impl=a2a", "model.remat_custom=decoder_layer_mid:offload,"
                                    "attn_context:offload,expert_gate:offload,expert_up:offload")},
    # 128K: 16 x 131072 tokens, each sequence over context 8, the batch over expert 16 (16K tokens a chip);
    # the scanned layers' saved inputs in host memory (remat offload): 69.4 GiB by the strict formula
    # (remat full: 112.6 GiB): docs/scaleout.md, long-context table
    # remat custom = offload + DSA's top-k indices and the attention output in host memory, its log-sum-exp on the
    # device (the backward runs neither the indexer nor the sparse attention's forward); the sparse attention in
    # Pallas (its TPU backward fuses the dK scatter-add), the indexer's top-k in jnp
    ("glm5", "v5p:4x4x8", 131072): {"mesh": "expert:16,context:8", "batch_size": 16, "seq_len": 131072,
                                    "remat": "custom", "set": ("model.moe_impl=a2a", "model.moe_token_chunk=2048",
                                                             "train.logits_chunk=1024", "model.attention_impl=pallas",
                                                             "model.indexer_impl=xla",
                                                             "model.remat_custom=decoder_layer_input:offload,"
                                                             "attn_topk:offload,attn_context:offload,attn_lse:device")},
    # GLM-5's full context: 16 x 202752 tokens on 128 chips (25,344 tokens a chip), the layer inputs on the
    # host: 82.9 GiB strict (docs/scaleout.md); and on 256 chips (12,672 a chip) with remat full, 85.7 GiB
    ("glm5", "v5p:4x4x8", 202752): {"mesh": "expert:16,context:8", "batch_size": 16, "seq_len": 202752,
                                    "remat": "offload", "set": ("model.moe_impl=a2a", "model.moe_token_chunk=2048",
                                                                "train.logits_chunk=1024")},
    # float32 master weights (--set model.param_dtype=float32): 256 chips, 4096 tokens a chip as on 4x4x8; AdamW
    # (float32 moments) 79.9 GiB, muon_split (float32 momentum) in docs/scaleout.md, "Float32 master weights"
    ("glm5", "v5p:4x8x8"): {"mesh": "fsdp:8,expert:32", "batch_size": 256, "seq_len": 4096, "remat": "full",
                            "set": ("model.moe_impl=a2a",)},
    ("glm5", "v5p:4x8x8", 202752): {"mesh": "expert:16,context:16", "batch_size": 16, "seq_len": 202752,
                                    "remat": "full", "set": ("model.moe_impl=a2a", "model.moe_token_chunk=2048",
                                                             "train.logits_chunk=1024")},
}


def defaults_for(preset_name: str, topology: str, seq_len: int | None) -> dict:
    """DEFAULTS for (preset, topology, seq_len) if there is such an entry, else (preset, topology)."""
    if seq_len is not None and (preset_name, topology, seq_len) in DEFAULTS:
        return DEFAULTS[(preset_name, topology, seq_len)]
    d = DEFAULTS.get((preset_name, topology), {})
    if seq_len is not None and d.get("seq_len") not in (None, seq_len):
        # a long-context row must not inherit a short-context mesh silently: keep its sequence length
        return {**d, "seq_len": seq_len}
    return d


def _log(t0: float, msg: str) -> None:
    print(f"[aot {time.time() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class AotConfig:
    """What --set reaches: model.FIELD (ModelConfig) and train.FIELD (TrainConfig)."""
    model: object
    train: object


def resolve(preset_name: str, topology: str, mesh: str | None = None, batch_size: int | None = None,
            seq_len: int | None = None, remat: str | None = None, optimizer: str | None = None,
            grad_accum: int | None = None, overrides: tuple[str, ...] = ()) -> dict:
    """The configuration to compile: flags > DEFAULTS[(preset, topology)] > generic defaults.
    Checks everything that can be checked without the compiler (AotError / ConfigError / MeshError)."""
    from glm5_jax.overrides import OverrideError, apply_overrides
    from glm5_jax.config import PRESETS, ConfigError, preset
    from glm5_jax.sharding import MeshError, check_model_fits_mesh, parse_mesh_spec, resolve_mesh_shape
    from glm5_jax.train.config import TrainConfig

    if preset_name not in PRESETS:
        raise AotError(f"--preset={preset_name!r} is unknown; allowed: {', '.join(PRESETS)}")
    kind, shape = parse_topology(topology)
    n_dev = math.prod(shape)
    d = defaults_for(preset_name, topology, seq_len)
    mesh = mesh or d.get("mesh") or f"fsdp:{n_dev}"
    remat = remat or d.get("remat")
    if remat is not None and remat not in REMAT_POLICIES:
        raise AotError(f"--remat={remat!r}; allowed: {', '.join(REMAT_POLICIES)}")
    try:
        sizes = resolve_mesh_shape(parse_mesh_spec(mesh), n_dev)
    except MeshError as e:
        raise AotError(f"--mesh={mesh!r} on --topology={topology} ({n_dev} devices): {e}") from e
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    batch_size = batch_size or d.get("batch_size") or shards
    seq_len = seq_len or d.get("seq_len") or 4096
    cfg = preset(preset_name)
    if remat is not None:
        cfg = cfg.replace(remat=remat)
    try:
        train = TrainConfig(batch_size=batch_size, seq_len=seq_len, steps=1000,
                            optimizer=optimizer or d.get("optimizer", "adamw"),
                            grad_accum=grad_accum or d.get("grad_accum", 1))
        # a DEFAULTS row's remat_custom belongs to its remat="custom": another --remat drops it
        dset = tuple(x for x in d.get("set", ()) if remat == "custom" or not x.startswith("model.remat_custom="))
        conf = apply_overrides(AotConfig(cfg, train), dset + tuple(overrides))
    except (OverrideError, ConfigError) as e:
        raise AotError(str(e)) from e
    micro = conf.train.batch_size // conf.train.grad_accum
    check_model_fits_mesh(conf.model, sizes, micro, seq_len=conf.train.seq_len)  # micro-batch over the batch axes
    return {"preset": preset_name, "topology": topology, "chip": kind, "devices": n_dev, "mesh": sizes,
            "model": conf.model, "train": conf.train, "hbm_bytes": CHIPS[kind][0]}


def plan_estimate(model_cfg, tcfg, sizes) -> dict:
    """tools.plan's per-device figures for the same config (params/optimizer exact, activations
    estimated analytically)."""
    from glm5_jax.parallel.plan import plan
    p = plan(model_cfg, sizes, batch_size=tcfg.batch_size, seq_len=tcfg.seq_len, optimizer=tcfg.optimizer,
             activations="estimate", logits_chunk=tcfg.logits_chunk)
    return {"per_device_bytes": p["per_device_bytes"], "activations_source": p["sources"]["activations"],
            **({"host_bytes": p["host_bytes"]} if "host_bytes" in p else {})}


def compile_step(r: dict, *, log=None, save_hlo: str | None = None, program=None, mesh=None) -> dict:
    """Lower and compile the train step of a resolve()d config for its topology. Returns the report
    (per_device_bytes, compile_seconds, ...) without the plan estimate. program(cfg, tcfg, mesh) ->
    (abstract state, step, abstract batch): another step of the one step factory (tools.aot_rl: the RL
    update); mesh: the topology's Mesh when the caller built it (its devices shared with other programs)."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from glm5_jax.sharding import MESH_AXES
    from glm5_jax.train.state import abstract_batch, abstract_state, per_device_bytes
    from glm5_jax.train.step import make_train_step
    from tools.budget import model_flops_per_device, step_budget

    log = log or (lambda msg: None)
    sizes = r["mesh"]
    if mesh is None:
        mesh = Mesh(np.asarray(topology_devices(r["topology"])).reshape([sizes[a] for a in MESH_AXES]), MESH_AXES,
                    axis_types=(AxisType.Auto,) * len(MESH_AXES))
    cfg, tcfg = r["model"], r["train"]
    t = time.time()
    if program is None:
        state, tx = abstract_state(cfg, tcfg, mesh)
        step = make_train_step(cfg, tcfg, tx, mesh)
        batch = abstract_batch(tcfg.batch_size, tcfg.seq_len, mesh)
    else:
        state, step, batch = program(cfg, tcfg, mesh)
    log(f"abstract state built ({time.time() - t:.1f}s); lowering")
    compiled, lower_s, compile_s = compile_lowered(lambda: step.lower(state, batch), log=log, save_hlo=save_hlo)
    t = time.time()
    budget = step_budget(compiled, r["chip"], model_flops_per_device(cfg, tcfg.batch_size, tcfg.seq_len,
                                                                     r["devices"]))
    # the same budget against the model without its MTP blocks (the count before issue 42 left them out)
    from glm5_jax.flops import estimate
    main = estimate(cfg, tcfg.seq_len)
    main = budget["model_flops"] * main["main_train_flops_per_token"] / main["train_flops_per_token"]
    budget["model_flops_without_mtp"] = main
    budget["useful_flops_fraction_without_mtp"] = round(main / budget["compiled_flops"], 4) if budget["compiled_flops"] else None
    log(f"budget read off the compiled HLO in {time.time() - t:.1f}s")
    return {
        **memory_report(compiled),
        "state_bytes": {"params": per_device_bytes(state["params"]),
                        "optimizer": per_device_bytes(state["opt_state"])},
        "lower_seconds": round(lower_s, 1), "compile_seconds": round(compile_s, 1),
        "num_params": int(sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state["params"]))),
        # Muon / Muon Split on > 1 device: Newton-Schulz where each matrix's shards live (glm5_jax.optim.distributed)
        "muon_distributed": tcfg.optimizer in ("muon", "muon_split") and r["devices"] > 1,
        "budget": budget,
    }


def _not_fit(e: DoesNotFit) -> dict:
    """No executable, so no memory analysis or budget: the compiler's own figures and message instead."""
    return {"per_device_bytes": {"temporaries": e.temporaries} if e.temporaries else {},
            "compiler_hbm_bytes": e.available, "compile_error": str(e).strip().splitlines()[-1][:2000],
            "lower_seconds": round(e.lower_s, 1), "compile_seconds": round(e.compile_s, 1),
            "total_formula": "the compiler stopped at buffer assignment: temporaries alone exceed HBM"}


def _fits(out: dict, hbm: int) -> bool:
    return "compile_error" not in out and out["per_device_bytes"]["total"] <= hbm
