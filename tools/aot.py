"""Compile the train step for a TPU topology without the TPU, and report its per-device memory and budget.

    python -m tools.aot --preset=glm5 --topology=v5p:4x4x8 [--mesh=fsdp:32,expert:4] [--batch_size=N]
        [--seq_len=T] [--remat=none|full|offload|dots|dots_no_batch|save_qkv|save_attention|custom] [--grad_accum=K]
        [--optimizer=adamw|muon|muon_split] [--set model.FIELD=V ...] [--set train.FIELD=V ...] [--dump_dir=DIR] [--json]

    python -m tools.aot --program=decode|prefill --preset=glm5 --topology=v5p:4x4x4 --batch=128
        --max_model_len=131072 [--speculative=mtp] [--set model.FIELD=V ...] --json

    python -m tools.aot --program=rl --preset=glm5 --topology=v5p:4x4x8 [--group_size=8 ...] --json

--program=rl compiles the colocated RL step's phases (update, reshard, rollout prefill / decode) and
estimates its time (tools/aot_rl.py, docs/rl.md). --program=decode|prefill compiles the serving engine's own programs instead (tools/aot_serve.py: the
weights / cache split of the per-chip memory, the step's floor of HBM bytes, TPOT and output tokens/s a
chip beside the HBM roofline). For --program=train (the default):
It builds the SAME step experiments train with (glm5_jax.train.step.make_train_step on a Mesh of
the topology's devices, state shapes from glm5_jax.train.state.abstract_state, batch shapes from
abstract_batch), lowers it with ShapeDtypeStructs (nothing is allocated) and compiles it with the
TPU compiler that `jax[tpu]` brings (libtpu; `jax.experimental.topologies` gives the devices of a
topology, no TPU needed). Printed: compile seconds, `compiled.memory_analysis()` per device
(arguments, outputs, temporaries, aliased) against the chip's HBM, and tools.plan's estimate beside it.
Per-device total = arguments + outputs + temporaries - aliased (the donated state's outputs reuse
its argument buffers; memory_analysis reports the aliased bytes, and they are subtracted).

The report's `budget` (per device, ESTIMATES read off the compiled HLO, not measurements; tools/budget.py):
compiled_flops (dot/convolution FLOPs, each while body x its trip count: XLA's cost_analysis counts a
loop body once), model_flops (glm5_jax.flops.train_flops_per_token x tokens per step / devices),
useful_flops_fraction = model / compiled, bytes_accessed, collective_bytes, and the roofline
estimated_step_seconds = max(compiled_flops / peak, bytes_accessed / HBM bw, collective_bytes / ICI bw)
with estimated_mfu = model_flops / (estimated_step_seconds x peak); the chip figures and their sources
are tools/budget.py's CHIP_PEAKS.

Progress lines go to stderr; with --json the last stdout line is one JSON object. Exit status: 0 when
the compiler produced the program (`fits` says whether its total is within HBM), 2 for bad flags, 1 when
the compiler refused it for memory (RESOURCE_EXHAUSTED at buffer assignment): the report then has
`fits: false`, `compile_error` (the compiler's line) and the temporaries it asked for. `--dump_dir`
sets XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text (buffer assignment and memory-usage report
in *buffer-assignment.txt / *memory-usage-report.txt).

Defaults: DEFAULTS below holds the configuration measured to fit for (preset, topology) pairs
(docs/scaleout.md, "Compiled memory (tools.aot)"); otherwise the mesh is fsdp over every device,
one sequence per batch shard, seq_len 4096, no gradient accumulation. `--grad_accum=K` compiles
the step that splits the batch into K micro-batches (TrainConfig.grad_accum): batch_size is the
tokens per optimizer step, batch_size / K rows per micro-batch must divide over data*fsdp*expert.
"""

from __future__ import annotations

import json
import os
import sys
import time

from glm5_jax.cli import main_wrapper
from glm5_jax.config import REMAT_POLICIES
from tools.tpu_compile import (CHIPS, AotError, DoesNotFit, compile_lowered, memory_report,  # noqa: F401  (re-exported)
                               parse_topology, topology_devices)

from tools.aot_train import (DEFAULTS, AotConfig, _fits, _log, _not_fit, compile_step, defaults_for,  # noqa: F401
                             plan_estimate, resolve)


def run(preset_name: str, topology: str, *, with_plan: bool = True, log=None, save_hlo: str | None = None,
        **kw) -> dict:
    """resolve() + compile_step() + the plan estimate: the JSON report tools.aot prints."""
    from glm5_jax.overrides import as_dict
    r = resolve(preset_name, topology, **kw)
    hbm = r["hbm_bytes"]
    try:
        out = compile_step(r, log=log, save_hlo=save_hlo)
    except DoesNotFit as e:
        out = _not_fit(e)
    report = {"program": "train", "preset": preset_name, "topology": topology, "chip": r["chip"],
              "devices": r["devices"], "mesh": r["mesh"], "batch_size": r["train"].batch_size,
              "seq_len": r["train"].seq_len, "grad_accum": r["train"].grad_accum,
              "tokens_per_step": r["train"].batch_size * r["train"].seq_len,
              **out, "hbm_bytes": hbm, "fits": _fits(out, hbm),
              "config": {"model": as_dict(r["model"]), "train": as_dict(r["train"])}}
    if with_plan:
        est = plan_estimate(r["model"], r["train"], r["mesh"])
        report["plan_estimate"] = est
        if est["per_device_bytes"]["total"] and "total" in out["per_device_bytes"]:
            report["compiled_over_plan"] = round(out["per_device_bytes"]["total"] / est["per_device_bytes"]["total"], 3)
    return report


def run_serving(program: str, preset_name: str, topology: str, *, log=None, save_hlo: str | None = None,
                **kw) -> dict:
    """tools.aot_serve.resolve_serving() + compile_serving(): the report of --program=decode|prefill."""
    from glm5_jax.overrides import as_dict
    from tools.aot_serve import compile_serving, resolve_serving
    r = resolve_serving(program, preset_name, topology, **kw)
    try:
        out = compile_serving(r, log=log, save_hlo=save_hlo)
    except DoesNotFit as e:
        out = _not_fit(e)
    keys = ("program", "program_name", "preset", "topology", "chip", "devices", "mesh", "batch", "max_model_len", "cache_size",
            "num_draft", "hbm_bytes", "kv_cache")
    return {**{k: r[k] for k in keys}, **({"prefill_width": r["prefill_width"]} if program != "decode" else {}),
            **({"paged": r["paged"]} if "paged" in r else {}),
            **out, "fits": _fits(out, r["hbm_bytes"]) and out["per_device_bytes"]["engine_total"] <= r["hbm_bytes"],
            "config": {"model": as_dict(r["model"])}}


def format_report(p: dict) -> str:
    gib = lambda b: f"{b / 2**30:10.2f} GiB"
    pd = p["per_device_bytes"]
    mesh = ",".join(f"{a}:{n}" for a, n in p["mesh"].items() if n > 1) or "1 device"
    m = p["config"]["model"]
    if p["program"] == "train":
        head = (f"preset {p['preset']} on {p['topology']} ({p['devices']} chips), mesh {mesh}, batch "
                f"{p['batch_size']} x {p['seq_len']} ({p['tokens_per_step']:,} tokens/step, "
                f"{p['grad_accum']} micro-batch{'es' if p['grad_accum'] > 1 else ''}), "
                f"optimizer {p['config']['train']['optimizer']}, layers {m['num_layers']}, remat {m['remat']}, "
                f"moe_impl {m['moe_impl']}")
    else:
        head = (f"{p['program_name']} of preset {p['preset']} on {p['topology']} ({p['devices']} "
                f"chips), mesh {mesh}, {p['batch']} cache slots x {p['cache_size']} positions"
                + (f", {p['prefill_width']} prompt tokens a row" if p["program"] == "prefill" else "")
                + f", layers {m['num_layers']}, attention {m['attention']}")
        if "paged" in p:
            g = p["paged"]
            head = (f"{p['program_name']} of preset {p['preset']} on {p['topology']} ({p['devices']} chips), mesh "
                    f"{mesh}, {p['batch']} sequences of mean context {g['mean_context']} ({g['width']} token rows; "
                    f"pool {g['num_pages']} pages x {g['page_size']} = {g['headroom']} x batch x mean; tables "
                    f"{g['table_pages']} pages), layers {m['num_layers']}, attention {m['attention']}")
    lines = [head,
             f"{'compiler stopped' if 'compile_error' in p else 'compiled'} in {p['compile_seconds']:.1f}s "
             f"(lowered in {p['lower_seconds']:.1f}s)",
             "per-device memory (compiled.memory_analysis()):"]
    notes = {"weights": "  (every parameter the engine holds)", "cache": "  (the engine state: cache [, MTP buffers])",
             "engine_total": "  (weights + cache + temporaries)"}
    for k in ("arguments", "outputs", "temporaries", "aliased", "total", "peak_memory", "host_temporaries",
              "weights", "cache", "engine_total"):
        if k in pd:
            lines.append(f"  {k:<12}{gib(pd[k])}" + notes.get(k, ""))
    lines.append(f"  ({p['total_formula']})")
    if "compile_error" in p:
        lines.append(f"  the TPU compiler refused it: {p['compile_error']}")
    lines.append(f"{'fits' if p['fits'] else 'DOES NOT FIT'}: {p['chip']} HBM {p['hbm_bytes'] / 2**30:.0f} GiB")
    if "plan_estimate" in p:
        e = p["plan_estimate"]["per_device_bytes"]
        lines.append(f"tools.plan estimate: params {gib(e['params'])}, optimizer {gib(e['optimizer'])}, "
                     f"activations {gib(e['activations'])}, total {gib(e['total'])}"
                     + (f" (compiled / plan = {p['compiled_over_plan']})" if "compiled_over_plan" in p else ""))
    if "budget" in p:
        b = p["budget"]
        t = b["seconds_by_bound"]
        lines += ["per-device step budget (ESTIMATES from the compiled HLO, not measurements; tools/budget.py):",
                  f"  compiled FLOPs {b['compiled_flops']:.4g} (dot/conv x loop trips), model FLOPs "
                  f"{b['model_flops']:.4g} (glm5_jax.flops), useful fraction {b['useful_flops_fraction']}"
                  + (f" ({b['useful_flops_fraction_without_mtp']} without the MTP blocks)"
                     if b.get("useful_flops_fraction_without_mtp") is not None else ""),
                  f"  bytes accessed {gib(b['bytes_accessed']).strip()}, collectives {gib(b['collective_bytes']).strip()}",
                  f"  roofline: compute {t['compute']:.4g}s, HBM {t['hbm']:.4g}s, ICI {t['ici']:.4g}s -> step "
                  f"~{b['estimated_step_seconds']:.4g}s ({b['bound']}-bound, perfect overlap; serial "
                  f"{b['serial_seconds']:.4g}s), MFU ~{b['estimated_mfu']}"]
        if p["program"] != "train":
            from tools.aot_serve import format_serving
            lines += format_serving(p)
        if b["unknown_trip_loops"]:
            lines.append(f"  {len(b['unknown_trip_loops'])} while loop(s) of unknown trip count counted once")
    return "\n".join(lines)


def define_flags(fv) -> None:
    """This CLI's flags, defined into `fv` (its own FlagValues: no collision with another tool's flags)."""
    from absl import flags
    from tools.aot_serve import PREFILL_CHUNK, PROGRAMS, SPECULATIVE
    S, I = flags.DEFINE_string, flags.DEFINE_integer
    flags.DEFINE_enum("program", "train", PROGRAMS + ("rl",), "train: the train step; decode / prefill: the serving "
                      "engine's programs (infer.programs.Programs); rl: the colocated RL step's phases (tools/aot_rl.py)",
                      flag_values=fv)
    S("preset", None, "model preset", flag_values=fv, required=True)
    S("topology", None, "KIND:AxBxC, kinds: " + ", ".join(CHIPS), flag_values=fv, required=True)
    S("mesh", None, "AXIS:N,... over data, fsdp, expert, context, tensor (-1 = fill); decode / prefill default: "
      "expert over every chip", flag_values=fv)
    I("batch_size", None, "train: sequences per optimizer step", flag_values=fv)
    I("seq_len", None, "train: tokens per sequence", flag_values=fv)
    S("remat", None, "train: ModelConfig.remat: " + " | ".join(REMAT_POLICIES), flag_values=fv)
    I("grad_accum", None, "train: TrainConfig.grad_accum: micro-batches per step", flag_values=fv)
    S("optimizer", None, "train: TrainConfig.optimizer: adamw | muon | muon_split", flag_values=fv)
    S("batch", None, "decode / prefill / step: cache slots or sequences (the engine's max_batch; default one per "
      "batch shard); auto (--kv_cache=paged): the largest whose page pool fits", flag_values=fv)
    flags.DEFINE_enum("kv_cache", "slots", ("slots", "paged"), "decode / step: slots: the one-row-per-slot cache "
                      "programs; paged: the paged runtime's step (Programs.paged_step; tools/aot_serve.py)",
                      flag_values=fv)
    I("mean_context", None, "--kv_cache=paged: mean cached positions a sequence (the pool holds 1.25 x batch x it)",
      flag_values=fv)
    I("page_size", 64, "--kv_cache=paged: positions a page", flag_values=fv)
    I("max_model_len", None, "decode / prefill: cache positions per slot (default 4096)", flag_values=fv)
    flags.DEFINE_enum("speculative", "none", SPECULATIVE, "decode: mtp compiles the MTP speculative round",
                      flag_values=fv)
    I("num_draft", 2, "decode --speculative=mtp: draft tokens per round", flag_values=fv)
    I("prefill_chunk", PREFILL_CHUNK, "prefill: prompt tokens a row prefills per call (the engine's prefill_chunk)",
      flag_values=fv)
    flags.DEFINE_multi_string("set", [], "model.FIELD=V (ModelConfig) or, for train, train.FIELD=V (TrainConfig); "
                              "repeatable", flag_values=fv)
    S("dump_dir", None, "dump the compiled HLO and buffer assignment here", flag_values=fv)
    S("save_hlo", None, "write the compiled HLO text here (.gz: gzipped); `python -m tools.budget PATH` re-reads it",
      flag_values=fv)
    flags.DEFINE_bool("no_plan", False, "train: skip tools.plan's estimate", flag_values=fv)
    flags.DEFINE_bool("json", False, "last stdout line: one JSON object", flag_values=fv)
    from tools.aot_rl import define_rl_flags
    define_rl_flags(fv)


_TRAIN_ONLY = ("batch_size", "seq_len", "remat", "grad_accum", "optimizer")
_SERVE_ONLY = ("batch", "max_model_len")


@main_wrapper          # AotError, ConfigError, MeshError, OverrideError (Glm5Error): one line, exit 2
def main(argv=None) -> int:
    """argv: the flags without the program name (default sys.argv[1:])."""
    from absl import flags

    from tools.flagparse import parse
    fv = flags.FlagValues()
    define_flags(fv)
    rest = parse(fv, "tools.aot", argv)
    if isinstance(rest, int):
        return rest
    if rest:
        raise AotError(f"unexpected arguments {rest}: every setting is a --flag")
    a = fv
    from tools.aot_rl import RL_FLAGS
    if a.program == "rl":
        return _main_rl(a)
    serving = a.program != "train"
    wrong = [f for f in (_TRAIN_ONLY if serving else _SERVE_ONLY) + RL_FLAGS if getattr(a, f) is not None]
    if wrong and wrong[0] in RL_FLAGS:
        raise AotError(f"--{wrong[0]} applies to --program=rl only")
    if wrong:
        raise AotError(f"--{wrong[0]} does not apply to --program={a.program}; "
                       + ("use --batch / --max_model_len" if serving else "use --batch_size / --seq_len"))
    t0 = time.time()
    log = lambda msg: _log(t0, msg)
    if a.dump_dir:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={a.dump_dir} --xla_dump_hlo_as_text").strip()
    if serving:
        from tools.aot_serve import resolve_serving
        kw = dict(mesh=a.mesh, batch=a.batch, max_model_len=a.max_model_len, speculative=a.speculative,
                  num_draft=a.num_draft, prefill_chunk=a.prefill_chunk, overrides=tuple(a.set), kv_cache=a.kv_cache,
                  mean_context=a.mean_context, page_size=a.page_size)
        resolve_serving(a.program, a.preset, a.topology, **kw)      # every flag checked before the compiler
        log(f"config resolved; building the {a.topology} devices")
        report = run_serving(a.program, a.preset, a.topology, log=log, save_hlo=a.save_hlo, **kw)
    else:
        kw = dict(mesh=a.mesh, batch_size=a.batch_size, seq_len=a.seq_len, remat=a.remat, optimizer=a.optimizer,
                  grad_accum=a.grad_accum, overrides=tuple(a.set))
        resolve(a.preset, a.topology, **kw)     # every flag checked before the compiler
        log(f"config resolved; building the {a.topology} devices")
        report = run(a.preset, a.topology, with_plan=not a.no_plan, log=log, save_hlo=a.save_hlo, **kw)
    report["elapsed_seconds"] = round(time.time() - t0, 1)
    print(format_report(report))
    if a.json:
        print(json.dumps(report))
    return 1 if "compile_error" in report else 0     # 1: no executable (the compiler ran out of HBM)


def _main_rl(a) -> int:
    """--program=rl: tools.aot_rl's phases of the colocated RL step."""
    from tools.aot_rl import RL_FLAGS, format_rl, resolve_rl, run_rl
    wrong = [f for f in ("batch_size", "seq_len", "grad_accum", "optimizer") + _SERVE_ONLY if getattr(a, f) is not None]
    if wrong:
        raise AotError(f"--{wrong[0]} does not apply to --program=rl; use --prompts_per_step / --group_size / "
                       "--prompt_len / --max_new_tokens / --minibatches")
    t0 = time.time()
    kw = dict(mesh=a.mesh, remat=a.remat, overrides=tuple(a.set), **{f: getattr(a, f) for f in RL_FLAGS})
    resolve_rl(a.preset, a.topology, **kw)         # every flag checked before the compiler
    report = run_rl(a.preset, a.topology, log=lambda msg: _log(t0, msg), **kw)
    report["elapsed_seconds"] = round(time.time() - t0, 1)
    print(format_rl(report))
    if a.json:
        print(json.dumps(report))
    return 1 if any("compile_error" in ph for ph in report["phases"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
