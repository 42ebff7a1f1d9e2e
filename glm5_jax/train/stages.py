"""Staged training (context extension) as one program: a list of `Stage`s run in order by the one loop.

    stages = [Stage("base", seq_len=4096, steps=..., learning_rate=3e-4),
              Stage("32k", seq_len=32768, steps=..., model={"rope_theta": 1e6}),
              Stage("dsa_warmup", seq_len=32768, steps=..., model={"attention": "dsa"},
                    train={"indexer_loss": "dense", "trainable_pattern": "indexer"}),
              Stage("dsa", seq_len=32768, steps=..., train={"indexer_loss": "sparse"})]
    out = train_stages(model_cfg, tcfg, stages, make_iter, workdir)

Stage i runs glm5_jax.train.loop.train in workdir/stage_<i>_<name>, starting from stage i-1's final params.
* Model overrides are cumulative (the model is what carries): each stage's ModelConfig is the previous
  stage's with `Stage.model` applied. Only fields that keep the carried parameters may change: the RoPE
  settings (frequencies only: the params pytree is the same), attention 'mla' -> 'dsa' with the indexer
  fields (DSA by continued pre-training: the indexer is added, freshly initialised, and every other
  parameter is carried bit-exactly by `graft`), and runtime fields that change how, not what, the model
  computes.
* Train settings are per stage from the base TrainConfig: seq_len and steps from the stage, the learning
  rate schedule fields where the stage sets them, plus `Stage.train` overrides (indexer_loss, ...).
* The optimizer state does not carry: each stage starts a fresh optimizer (moments, step 0, its own
  warmup + schedule: TrainConfig.lr_schedule, cosine or warmup-stable-decay, set per stage in
  `Stage.train`, e.g. {"lr_schedule": "wsd", "decay_fraction": 0.0} for a stage held at the peak and
  {"lr_schedule": "wsd", "decay_fraction": 1.0} for the annealing stage that follows it). Reason: a stage is
  its own schedule (a new warmup re-estimates the moments, which is what the fresh stage's warmup is for), a
  DSA stage has parameters the previous optimizer never saw (its state would need a graft of its own), and the
  loop then needs no second way to start a state.
* Resume: a stage writes stage.json (its definition; done + final eval when it ends). A rerun skips
  done stages, resumes the unfinished stage from its latest checkpoint (the loop's exact resume) and
  starts a fresh stage from the previous stage's final params (in memory, or read back from its final
  checkpoint after a restart), so a killed run ends with exactly the losses of an uninterrupted one.
  A stage.json whose definition differs from the stage now given is refused.

Stages that are not one train() run (SFT, then RL, reward-model and distillation stages on one policy):
`run_phases(workdir, model_cfg, [(name, fn)], log)`, fn(done) -> (params, result); each completed stage's
params and result are kept in WORKDIR/<name>/final and loaded, not rerun, by a later invocation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import time
from typing import Any, Callable, Dict, Mapping, Sequence

import jax
import numpy as np
from etils import epath
from flax import traverse_util

from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.data.config import MIX_SYNTAX, parse_mix
from glm5_jax.fields import require
from glm5_jax.model import init_params as fresh_params
from glm5_jax.train.checkpoint import Checkpointer
from glm5_jax.train.config import TrainConfig
from glm5_jax.train.loop import _read_metrics, train
from glm5_jax.train.state import abstract_param_shapes, abstract_state
from glm5_jax.sharding import single_device_mesh

ROPE_FIELDS = ("rope_theta", "rope_scaling")
DSA_FIELDS = ("attention", "index_topk", "index_n_heads", "index_head_dim", "indexer_types")
RUNTIME_FIELDS = ModelConfig.runtime_fields()   # how the model runs, not what it computes (glm5_jax.fields)
MODEL_FIELDS = ROPE_FIELDS + DSA_FIELDS + RUNTIME_FIELDS
SCHEDULE_FIELDS = ("learning_rate", "warmup_steps", "min_lr_ratio")
STAGE_OWNED = ("seq_len", "steps") + SCHEDULE_FIELDS        # set on the Stage itself, not in Stage.train
TRAIN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in STAGE_OWNED)
STAGE_FILE = "stage.json"


def _frozen(v):
    return tuple(sorted((k, _frozen(x)) for k, x in v.items())) if isinstance(v, Mapping) else v


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: its sequence length, steps, learning-rate schedule (None: the base TrainConfig's),
    `model` overrides (MODEL_FIELDS; cumulative over stages), `train` overrides (TrainConfig fields
    other than the stage's own; per stage) and an optional data mix for make_iter: `data` re-weights the
    sources of a mixture (DataConfig.sources) by name, `NAME:WEIGHT,...` (e.g. "docs:0.9,code:0.1" for
    an annealing stage); None = data.sources' own weights."""
    name: str
    seq_len: int
    steps: int
    learning_rate: float | None = None
    warmup_steps: int | None = None
    min_lr_ratio: float | None = None
    model: Any = ()          # a dict or a tuple of (field, value) items
    train: Any = ()
    data: str | None = None
    init_seed: int | None = None   # the key of the fresh params a model change adds (None: seed + stage index)

    def __post_init__(self):
        def bad(field, value, allowed):
            raise ConfigError(f"Stage {self.name!r}: {field}={value!r} is invalid: {allowed}")
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ConfigError(f"Stage.name={self.name!r} is invalid: a non-empty string of letters, digits, "
                              "'_', '.', '-' (it names the stage's folder)")
        for f in ("seq_len", "steps"):
            require(f"Stage {self.name!r}: {f}", getattr(self, f), integer=True, min=1)
        if self.data is not None:
            if not isinstance(self.data, str):
                bad("data", self.data, f"None or a mix of data.sources: {MIX_SYNTAX}")
            names = [p.rpartition(":")[0].strip() for p in self.data.split(",") if p.strip()]
            try:
                parse_mix(self.data, names)       # the form and the weights; the names are checked by the data
            except ConfigError as e:
                bad("data", self.data, str(e))
        for f, allowed in (("model", MODEL_FIELDS), ("train", TRAIN_FIELDS)):
            items = dict(getattr(self, f))
            for k in items:
                if k in STAGE_OWNED:
                    bad(f"{f}[{k!r}]", items[k], f"{k} is a Stage field: set Stage.{k}")
                if k not in allowed:
                    what = ("fields that may change between stages (RoPE, adding DSA, runtime)"
                            if f == "model" else "TrainConfig fields")
                    bad(f"{f}[{k!r}]", items[k], f"{k!r} is not one of the {what}; allowed: {', '.join(allowed)}")
            object.__setattr__(self, f, _frozen(items))

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        if d["init_seed"] is None:       # the stage.json of a stage without one reads as before the field
            del d["init_seed"]
        return json.loads(json.dumps(d))

    @classmethod
    def of(cls, name: str, tcfg: TrainConfig, base: TrainConfig, *, model=(), data=None, init_seed=None) -> "Stage":
        """The stage that trains with exactly `tcfg` when run from the base TrainConfig `base`: its seq_len,
        steps and schedule, and every other field that differs from the base as a `train` override."""
        return cls(name, seq_len=tcfg.seq_len, steps=tcfg.steps,
                   **{f: getattr(tcfg, f) for f in SCHEDULE_FIELDS if getattr(tcfg, f) != getattr(base, f)},
                   model=model, data=data, init_seed=init_seed,
                   train={f: getattr(tcfg, f) for f in TRAIN_FIELDS if getattr(tcfg, f) != getattr(base, f)})


def graft(dst, src):
    """Copy every parameter `src` has into `dst` (DSA params = MLA params + a fresh indexer), by path.

    With scanned layers both trees hold the same stacks (dense_layers, moe_layers, ...) as long as the
    DSA layout has one indexer type per stack (every layer "full"); a shared-indexer layout stacks its
    layers in blocks, so the MLA paths would not exist in it and this refuses."""
    flat_dst, flat_src = traverse_util.flatten_dict(dst), traverse_util.flatten_dict(src)
    missing = ["/".join(k) for k in flat_src if k not in flat_dst]
    if missing:
        raise ValueError(f"graft: {len(missing)} source parameters have no place in the target, e.g. {missing[:3]}")
    bad = ["/".join(k) for k, v in flat_src.items() if flat_dst[k].shape != v.shape]
    if bad:
        raise ValueError(f"graft: shapes differ for {bad[:3]}")
    flat_dst.update(flat_src)
    return traverse_util.unflatten_dict(flat_dst)


def _check_carry(prev: ModelConfig, cfg: ModelConfig, where: str) -> None:
    """Refuse a model change that would not carry every parameter of `prev` unchanged into `cfg`."""
    if all(getattr(cfg, f) == getattr(prev, f) for f in DSA_FIELDS):
        return                                   # RoPE / runtime only: the same parameters by construction
    old, new = _shapes(prev), _shapes(cfg)
    lost = ["/".join(k) for k in old if new.get(k) != old[k]]
    added = [k for k in new if k not in old]
    if lost or (added and prev.attention == cfg.attention):
        changed = {f: getattr(cfg, f) for f in DSA_FIELDS if getattr(cfg, f) != getattr(prev, f)}
        raise ConfigError(f"{where}: model overrides {changed} change the parameters carried from the previous "
                          f"stage (e.g. {(lost or ['/'.join(k) for k in added])[:3]}); between stages only the "
                          "RoPE settings may change, or attention 'mla' -> 'dsa' with an indexer layout whose "
                          "stacks match the MLA model's (every layer 'full')")


def plan_stages(model_cfg: ModelConfig, tcfg: TrainConfig, stages: Sequence[Stage]):
    """[(ModelConfig, TrainConfig)] of each stage, or a ConfigError naming the stage and field (before
    anything is compiled)."""
    if not stages or not all(isinstance(s, Stage) for s in stages):
        raise ConfigError(f"stages={stages!r} is invalid: a non-empty list of Stage")
    out, prev = [], model_cfg
    for i, s in enumerate(stages):
        where = f"stage {i} {s.name!r}"
        sched = {f: getattr(s, f) for f in SCHEDULE_FIELDS if getattr(s, f) is not None}
        attention = dict(s.model).get("attention", prev.attention)
        if i and attention != prev.attention and (prev.attention, attention) != ("mla", "dsa"):
            raise ConfigError(f"{where}: model['attention']={attention!r} is invalid after {prev.attention!r}: "
                              "between stages attention may change only from 'mla' to 'dsa' (DSA added by "
                              "continued pre-training)")
        try:
            cfg = dataclasses.replace(prev, **dict(s.model))
            tc = dataclasses.replace(tcfg, seq_len=s.seq_len, steps=s.steps, **sched, **dict(s.train))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        if i:
            _check_carry(prev, cfg, where)
        out.append((cfg, tc))
        prev = cfg
    return out


def _write_atomic(path: epath.Path, text: str) -> None:
    """Write `path` so that a reader sees the old or the new content, never a part (a temp file renamed
    over it: atomic on a local disk; on an object store each object write is whole anyway)."""
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(text)
    tmp.replace(path)


def stage_dir(workdir, i: int, stage: Stage) -> epath.Path:
    return epath.Path(workdir) / f"stage_{i}_{stage.name}"


def _read_record(wd: epath.Path, stage: Stage, where: str) -> dict | None:
    path = wd / STAGE_FILE
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    if rec["stage"] != stage.to_json():
        raise ConfigError(f"{where}: {path} was written for {rec['stage']} but the stage is now "
                          f"{stage.to_json()}; a started stage cannot change (use another workdir)")
    return rec


def _shapes(cfg: ModelConfig) -> dict:
    return {k: v.shape for k, v in traverse_util.flatten_dict(abstract_param_shapes(cfg)).items()}


def _latest_step(wd: epath.Path, tcfg: TrainConfig) -> int | None:
    ckpt = Checkpointer(wd / "checkpoints", keep=tcfg.keep_checkpoints, async_save=False)
    try:
        return ckpt.latest_step()
    finally:
        ckpt.close()


def stage_params(model_cfg, tcfg, wd, mesh=None, step: int | None = None):
    """A stage's params at its kept checkpoint `step` (default: its last, tcfg.steps), read back onto `mesh`
    (None: one device, as train_stages)."""
    mesh = single_device_mesh() if mesh is None else mesh
    step = tcfg.steps if step is None else step
    ckpt = Checkpointer(epath.Path(wd) / "checkpoints", keep=tcfg.keep_checkpoints, async_save=False)
    try:
        if step not in ckpt.all_steps():
            raise ValueError(f"no checkpoint at step {step} in {wd} (kept: {ckpt.all_steps()})")
        state, _ = ckpt.restore(step, abstract_state(model_cfg, tcfg, mesh)[0])
    finally:
        ckpt.close()
    return state["params"]


_final_params = stage_params


def cached_json(workdir, name: str, key, fn):
    """fn() once per (name, key) in `workdir`: the result is kept as JSON in workdir/evals/<name>-<digest of
    key>.json (written atomically by the primary process), so a rerun of the same settings skips it."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
    path = epath.Path(workdir) / "evals" / f"{name}-{digest}.json"
    if path.exists():
        return json.loads(path.read_text())
    out = fn()
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, json.dumps(out))
    return out


class PhaseProgress:
    """Progress over a program's phases (stages, arms, evaluations) weighted by an estimate of their cost:
    finished(phase) logs the elapsed time, the share of the estimated work done and the ETA."""

    def __init__(self, log, weights: dict, tag: str = "progress", t0: float | None = None):
        self.log, self.weights, self.tag, self.done = log, dict(weights), tag, 0.0
        self.t0 = time.time() if t0 is None else t0

    def finished(self, phase: str) -> None:
        self.done += self.weights.get(phase, 0.0)
        el = time.time() - self.t0
        total = sum(self.weights.values())
        eta = el / self.done * (total - self.done) if self.done else float("nan")
        self.log(f"[{self.tag}] {phase} done; elapsed {el:.0f} s, {100 * self.done / total:.0f}% of the estimated "
                 f"work, ETA ~{eta:.0f} s")



class StepTimes:
    """Each stage's step wall times through a hook (`hooks(arm)` is a hooks_for_stage), merged by `record`
    into workdir/step_times.json (a stage an earlier invocation trained keeps that one's figure)."""

    def __init__(self):
        self.times: dict[str, list] = {}

    def hooks(self, arm: str):
        from glm5_jax.train.loop import Hook

        def for_stage(stage, i, model_cfg):
            times = self.times.setdefault(f"{arm}/{stage.name}", [])
            return [Hook(lambda ctx: times.append(ctx.step_seconds), every=1, at_end=False, params=False)]
        return for_stage

    def trained(self) -> list[str]:
        return sorted(k for k, v in self.times.items() if v)

    def record(self, workdir) -> dict:
        """{arm/stage: {"median_s", "steps_timed"}} (the first step, which compiles, left out)."""
        path = epath.Path(workdir) / "step_times.json"
        recorded = json.loads(path.read_text()) if path.exists() else {}
        for name, ts in self.times.items():
            if len(ts) > 1:
                recorded[name] = {"median_s": float(np.median(ts[1:])), "steps_timed": len(ts) - 1}
        if jax.process_index() == 0:
            _write_atomic(path, json.dumps(recorded, indent=2))
        return recorded


def record_invocation(workdir, entry: dict) -> list[dict]:
    """Append this invocation's entry (start, wall time, load, what it trained) to workdir/invocations.json and
    return every invocation's (a resumed run's own wall time leaves out what earlier ones did)."""
    path = epath.Path(workdir) / "invocations.json"
    out = (json.loads(path.read_text()) if path.exists() else []) + [entry]
    if jax.process_index() == 0:
        _write_atomic(path, json.dumps(out, indent=2))
    return out


class Invocation:
    """This invocation's start (time, load average), taken when it is made; finish() adds to a report its wall
    time, the load average at start and at end, and every invocation on the workdir (record_invocation)."""

    def __init__(self):
        self.t_start = time.time()
        self.load_start = os.getloadavg()

    def finish(self, workdir, report: dict, trained: list[str]) -> dict:
        """report["wall_time_s"], ["load_average_start"], ["load_average_end"] and ["invocations"] (this
        one's entry: start, wall time, load, the stages it trained, e.g. StepTimes.trained())."""
        report["wall_time_s"] = time.time() - self.t_start
        report["load_average_start"] = list(self.load_start)
        report["load_average_end"] = list(os.getloadavg())
        report["invocations"] = record_invocation(workdir, {
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.t_start)),
            "wall_time_s": report["wall_time_s"], "load_average_start": list(self.load_start),
            "load_average_end": report["load_average_end"], "trained": trained})
        return report


def stage_summaries(stages: Sequence[dict], step_times: Mapping, prefix: str) -> list[dict]:
    """One row per stage of a train_stages result ("stages"): name, seq_len, steps, batch size, RoPE theta and
    scaling, attention, final train loss, and the median step time StepTimes.record gave <prefix>/<name>."""
    return [{"name": s["name"], "seq_len": s["train_cfg"].seq_len, "steps": s["train_cfg"].steps,
             "batch_size": s["train_cfg"].batch_size, "rope_theta": s["model_cfg"].rope_theta,
             "rope_scaling": s["model_cfg"].rope_scaling_dict or None, "attention": s["model_cfg"].attention,
             "final_train_loss": s["history"][-1]["loss"] if s["history"] else None,
             "step_time_s": step_times.get(f"{prefix}/{s['name']}", {}).get("median_s")} for s in stages]


def stage_plan(summaries: Sequence[dict]) -> str:
    """stage_summaries in one line: "name (T=.., N steps x B=.., theta .., [yarn, ]attention), ..."."""
    return ", ".join(f"{s['name']} (T={s['seq_len']}, {s['steps']} steps x B={s['batch_size']}, theta "
                     f"{s['rope_theta']:g}{', yarn' if s['rope_scaling'] else ''}, {s['attention']})"
                     for s in summaries)


def describe_invocations(report: dict) -> str:
    """Invocation.finish's figures as a report.md paragraph: this invocation's wall time and load average, and
    every invocation on the workdir (start, wall time, load, what it trained)."""
    runs = ", ".join(f"{i['started']} {i['wall_time_s']:.0f} s (load {i['load_average_start'][0]:.1f}-"
                     f"{i['load_average_end'][0]:.1f}, trained: {', '.join(i['trained']) or 'nothing'})"
                     for i in report["invocations"])
    return (f"Wall time of this invocation {report['wall_time_s']:.0f} s; load average at start "
            f"{report['load_average_start'][0]:.2f},\nat end {report['load_average_end'][0]:.2f}. Every invocation "
            f"on this workdir (a rerun resumes, skipping\nfinished stages and cached evaluations): {runs}.")


def _carry(prev_cfg, cfg, params, key):
    """Stage i's starting params from stage i-1's: the same tree when the parameters are the same (RoPE
    / runtime changes), else the new model's fresh init (seeded by `key`) with every carried one grafted."""
    if _shapes(prev_cfg) == _shapes(cfg):
        return params
    return graft(fresh_params(cfg, key), params)


def train_stages(model_cfg: ModelConfig, tcfg: TrainConfig, stages: Sequence[Stage],
                 make_iter: Callable[[Stage, int], Any], workdir, *, init_params=None,
                 eval_fn_for_stage: Callable[[Stage, int, ModelConfig], Callable | None] | None = None,
                 mesh=None, log=None, loss_fn=None,
                 hooks_for_stage: Callable[[Stage, int, ModelConfig], Sequence] | None = None) -> dict:
    """Run `stages` in order (module docstring), resuming a killed run where it stopped.

    make_iter(stage, i): a fresh train iterator of stage i's batches ([tcfg.batch_size, stage.seq_len];
    e.g. LMData.train_iter(B, stage.seq_len), or a mix chosen by stage.data); the loop restores its state
    from the stage's checkpoint. eval_fn_for_stage(stage, i, model_cfg) -> eval_fn for that stage's
    train() (or None); hooks_for_stage(stage, i, model_cfg) -> that train()'s hooks (glm5_jax.train.loop.Hook).
    init_params: stage 0's starting params (default: the seed, or `init_from`). Stage.init_seed keys the fresh
    params a model change adds (default fold_in(seed, i)). A stage chain that repeats done stages (a branch:
    [base, a] then [base, b] in one workdir) reruns nothing: done stages are skipped, their params read back.
    Returns {"params" (the last stage's), "model_cfg" (the last stage's), "stages": [{"name", "workdir",
    "model_cfg", "train_cfg", "history", "final"}]}.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    mesh = single_device_mesh() if mesh is None else mesh
    plan = plan_stages(model_cfg, tcfg, stages)
    primary = jax.process_index() == 0
    params, results = init_params, []
    for i, (stage, (cfg, tc)) in enumerate(zip(stages, plan)):
        wd = stage_dir(workdir, i, stage)
        where = f"stage {i} {stage.name!r}"
        rec = _read_record(wd, stage, where)
        if rec is not None and rec["done"]:
            log(f"[stages] {where} already done ({wd})")
            results.append({"name": stage.name, "workdir": str(wd), "model_cfg": cfg, "train_cfg": tc,
                            "history": _read_metrics(wd / "metrics.jsonl", None), "final": rec["final"]})
            params = None                        # read back only if the next stage starts fresh
            continue
        wd.mkdir(parents=True, exist_ok=True)
        start = None                             # a stage with a checkpoint resumes from it (the loop)
        if _latest_step(wd, tc) is None:
            start = params
            if i:
                prev_cfg, prev_tc = plan[i - 1]
                if params is None:
                    params = _final_params(prev_cfg, prev_tc, stage_dir(workdir, i - 1, stages[i - 1]), mesh)
                key = (jax.random.fold_in(jax.random.PRNGKey(tc.seed), i) if stage.init_seed is None
                       else jax.random.PRNGKey(stage.init_seed))
                start = _carry(prev_cfg, cfg, params, key)
        if primary and rec is None:
            _write_atomic(wd / STAGE_FILE, json.dumps({"stage": stage.to_json(), "done": False, "final": None}))
        log(f"[stages] {where}: T={stage.seq_len}, {stage.steps} steps, rope_theta={cfg.rope_theta}, "
            f"rope_scaling={cfg.rope_scaling}, attention={cfg.attention}, lr {tc.lr_schedule} "
            f"(peak {tc.learning_rate})" + (f", data mix {stage.data}" if stage.data else "") + f" ({wd})")
        eval_fn = eval_fn_for_stage(stage, i, cfg) if eval_fn_for_stage is not None else None
        hooks = hooks_for_stage(stage, i, cfg) if hooks_for_stage is not None else ()
        out = train(cfg, tc, make_iter(stage, i), wd, init_params=start, eval_fn=eval_fn, log=log,
                    name=f"stage{i}-{stage.name}", mesh=mesh, loss_fn=loss_fn, hooks=hooks)
        if primary:
            _write_atomic(wd / STAGE_FILE, json.dumps({"stage": stage.to_json(), "done": True, "final": out["final"]}))
        params = out["params"]
        results.append({"name": stage.name, "workdir": str(wd), "model_cfg": cfg, "train_cfg": tc,
                        "history": out["history"], "final": out["final"]})
    if params is None:                           # every stage was already done
        params = _final_params(*plan[-1], stage_dir(workdir, len(stages) - 1, stages[-1]), mesh)
    return {"params": params, "model_cfg": plan[-1][0], "stages": results}



# ---- stages of any kind (RL, distillation, reward model ...): a function per stage ---------------------

def phase_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, name, "final")


def load_phase(workdir: str, name: str, model_cfg: ModelConfig):
    """(params, result) of a completed run_phases stage, or None."""
    import orbax.checkpoint as ocp
    d = phase_dir(workdir, name)
    if not os.path.exists(os.path.join(d, "result.json")):
        return None
    with open(os.path.join(d, "result.json")) as f:
        result = json.load(f)
    # read against this run's own model (the stage was written by it; the config.json beside it is for
    # --init_from and export, whose HF round trip does not keep every field of a tiny MLA/dense config)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(os.path.join(os.path.abspath(d), "params"), abstract_param_shapes(model_cfg))
    return params, result


def save_phase(workdir: str, name: str, model_cfg: ModelConfig, params, result: dict) -> None:
    """Params + result into WORKDIR/<name>/final.tmp, then one rename: a stage is complete or absent."""
    from glm5_jax.train.checkpoint import save_params
    d = phase_dir(workdir, name)
    tmp = d + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_params(tmp, model_cfg, params)
    with open(os.path.join(tmp, "result.json"), "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    os.replace(tmp, d)


def run_phases(workdir: str, model_cfg: ModelConfig, phases: Sequence[tuple], log: Callable[[str], None], *,
               tag: str = "phases") -> dict:
    """Run ``phases`` = [(name, fn)] in order; fn(done) -> (params, result), where ``done`` maps every earlier
    stage to (params, result); each stage's params (one ModelConfig throughout) and result (JSON, plus its
    wall_s) are written to WORKDIR/<name>/final atomically. A stage already complete there is loaded, not
    run, so a re-run continues with the first missing one (a stage resumes inside itself only through
    its own checkpoints, e.g. train()'s or run_grpo's). Returns done."""
    done: Dict[str, tuple] = {}
    t0 = time.time()
    for i, (name, fn) in enumerate(phases, 1):
        got = load_phase(workdir, name, model_cfg)
        if got is not None:
            log(f"[{tag}] stage {i}/{len(phases)} {name}: complete in {phase_dir(workdir, name)}, loaded")
            done[name] = got
            continue
        log(f"[{tag}] stage {i}/{len(phases)} {name}: starting ({time.time() - t0:.0f} s into this invocation)")
        t = time.time()
        params, result = fn(done)
        result = dict(result, wall_s=time.time() - t)
        save_phase(workdir, name, model_cfg, params, result)
        done[name] = (params, result)
        skills = ", ".join(f"{k} {v:.3f}" for k, v in result.get("skills", {}).items())
        log(f"[{tag}] stage {i}/{len(phases)} {name}: done in {result['wall_s']:.0f} s" + (f"; skills {skills}" if skills else ""))
    return done

__all__ = ["Invocation", "MODEL_FIELDS", "PhaseProgress", "Stage", "StepTimes", "TRAIN_FIELDS", "cached_json",
           "describe_invocations", "graft", "load_phase", "phase_dir", "plan_stages", "record_invocation", "run_phases",
           "save_phase", "stage_dir", "stage_params", "stage_plan", "stage_summaries", "train_stages"]
