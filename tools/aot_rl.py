"""tools.aot --program=rl: the colocated RL step's programs compiled for a TPU topology (docs/rl.md).

    python -m tools.aot --program=rl --preset=glm5 --topology=v5p:4x4x8 [--mesh=fsdp:4,expert:32]
        [--rollout_mesh=expert:128] [--prompts_per_step=128] [--group_size=8] [--prompt_len=1024]
        [--max_new_tokens=3072] [--minibatches=8] [--response_len_median=1024] [--response_len_sigma=0.8]
        [--rollout_prefill_chunk=128] [--[no]offload_optimizer] [--mismatch=none]
        [--phases=update,reshard,rollout_prefill,rollout] [--set model.FIELD=V ...] --json

Defaults for (glm5, v5p:4x4x8) in RL_DEFAULTS (the figures in docs/rl.md): the values in brackets, with
the optimizer state on the host during the reshard and the rollouts.

One colocated GRPO / IcePop step (``glm5_jax.rl.program.run_grpo``) on one slice, its phases compiled by
the TPU compiler from abstract arguments (nothing allocated), each through the machinery the other
programs use (``tools.tpu_compile.compile_lowered`` / ``memory_report``, ``tools.budget.step_budget``):

* ``reshard``: ``RolloutEngine.sync_program()``, the training-layout policy -> the serving-layout rollout
  copy, device to device (the mismatch mode's fake quantisation inside; "none": the identity);
* ``rollout_prefill`` / ``rollout``: ``RolloutEngine.lower("prefill" | "decode")``, the rollout engine's own
  programs: the generation runtime's step (``Programs.paged_step``, row-keyed sampling, the full page table)
  at the width of a prefill step (the batch runtime's token budget, ``RolloutEngine.runtime_args``; the
  prompts take ``prefill_steps`` of them) and of a decode step (one token of every row); each estimate is
  one step's;
* ``update``: ``rl.program.make_update_step`` (the one train step with the RL loss, ``make_rl_optimizer``)
  through ``tools.aot.compile_step`` on one minibatch (``--minibatches`` of them a step).

The training state and the rollout engine share the chips; the rollout engine has its own mesh over the
same devices (default: every chip on ``expert``, the serving layout). Each phase's ``per_device_bytes``
is its program's (``memory_report``) plus ``resident``, what the other phase keeps on the chip meanwhile:
during the reshard and the rollout the training state (params + optimizer state; the optimizer state is
on the host with ``--offload_optimizer``, ``RLConfig.offload_optimizer`` in the run), during the update nothing (the rollout copy and the cache are
released); ``total`` = program total + resident, ``program_total`` the program's alone.

``estimated_rl_step_seconds`` (ESTIMATES, from the compiled programs' rooflines, perfect overlap):
rollout (prefill steps x the prefill step + decode steps x the decode step) + reshard + old log-probs (a forward of the
batch: a third of the update, not compiled) + update (minibatches x the update step) [+ the optimizer
state to the host and back over ``HOST_BYTES_PER_S`` with --offload_optimizer]. Decode steps: the batch
decodes until its longest row stops, so E[max over the B rows] of the response lengths, which are
log-normal (median, sigma) capped at --max_new_tokens; each step is costed at the full cache.
"""

from __future__ import annotations

import math
import time

from tools.tpu_compile import AotError, DoesNotFit, compile_lowered, memory_report, parse_topology, topology_devices

# (preset, topology) -> RL flag defaults (docs/rl.md, "Compiled for a pod"); the update's mesh and remat
# come from tools.aot.DEFAULTS (the train step measured to fit), with the minibatch and sequence below
RL_DEFAULTS: dict[tuple, dict] = {
    ("glm5", "v5p:4x4x8"): {"prompts_per_step": 128, "group_size": 8, "prompt_len": 1024, "max_new_tokens": 3072,
                            # the optimizer state on the host during reshard and rollouts: with it on the
                            # chips the rollout prefill needs 97.4 GiB a chip (3fe4b39, docs/rl.md)
                            "minibatches": 8, "rollout_prefill_chunk": 128, "offload_optimizer": True},
}
GENERIC = {"offload_optimizer": False, "rollout_prefill_chunk": None, "prompts_per_step": None, "group_size": 8,
           "prompt_len": 1024, "max_new_tokens": 3072, "minibatches": 1,
           "response_len_median": 1024, "response_len_sigma": 0.8, "mismatch": "none"}
# host <-> chip bytes/s assumed for moving the optimizer state (v5p PCIe Gen4 x16 per chip, ~32 GB/s a
# direction nominal; a stated assumption, not a measurement)
HOST_BYTES_PER_S = 25e9
PHASES = ("update", "reshard", "rollout_prefill", "rollout")


def response_length_stats(rows: int, cap: int, median: float, sigma: float) -> dict:
    """Log-normal(median, sigma) response lengths capped at `cap` tokens: the mean length and the expected
    longest of `rows` iid rows (E[max] = sum over x < cap of 1 - F(x)^rows: what a batch decodes)."""
    def cdf(x):
        return 0.5 * (1 + math.erf((math.log(x) - math.log(median)) / (sigma * math.sqrt(2)))) if x > 0 else 0.0
    f = [cdf(x) for x in range(cap)]
    return {"rows": rows, "cap": cap, "median": median, "sigma": sigma,
            "mean_tokens": sum(1 - v for v in f), "expected_decode_steps": sum(1 - v ** rows for v in f)}


def resolve_rl(preset_name: str, topology: str, *, mesh=None, rollout_mesh=None, remat=None, overrides=(),
               prompts_per_step=None, group_size=None, prompt_len=None, max_new_tokens=None, minibatches=None,
               response_len_median=None, response_len_sigma=None, mismatch=None, offload_optimizer=None,
               rollout_prefill_chunk=None, phases=None) -> dict:
    """The RL step to compile: the update's config through tools.aot.resolve (DEFAULTS), the rollout's
    settings; every check that needs no compiler (AotError)."""
    from glm5_jax.rl.rollout import MISMATCH_MODES
    from glm5_jax.sharding import MeshError, parse_mesh_spec, resolve_mesh_shape
    from tools.aot_train import resolve
    kind, shape = parse_topology(topology)
    n_dev = math.prod(shape)
    given = dict(prompts_per_step=prompts_per_step, group_size=group_size, prompt_len=prompt_len,
                 max_new_tokens=max_new_tokens, minibatches=minibatches, response_len_median=response_len_median,
                 response_len_sigma=response_len_sigma, mismatch=mismatch, rollout_prefill_chunk=rollout_prefill_chunk,
                 offload_optimizer=offload_optimizer)
    d = {**GENERIC, **RL_DEFAULTS.get((preset_name, topology), {})}
    s = {k: (v if v is not None else d[k]) for k, v in given.items()}
    rollout_mesh = rollout_mesh or f"expert:{n_dev}"
    try:
        rsizes = resolve_mesh_shape(parse_mesh_spec(rollout_mesh), n_dev)
    except MeshError as e:
        raise AotError(f"--rollout_mesh={rollout_mesh!r} on --topology={topology} ({n_dev} devices): {e}") from e
    shards = rsizes["data"] * rsizes["fsdp"] * rsizes["expert"]
    s["prompts_per_step"] = s["prompts_per_step"] or max(1, shards // s["group_size"])
    phases = tuple(phases or PHASES)
    if not set(phases) <= set(PHASES):
        raise AotError(f"--phases={','.join(phases)}; allowed: {', '.join(PHASES)}")
    if s["rollout_prefill_chunk"] is not None and int(s["rollout_prefill_chunk"]) < 1:
        raise AotError(f"--rollout_prefill_chunk={s['rollout_prefill_chunk']} must be >= 1")
    for k in ("prompts_per_step", "group_size", "prompt_len", "max_new_tokens", "minibatches"):
        if int(s[k]) < 1:
            raise AotError(f"--{k}={s[k]} must be >= 1")
    if s["mismatch"] not in MISMATCH_MODES:
        raise AotError(f"--mismatch={s['mismatch']!r}; allowed: {', '.join(MISMATCH_MODES)}")
    if not (s["response_len_median"] > 0 and s["response_len_sigma"] > 0):
        raise AotError("--response_len_median and --response_len_sigma must be > 0")
    rows = s["prompts_per_step"] * s["group_size"]
    if rows % shards:
        raise AotError(f"{rows} rollouts a step (--prompts_per_step x --group_size) do not split over the rollout "
                       f"mesh's {shards} batch shards ({rollout_mesh}): use a multiple of {shards}")
    if rows % s["minibatches"]:
        raise AotError(f"--minibatches={s['minibatches']} does not divide the {rows} rollouts a step")
    seq = s["prompt_len"] + s["max_new_tokens"] - 1          # rl.rollout.build_batch's row length
    r = resolve(preset_name, topology, mesh=mesh, batch_size=rows // s["minibatches"], seq_len=seq, remat=remat,
                overrides=tuple(overrides))
    return {**r, **s, "rollout_mesh": rsizes, "rollouts_per_step": rows, "update_seq_len": seq,
            "offload_optimizer": bool(s["offload_optimizer"]), "phases": phases,
            "lengths": response_length_stats(rows, s["max_new_tokens"], s["response_len_median"],
                                             s["response_len_sigma"])}


def _meshes(r: dict):
    """The training mesh and the rollout mesh over the same devices in the same order (colocated)."""
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from glm5_jax.sharding import MESH_AXES
    devices = np.asarray(topology_devices(r["topology"]))
    return tuple(Mesh(devices.reshape([sizes[a] for a in MESH_AXES]), MESH_AXES,
                      axis_types=(AxisType.Auto,) * len(MESH_AXES)) for sizes in (r["mesh"], r["rollout_mesh"]))


def _update_program(rl):
    """tools.aot.compile_step's program hook: run_grpo's update step and an abstract RL minibatch."""
    def program(cfg, tcfg, mesh):
        import jax
        import jax.numpy as jnp
        from glm5_jax.rl.program import make_rl_optimizer, make_update_step
        from glm5_jax.train.checkpoint import abstract_param_shapes
        from glm5_jax.train.state import abstract_state
        tx, _ = make_rl_optimizer(abstract_param_shapes(cfg), rl, cfg)
        state, _ = abstract_state(cfg, None, mesh, tx)
        step = make_update_step(cfg, rl, tx, mesh)
        b, t = tcfg.batch_size, tcfg.seq_len
        sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=step.batch_sharding)
        batch = {"inputs": sds((b, t), jnp.int32), "targets": sds((b, t), jnp.int32), "mask": sds((b, t), jnp.float32),
                 "old_logp": sds((b, t), jnp.float32), "infer_logp": sds((b, t), jnp.float32),
                 "advantages": sds((b,), jnp.float32)}
        return state, step, batch
    return program


def _phase(compiled_or_error, resident: int, budget=None, **extra) -> dict:
    """One phase's entry: the program's memory + what stays resident beside it, and its budget."""
    if isinstance(compiled_or_error, DoesNotFit):
        from tools.aot_train import _not_fit
        out = _not_fit(compiled_or_error)
        out["per_device_bytes"]["resident"] = resident
        return {**out, **extra}
    compiled, lower_s, compile_s = compiled_or_error
    out = memory_report(compiled)
    pd = out["per_device_bytes"]
    pd.update(program_total=pd["total"], resident=resident, total=pd["total"] + resident)
    out["total_formula"] = "program (" + out["total_formula"] + ") + resident (the other phase's arrays kept on the chip)"
    return {**out, "lower_seconds": round(lower_s, 1), "compile_seconds": round(compile_s, 1),
            **({"budget": budget(compiled)} if budget else {}), **extra}


def _compile(lower, log):
    try:
        return compile_lowered(lower, log=log)
    except DoesNotFit as e:
        return e


def compile_rl(r: dict, *, log=None) -> dict:
    """Compile the phases of a resolve_rl()d step -> the report's phases, reshard bytes and step estimate."""
    import jax

    from glm5_jax.rl.program import RLConfig
    from glm5_jax.rl.rollout_engine import RolloutEngine, reshard_bytes
    from glm5_jax.train.state import per_device_bytes
    from tools.aot_train import compile_step
    from tools.aot_serve import forward_flops_per_token
    from tools.budget import CHIP_PEAKS, step_budget

    log = log or (lambda msg: None)
    cfg, chip, n_dev = r["model"], r["chip"], r["devices"]
    train_mesh, roll_mesh = _meshes(r)
    rl = RLConfig(steps=1, prompts_per_step=r["prompts_per_step"], group_size=r["group_size"],
                  max_new_tokens=r["max_new_tokens"], max_prompt_len=r["prompt_len"], minibatches=r["minibatches"],
                  mismatch=r["mismatch"], offload_optimizer=r["offload_optimizer"])
    phases, want = {}, r["phases"]
    # update: the one train step with the RL loss, through tools.aot's compile path
    if "update" in want:
        log(f"update: {r['train'].batch_size} x {r['update_seq_len']} tokens a minibatch; lowering")
        try:
            up = compile_step(r, log=log, program=_update_program(rl), mesh=train_mesh)
            pd = up["per_device_bytes"]
            pd.update(program_total=pd["total"], resident=0)
            up["total_formula"] += " + resident 0 (rollout copy and cache released before the update)"
        except DoesNotFit as e:
            up = _phase(e, 0)
        phases["update"] = up
    state = _update_program(rl)(cfg, r["train"], train_mesh)[0]
    params_b, opt_b = per_device_bytes(state["params"]), per_device_bytes(state["opt_state"])
    resident = params_b + (0 if r["offload_optimizer"] else opt_b)
    # reshard: the rollout engine's sync program from the training layout
    chunk = r["rollout_prefill_chunk"]
    engine = RolloutEngine(cfg, roll_mesh, mismatch=r["mismatch"], **({"prefill_chunk": chunk} if chunk else {}))
    moved = reshard_bytes(state["params"], engine.param_shardings)
    if "reshard" in want:
        log(f"reshard: training layout -> serving layout ({max(moved.values()) / 2**30:.2f} GiB into a chip); "
            "lowering")
        phases["reshard"] = _phase(_compile(lambda: engine.sync_program().lower(state["params"]), log),
                                   resident - params_b, lambda c: step_budget(c, chip, 0.0))
    # rollout: the engine's prefill and decode programs on the serving copy
    b, p, n_new = r["rollouts_per_step"], r["prompt_len"], r["max_new_tokens"]
    size = p + n_new
    budget = engine.runtime_args(b, p, size)["max_num_batched_tokens"]
    pre_steps = -(-b * p // budget)
    pre_flops = budget * forward_flops_per_token(cfg, p) / n_dev
    if "rollout_prefill" in want:
        log(f"rollout_prefill: {b} prompts x {p} tokens in {pre_steps} steps of {budget} tokens; lowering")
        phases["rollout_prefill"] = _phase(_compile(lambda: engine.lower("prefill", b, p, size), log),
                                           resident, lambda c: step_budget(c, chip, pre_flops),
                                           prefill_chunk=engine.prefill_chunk, prefill_step_tokens=budget,
                                           prefill_steps=pre_steps)
    dec_flops = b * forward_flops_per_token(cfg, size) / n_dev
    if "rollout" in want:
        log(f"rollout: decode step of {b} rows at {size} cache positions; lowering")
        phases["rollout"] = _phase(_compile(lambda: engine.lower("decode", b, p, size), log), resident,
                                   lambda c: step_budget(c, chip, dec_flops),
                                   rows_per_chip=b // engine.shards, cache_positions=size)
    # the step's time, from each compiled phase's roofline
    est = {}
    if set(phases) == set(PHASES) and all("budget" in ph for ph in phases.values()):
        sec = {k: ph["budget"]["estimated_step_seconds"] for k, ph in phases.items()}
        steps = r["lengths"]["expected_decode_steps"]
        est = {"rollout": pre_steps * sec["rollout_prefill"] + steps * sec["rollout"], "reshard": sec["reshard"],
               "old_logp": r["minibatches"] * sec["update"] / 3, "update": r["minibatches"] * sec["update"],
               "optimizer_offload": 2 * opt_b / HOST_BYTES_PER_S if r["offload_optimizer"] else 0.0}
        est = {"seconds_by_part": est, "estimated_rl_step_seconds": sum(est.values()),
               "decode_step_seconds": sec["rollout"], "decode_steps": steps, "update_step_seconds": sec["update"],
               "generated_tokens_per_step": b * r["lengths"]["mean_tokens"]}
        est["generated_tokens_per_s_per_chip"] = est["generated_tokens_per_step"] / est["estimated_rl_step_seconds"] / n_dev
    hbm = r["hbm_bytes"]
    return {"phases": phases, "reshard_bytes_per_chip": int(max(moved.values())),
            "reshard_bytes_total": int(sum(moved.values())), "params_bytes_per_chip": params_b,
            "optimizer_bytes_per_chip": opt_b,
            "rollout_copy_bytes_per_chip": per_device_bytes(engine.abstract_params()),
            "fits": all("compile_error" not in ph and ph["per_device_bytes"]["total"] <= hbm for ph in phases.values()),
            **est, "chip_peaks": CHIP_PEAKS[chip], "host_bytes_per_s_assumed": HOST_BYTES_PER_S,
            "num_params": int(sum(math.prod(a.shape) for a in jax.tree.leaves(state["params"])))}


def run_rl(preset_name: str, topology: str, *, log=None, **kw) -> dict:
    """resolve_rl() + compile_rl(): the JSON report of --program=rl."""
    from glm5_jax.overrides import as_dict
    r = resolve_rl(preset_name, topology, **kw)
    t = time.time()
    out = compile_rl(r, log=log)
    keys = ("preset", "topology", "chip", "devices", "mesh", "rollout_mesh", "prompts_per_step", "group_size",
            "rollouts_per_step", "prompt_len", "max_new_tokens", "minibatches", "update_seq_len", "mismatch",
            "offload_optimizer", "rollout_prefill_chunk", "hbm_bytes")
    return {"program": "rl", **{k: r[k] for k in keys}, "response_lengths": r["lengths"], **out,
            "compile_seconds": round(time.time() - t, 1),
            "config": {"model": as_dict(r["model"]), "train": as_dict(r["train"])}}


def format_rl(p: dict) -> str:
    """The human-readable report of --program=rl."""
    gib = lambda v: f"{v / 2**30:.2f} GiB"
    mesh = lambda m: ",".join(f"{a}:{n}" for a, n in m.items() if n > 1) or "1 device"
    lines = [f"colocated RL step of preset {p['preset']} on {p['topology']} ({p['devices']} chips): update on "
             f"{mesh(p['mesh'])}, rollouts on {mesh(p['rollout_mesh'])}; {p['prompts_per_step']} prompts x "
             f"{p['group_size']} = {p['rollouts_per_step']} rollouts of {p['prompt_len']} + <= {p['max_new_tokens']} "
             f"tokens, {p['minibatches']} minibatch update(s), layers {p['config']['model']['num_layers']}, "
             f"optimizer state {'on the host during rollouts' if p['offload_optimizer'] else 'on the chips'}"]
    for name, ph in p["phases"].items():
        pd = ph["per_device_bytes"]
        if "compile_error" in ph:
            lines.append(f"  {name:<16} the TPU compiler refused it: {ph['compile_error']}")
            continue
        t = ph.get("budget", {}).get("estimated_step_seconds")
        lines.append(f"  {name:<16} {gib(pd['total']):>11} a chip (program {gib(pd['program_total'])} + resident "
                     f"{gib(pd['resident'])}), compiled in {ph['compile_seconds']:.0f}s"
                     + (f", ~{t * 1e3:.1f} ms a call (estimate)" if t is not None else ""))
    lines.append(f"reshard moves {gib(p['reshard_bytes_per_chip'])} into a chip ({gib(p['reshard_bytes_total'])} in "
                 f"all); rollout copy {gib(p['rollout_copy_bytes_per_chip'])} a chip; "
                 f"{'fits' if p['fits'] else 'DOES NOT FIT'} in {gib(p['hbm_bytes'])}")
    if "estimated_rl_step_seconds" in p:
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in p["seconds_by_part"].items())
        lines.append(f"estimated RL step (ESTIMATE, rooflines): {p['estimated_rl_step_seconds']:.1f}s = {parts}; "
                     f"{p['decode_steps']:.0f} decode steps, {p['generated_tokens_per_s_per_chip']:.1f} generated "
                     "tokens/s a chip")
    return "\n".join(lines)


def define_rl_flags(fv) -> None:
    """--program=rl's own flags (tools.aot.define_flags calls this)."""
    from absl import flags
    I, F = flags.DEFINE_integer, flags.DEFINE_float
    flags.DEFINE_string("rollout_mesh", None, "rl: the rollout engine's mesh over the same chips (default expert "
                        "over every chip)", flag_values=fv)
    I("prompts_per_step", None, "rl: prompts a step (default: glm5 v5p:4x4x8 128, else one group per batch shard)",
      flag_values=fv)
    I("group_size", None, "rl: samples a prompt (GRPO group; default 8)", flag_values=fv)
    I("prompt_len", None, "rl: prompt tokens (padded; default 1024)", flag_values=fv)
    I("max_new_tokens", None, "rl: response cap (default 3072)", flag_values=fv)
    I("minibatches", None, "rl: update steps a step (RLConfig.minibatches)", flag_values=fv)
    F("response_len_median", None, "rl: median response length (log-normal; default 1024)", flag_values=fv)
    F("response_len_sigma", None, "rl: log-normal sigma of the response lengths (default 0.8)", flag_values=fv)
    flags.DEFINE_string("mismatch", None, "rl: RLConfig.mismatch of the rollout copy (default none)", flag_values=fv)
    I("rollout_prefill_chunk", None, "rl: prompt tokens a row prefills per chunk in the rollout engine (default: "
      "glm5 v5p:4x4x8 128, else the engine's)", flag_values=fv)
    flags.DEFINE_list("phases", None, "rl: compile only these of " + ", ".join(PHASES) + " (default all; the step "
                      "estimate needs all)", flag_values=fv)
    flags.DEFINE_bool("offload_optimizer", None, "rl: the optimizer state on the host during reshard and rollouts "
                      "(default: glm5 v5p:4x4x8 yes, else no)", flag_values=fv)


RL_FLAGS = ("rollout_mesh", "prompts_per_step", "group_size", "prompt_len", "max_new_tokens", "minibatches",
            "response_len_median", "response_len_sigma", "mismatch", "rollout_prefill_chunk", "phases",
            "offload_optimizer")
