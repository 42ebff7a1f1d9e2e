"""The GRPO RL program: rollouts -> rewards -> group advantages -> old log-probs -> jitted updates.

One RL step (``run_grpo``):

1. sample ``prompts_per_step`` tasks; the inference engine (``glm5_jax.infer.generate`` at
   ``RLConfig.temperature``, no top-k/top-p, parameters passed through the mismatch switch ``RLConfig.mismatch``) draws
   ``group_size`` completions per prompt and reports each token's log-prob (``infer_logp``);
2. the task checker scores the decoded completion (reward 1 correct, 0 otherwise);
3. GRPO group advantages (``group_advantages``);
4. the training engine recomputes the log-probs of the very same token ids under the rollout-time
   (float32) parameters: ``old_logp`` (jitted forward, ``token_logprobs``), at the sampling temperature
   (``policy_temperature``) like every training log-prob, so the IcePop ratio compares like with like;
5. the rollout batch is split into ``minibatches`` and each gets ONE update: the one train step
   (``glm5_jax.train.step.make_train_step``, on a mesh) with the selected loss plugged in
   (icepop | tis | none, ``glm5_jax.rl.losses``) and AdamW or SGD. The first minibatch is exactly on-policy
   (ratio 1); later ones are slightly off-policy, so the PPO clip can act.

The DSA lightning indexer is frozen during RL: every leaf whose path contains "indexer" gets a zero
update (``make_optimizer(..., frozen_patterns=("indexer",))``, which also keeps it out of the clip
norm); its top-k is exact (``lax.top_k``) in both engines, so the selection is deterministic.

Per-step record: reward mean, statuses (counts and fractions), the loss metrics averaged over the
minibatches (pop_frac, clip_frac, mismatch_kl, ...), the fraction of groups with zero advantage.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from glm5_jax.fields import require
from glm5_jax.infer import generate
from glm5_jax.model import forward, layer_slice_paths
from glm5_jax.optim import make_optimizer, partition_params, scale_slices, slice_masks
from glm5_jax.rl.losses import get_loss, group_advantages
from glm5_jax.rl.rollout import MISMATCH_MODES, build_batch, collect_rollouts
from glm5_jax.rl.rollout_engine import RESHARD_CHUNK_BYTES, RolloutEngine, bytes_per_device
from glm5_jax.rl.tasks import aggregate_statuses
from glm5_jax.train.config import TrainConfig
from glm5_jax.train.observe import ScalarLog, fmt_eta, phase_logdir
from glm5_jax.train.state import init_train_state
from glm5_jax.train.step import make_train_step

__all__ = ["RLConfig", "token_logprobs", "policy_temperature", "make_rl_optimizer", "make_rl_loss", "make_update_step", "rl_train_config",
           "loss_kwargs",
           "evaluate_accuracy", "run_grpo"]


@dataclasses.dataclass(frozen=True)
class RLConfig:
    loss: str = "icepop"              # icepop | tis | none
    steps: int = 40
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 6
    max_prompt_len: int = 8
    minibatches: int = 2
    learning_rate: float = 1e-3
    optimizer: str = "adamw"          # adamw | sgd (momentum SGD; update proportional to the gradient)
    momentum: float = 0.9             # sgd only
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    adv_norm: str = "batch"           # batch: mean over all B sequences | informative: over non-flat groups only
    temperature: float = 1.0
    mismatch: str = "int8"            # none | bf16 | int8 | int6 | int5 | int4 (rollout engine only)
    beta: float = 2.0                 # IcePop band [1/beta, beta]
    tis_cap: float = 2.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    frozen_patterns: tuple = ("indexer",)
    seed: int = 0
    # the optimizer state in host memory (memory kind pinned_host) from before the weight sync until the
    # update, so the rollout copy and the KV cache have its device memory (tools.aot --program=rl)
    offload_optimizer: bool = False
    # the weight sync's chunk: at most this many bytes of each device's rollout copy per program, so the
    # reshard's transient is bounded by a chunk, not the policy (RolloutEngine, sync_plan); a policy within
    # one chunk syncs in one program
    reshard_chunk_bytes: int = RESHARD_CHUNK_BYTES
    # the reward path runs model-written code (function tasks, tool calls) only in the sandbox's namespaces:
    # "required" = the run refuses to start where none work (glm5_jax.rl.sandbox.require_isolation);
    # "off" = the development opt-out (logged loudly): such code may then run without isolation
    sandbox_isolation: str = "required"

    def __post_init__(self):
        get_loss(self.loss)
        if self.sandbox_isolation not in ("required", "off"):
            raise ValueError(f"RLConfig.sandbox_isolation={self.sandbox_isolation!r}: required | off")
        require("RLConfig.reshard_chunk_bytes", self.reshard_chunk_bytes, integer=True, min=1)
        if self.mismatch not in MISMATCH_MODES:
            raise ValueError(f"RLConfig.mismatch={self.mismatch!r}: choose from {MISMATCH_MODES}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"RLConfig.optimizer={self.optimizer!r}: adamw | sgd")
        if self.adv_norm not in ("batch", "informative"):
            raise ValueError(f"RLConfig.adv_norm={self.adv_norm!r}: batch | informative")
        if (self.prompts_per_step * self.group_size) % self.minibatches:
            raise ValueError("prompts_per_step * group_size must be divisible by minibatches")

    def replace(self, **kw) -> "RLConfig":
        return dataclasses.replace(self, **kw)


def loss_kwargs(rl: RLConfig) -> dict:
    kw = {"eps_low": rl.eps_low, "eps_high": rl.eps_high}
    if rl.loss == "icepop":
        kw["beta"] = rl.beta
    elif rl.loss == "tis":
        kw["cap"] = rl.tis_cap
    return kw


def _token_logprobs(config, params, inputs, targets, temperature: float = 1.0):
    logits = forward(config, params, inputs).astype(jnp.float32)
    if temperature != 1.0:      # the distribution the tokens were sampled from (IcePop compares like with like)
        logits = logits / temperature
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]


token_logprobs = jax.jit(_token_logprobs, static_argnums=0, static_argnames="temperature")
token_logprobs.__doc__ = ("(config, params, inputs [B,S], targets [B,S], temperature=1.0) -> log p_T(targets[b,t] | "
                          "inputs[b,:t+1]) [B,S] float32: the training engine's forward (jitted) at temperature T.")


def policy_temperature(rl: "RLConfig") -> float:
    """The temperature the rollout tokens were sampled at (1 for greedy rollouts, whose log-probs the
    engine reports at temperature 1): the training log-probs and ratios are taken at the same one."""
    return rl.temperature if rl.temperature > 0 else 1.0


def make_rl_optimizer(params, rl: RLConfig, config=None):
    """AdamW or momentum SGD (+ global-norm clip over the trainable leaves) with zero updates for leaves
    matching ``rl.frozen_patterns`` (regexes; with the model `config`, stacked leaves are frozen per
    layer: "layer_0/attn" is layer 0 only) and for the router correction bias. Returns (tx, labels)."""
    slice_paths = None if config is None else functools.partial(layer_slice_paths, config)
    if rl.optimizer == "adamw":
        return make_optimizer("adamw", params, learning_rate=rl.learning_rate, weight_decay=rl.weight_decay,
                              b1=rl.adam_b1, b2=rl.adam_b2, grad_clip=rl.grad_clip or None,
                              frozen_patterns=rl.frozen_patterns, slice_paths=slice_paths)
    # momentum SGD: the same labels and per-layer masks as make_optimizer; every trainable leaf is "sgd"
    labels = jax.tree.map(lambda lab: lab if lab in ("frozen", "zero") else "sgd",
                          partition_params(params, "adamw", frozen_patterns=rl.frozen_patterns, slice_paths=slice_paths))
    masks = slice_masks(params, frozen_patterns=rl.frozen_patterns, slice_paths=slice_paths)
    chain = [optax.clip_by_global_norm(rl.grad_clip)] if rl.grad_clip else []
    if rl.weight_decay:
        chain.append(optax.add_decayed_weights(rl.weight_decay))
    chain.append(optax.sgd(rl.learning_rate, momentum=rl.momentum or None))
    transforms = {"sgd": optax.chain(*chain), "frozen": optax.set_to_zero(), "zero": optax.set_to_zero()}
    tx = optax.multi_transform(transforms, labels)
    if masks is not None:
        tx = optax.chain(scale_slices(masks), tx, scale_slices(masks))
    return tx, labels


def make_rl_loss(config, rl: RLConfig):
    """loss_fn(params, batch) -> (loss, (metrics, {})) for the step factory: the selected policy loss
    (icepop | tis | none) on the training engine's log-probs of the rollout tokens. No expert loads
    are reported, so the RL update leaves the MoE correction biases where SFT/pre-training put them.

    batch: inputs, targets, mask, old_logp, infer_logp [B, S]; advantages [B].
    """
    policy_loss = functools.partial(get_loss(rl.loss), **loss_kwargs(rl))

    def loss_fn(params, batch):
        logp = _token_logprobs(config, params, batch["inputs"], batch["targets"], policy_temperature(rl))
        loss, metrics = policy_loss(logp, batch["old_logp"], batch["infer_logp"], batch["advantages"], batch["mask"])
        return loss, (dict(metrics, loss=loss), {})

    return loss_fn


def rl_train_config(rl: RLConfig) -> TrainConfig:
    """The TrainConfig the RL update runs under (the step factory reads bias_update_rate and
    trainable_pattern from it; the optimizer itself comes from make_rl_optimizer)."""
    return TrainConfig(steps=max(rl.steps, 1), learning_rate=rl.learning_rate, weight_decay=rl.weight_decay,
                       grad_clip=rl.grad_clip, warmup_steps=0, bias_update_rate=0.0, seed=rl.seed)


def make_update_step(config, rl: RLConfig, tx: optax.GradientTransformation, mesh=None):
    """The one train step (glm5_jax.train.step.make_train_step) with the RL loss plugged in:
    ``(state, batch) -> (state, metrics)``, state = {"params", "opt_state", "step", "rng"}
    (``init_train_state(config, rl_train_config(rl), mesh, tx=tx, params=params)``), donated.

    metrics: the loss's (pop_frac, clip_frac, mismatch_kl, ...), loss, grad_norm, update_norm.
    """
    return make_train_step(config, rl_train_config(rl), tx, mesh, loss_fn=make_rl_loss(config, rl))


def evaluate_accuracy(config, params, tasks: Sequence, vocab, *, max_new_tokens: int, greedy: bool = True,
                      seed: int = 0, samples: int = 1) -> dict:
    """Held-out accuracy of ``params`` (float32 training parameters): greedy (temperature 0) or sampled
    at temperature 1 (``samples`` per task). Returns accuracy, statuses (aggregate_statuses) and n."""
    prompts = [vocab.encode(t.prompt, bos=True) for t in tasks for _ in range(1 if greedy else samples)]
    res = generate(config, params, prompts, max_new_tokens=max_new_tokens, temperature=0.0 if greedy else 1.0,
                   seed=seed, stop_tokens=(vocab.newline_id,))
    k = 1 if greedy else samples
    scored = [tasks[i // k].score(vocab.decode(res.tokens[i, :res.lengths[i]])) for i in range(len(prompts))]
    agg = aggregate_statuses(scored)
    return {"accuracy": agg["reward_mean"], "statuses": agg, "n": len(prompts)}


def rollout_memory(state, engine, offloaded: bool = False) -> dict:
    """Per-device bytes of a colocated RL step (the most loaded device): the training state (params +
    optimizer state), the rollout copy and KV cache of the last rollout, the rollout programs' scratch,
    ``rollout_peak_bytes_per_device`` = their sum (the rollout phase holds all four, or all but the
    optimizer state when it was ``offloaded`` to host memory; the update only the state,
    ``update_resident_bytes_per_device``), and the allocator's measured peak where the backend reports one
    (``device_peak_bytes``; CPU does not)."""
    st = max(bytes_per_device(state).values())
    held = max(bytes_per_device({k: v for k, v in state.items() if k != "opt_state"}).values()) if offloaded else st
    m = engine.last_memory
    out = {"update_resident_bytes_per_device": st, "rollout_copy_bytes_per_device": m["copy_bytes_per_device"],
           "rollout_cache_bytes_per_device": m["cache_bytes_per_device"],
           "rollout_peak_bytes_per_device": held + m["copy_bytes_per_device"] + m["cache_bytes_per_device"]
           + m["program_temp_bytes_per_device"]}
    stats = [d.memory_stats() for d in engine.mesh.devices.flat]
    if all(s and "peak_bytes_in_use" in s for s in stats):
        out["device_peak_bytes"] = int(max(s["peak_bytes_in_use"] for s in stats))
    return out


def _mean_metrics(rows: list) -> dict:
    keys = rows[0].keys()
    return {k: float(np.mean([float(r[k]) for r in rows])) for k in keys}


def _jsonable(obj):
    """`obj` with numpy / jax scalars and arrays as Python numbers and lists (the checkpoint's JSON)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return obj


# the only fields of a history row that differ between runs (the allocator's peak: where a backend reports one)
TIMING_KEYS = ("rollout_s", "update_s", "device_peak_bytes")


def run_grpo(config, params, rl: RLConfig, sample_task: Callable[[random.Random], object], vocab, *,
             log: Callable[[str], None] = print, eval_fn: Optional[Callable[[object], dict]] = None,
             eval_every: int = 0, metrics_path: Optional[str] = None, name: str = "grpo", mesh=None,
             advantage_fn: Optional[Callable[[list, dict], np.ndarray]] = None,
             stop_fn: Optional[Callable[[dict], bool]] = None, ckpt_dir: Optional[str] = None,
             ckpt_every: int = 10, keep_checkpoints: int = 2,
             on_rollout: Optional[Callable[[int, object], None]] = None) -> dict:
    """GRPO for ``rl.steps`` steps from ``params``. ``sample_task(rng) -> Task`` draws training prompts.

    Returns {"params", "history": per-step rows, "evals": [{"step", ...eval_fn(params)}], "stopped_at"}.
    metrics_path: DIR/NAME.jsonl gets every row as it is made, and DIR/tensorboard/NAME its scalars
    (glm5_jax.train.observe.ScalarLog).
    mesh: where the training state lives and the update runs (default: one device).
    advantage_fn(row_tasks, batch) -> [B, S] per-token advantages replacing the group advantages (the
    batch already holds old_logp; row_tasks[b] is row b's task). On-policy distillation plugs in here
    (glm5_jax.rl.distill): the same loss, the same update, only the advantage differs.
    stop_fn(eval row) -> True ends the run after that evaluation (e.g. "until skill A degrades").
    on_rollout(step, Rollout): called with each step's rollouts (their token ids, log-probs, rewards).
    Rollouts: a ``RolloutEngine`` on ``mesh`` (glm5_jax.rl.rollout_engine): before each step the policy
    is synced device to device into the serving layout (the mismatch copy made there), sampled with
    ``infer.generate``'s programs, and released before the update. Each row reports the sync's bytes
    (``sync_bytes_moved`` over all devices, ``sync_bytes_moved_per_device`` the most one device receives,
    ``sync_host_bytes`` 0) and the per-device memory of the phases (``rollout_memory``).
    Seeds: step s draws its prompts from ``Random(seed, s)`` and samples with PRNG seed
    ``seed * 100_003 + s``, so arms started from the same checkpoint with the same seed see the same
    prompts at every step.

    ckpt_dir: checkpoints inside the stage (glm5_jax.train.checkpoint.Checkpointer): the train state
    (params, optimizer state) every ``ckpt_every`` steps, at the last step and on SIGTERM (then
    ``Preempted``, exit code 143, glm5_jax.train.preempt), with the stage's history and evals; the prompt
    and rollout streams are functions of the step, so a rerun with the same arguments resumes from the
    newest readable checkpoint to the same rows as an uninterrupted run (all but TIMING_KEYS; a stage
    that already ran to its end returns at once). Guard: an update whose loss, gradient or new state is
    non-finite is not applied (the one step's guard); each row counts them (``skipped_updates``).
    """
    from glm5_jax.train.checkpoint import Checkpointer
    from glm5_jax.train.preempt import PREEMPTED_EXIT_CODE, Preempted, PreemptionWatch
    from glm5_jax.rl.sandbox import require_isolation
    from glm5_jax.train.state import abstract_state
    require_isolation(rl.sandbox_isolation)     # fail closed before anything compiles (issue 66)
    tx, _ = make_rl_optimizer(params, rl, config)
    update = make_update_step(config, rl, tx, mesh)
    engine = RolloutEngine(config, mesh, mismatch=rl.mismatch, reshard_chunk_bytes=rl.reshard_chunk_bytes)
    history, evals = [], []
    first, ckpt = 1, None
    if ckpt_dir is not None:
        require("run_grpo: ckpt_every", ckpt_every, ValueError, integer=True, min=1)
        ckpt = Checkpointer(ckpt_dir, keep=keep_checkpoints, async_save=False, log=log)
    found = None
    if ckpt is not None and ckpt.all_steps():
        target, _ = abstract_state(config, None, update.mesh, tx)
        found = ckpt.restore_latest(target)
    if found is not None:
        done_step, state, saved = found
        history, evals, first = list(saved["history"]), list(saved["evals"]), done_step + 1
        log(f"[{name}] resumed from step {done_step} ({ckpt.directory})")
        if saved.get("stopped_at") is not None or done_step >= rl.steps:
            ckpt.close()
            return {"params": state["params"], "history": history, "evals": evals, "stopped_at": saved.get("stopped_at")}
    else:
        state, _ = init_train_state(config, rl_train_config(rl), mesh, tx=tx, params=params)
    mf = open(metrics_path, "w") if metrics_path else None
    tb = ScalarLog(phase_logdir(metrics_path), purge_step=first) if metrics_path else None   # DIR/tensorboard/NAME
    if mf:
        for row in history:
            mf.write(json.dumps(row) + "\n")
    t0 = time.time()
    B = rl.prompts_per_step * rl.group_size
    mb = B // rl.minibatches
    stopped_at = None
    skipped_total = int(history[-1].get("skipped_updates", 0)) if history else 0
    watch = PreemptionWatch().__enter__() if ckpt is not None else None
    try:
        for step in range(first, rl.steps + 1):
            rng = random.Random(rl.seed * 1_000_003 + step)
            tasks = [sample_task(rng) for _ in range(rl.prompts_per_step)]
            t_roll = time.time()
            params = state["params"]
            if rl.offload_optimizer:                  # host memory until the update: the rollout has the devices
                opt_sh = jax.tree.map(lambda a: a.sharding, state["opt_state"])
                state = dict(state, opt_state=jax.device_put(state["opt_state"], jax.tree.map(
                    lambda s: s.with_memory_kind("pinned_host"), opt_sh)))
            sync = engine.sync(params, step)          # the rollout copy, device to device, in the serving layout
            ro = collect_rollouts(config, None, tasks, vocab, group_size=rl.group_size,
                                  max_new_tokens=rl.max_new_tokens, seed=rl.seed * 100_003 + step,
                                  temperature=rl.temperature, mismatch=rl.mismatch, engine=engine)
            engine.release()                          # the update runs with the training state alone
            memory = rollout_memory(state, engine, rl.offload_optimizer)
            if rl.offload_optimizer:
                state = dict(state, opt_state=jax.device_put(state["opt_state"], opt_sh))
            if on_rollout is not None:
                on_rollout(step, ro)
            adv = np.asarray(group_advantages(jnp.asarray(ro.rewards), rl.group_size))
            adv_train = adv
            if rl.adv_norm == "informative":
                # the loss is a mean over the B sequences; rescale so it is a mean over the sequences of
                # groups with reward variance (flat groups carry no signal and only dilute the step)
                informative = np.repeat(~np.all(adv.reshape(-1, rl.group_size) == 0, axis=1), rl.group_size)
                adv_train = adv * (B / max(int(informative.sum()), 1))
            batch = build_batch(ro, adv_train, rl.max_prompt_len)
            batch["old_logp"] = np.asarray(token_logprobs(config, params, jnp.asarray(batch["inputs"]),
                                                          jnp.asarray(batch["targets"]),
                                                          temperature=policy_temperature(rl)))
            if advantage_fn is not None:
                row_tasks = [tasks[i // rl.group_size] for i in range(B)]
                batch["advantages"] = np.asarray(advantage_fn(row_tasks, batch), np.float32)
                if batch["advantages"].shape != batch["mask"].shape:
                    raise ValueError(f"advantage_fn returned shape {batch['advantages'].shape}; expected the "
                                     f"batch's [B, S] = {batch['mask'].shape}")
            t_upd = time.time()
            perm = np.random.default_rng(rl.seed * 7919 + step).permutation(B)
            rows = []
            for m in range(rl.minibatches):
                idx = perm[m * mb:(m + 1) * mb]
                minibatch = jax.device_put({k: v[idx] for k, v in batch.items()}, update.batch_sharding)
                state, met = update(state, minibatch)
                rows.append(met)
            rows = jax.device_get(rows)
            skipped = int(sum(float(r["skipped"]) > 0 for r in rows))
            skipped_total += skipped
            if skipped:
                log(f"[{name}] step {step}: {skipped} of {rl.minibatches} updates non-finite (loss / gradient / "
                    f"update), not applied ({skipped_total} so far)")
            met = _mean_metrics([r for r in rows if float(r["skipped"]) == 0] or rows)
            met["skipped_updates"] = skipped_total
            stat = ro.status_summary()
            flat_groups = float(np.mean(np.all(adv.reshape(-1, rl.group_size) == 0, axis=1)))
            row = {"step": step, "reward_mean": float(np.mean(ro.rewards)), **met,
                   "zero_adv_group_frac": flat_groups, "mean_length": float(np.mean(ro.lengths)),
                   **{f"status_{k}": v for k, v in stat.items() if k.startswith("frac_")},
                   "rollout_s": t_upd - t_roll, "update_s": time.time() - t_upd,
                   "sync_bytes_moved": sync["bytes_moved"], "sync_bytes_moved_per_device": sync["bytes_moved_per_device"],
                   "sync_host_bytes": sync["host_bytes"], **memory}
            if eval_fn is not None and eval_every and (step % eval_every == 0 or step == rl.steps):
                ev = {"step": step, **eval_fn(state["params"])}
                evals.append(ev)
                row.update({f"eval_{k}": v for k, v in ev.items() if isinstance(v, (int, float)) and k != "step"})
            history.append(row)
            if mf:
                mf.write(json.dumps(row) + "\n")
                mf.flush()
                tb.write(row)
            if step == 1 or step % 5 == 0 or step == rl.steps:
                ev = f" eval_acc {row['eval_accuracy']:.3f}" if "eval_accuracy" in row else ""
                log(f"[{name}] step {step}/{rl.steps} reward {row['reward_mean']:.3f} pop {row['pop_frac']:.4f} "
                    f"clip {row['clip_frac']:.4f} mismatch_kl {row['mismatch_kl']:.2e}{ev} ({time.time() - t0:.0f} s, "
                    f"ETA {fmt_eta((time.time() - t0) / (step - first + 1) * (rl.steps - step))})")
            if stop_fn is not None and evals and evals[-1]["step"] == step and stop_fn(evals[-1]):
                stopped_at = step
                log(f"[{name}] stop condition met at step {step}")
            preempted = watch is not None and watch.reached(step)
            if ckpt is not None and (step % ckpt_every == 0 or step == rl.steps or preempted or stopped_at):
                ckpt.save(step, state, _jsonable({"history": history, "evals": evals, "stopped_at": stopped_at}))
                ckpt.wait()
            if preempted:
                msg = (f"[{name}] preempted ({watch.signal_name}): checkpoint of step {step} written to "
                       f"{ckpt.directory}; exiting with code {PREEMPTED_EXIT_CODE}; re-run the same command to "
                       "continue from it")
                log(msg)
                raise Preempted(msg, step)
            if stopped_at:
                break
    finally:
        if watch is not None:
            watch.close()
        if mf:
            mf.close()
            tb.close()
        if ckpt is not None:
            ckpt.close()
    return {"params": state["params"], "history": history, "evals": evals, "stopped_at": stopped_at}
