"""Synchronous and asynchronous agentic RL over the Ray rollout fleet, with one trainer.

Both modes use the same servers, gateway, coordinator, agent pool, loss and train step; only the
schedule differs:

* ``sync``: issue ``groups_per_step`` groups with the current weights, wait for all of them, train one
  step, push the new weights, repeat. The trainer idles during rollouts and the servers idle during
  the update.
* ``async``: the pool always has ``in_flight_groups`` groups running; the trainer takes a batch as soon
  as ``groups_per_step`` groups have finished, drops samples older than ``tau`` versions (staleness
  measured from the oldest token of a sample), refills/drops groups, trains, and pushes new weights
  every ``push_every`` steps while rollouts continue, without waiting for the servers to load them.

The update is the project's one train step (``glm5_jax.train.step.make_train_step``) with the agentic
loss (``glm5_jax.agentic.loss``) on the gateway's records, unchanged (``records_to_batch``).

Accounting for tests: every issued trajectory id ends in exactly one of ``trained`` (its record was in
a batch, refill copies not counted), ``dropped`` (stale / broken / group dropped) or ``unused``
(finished after the last step). ``kill_worker_at_step`` kills one server (``ray.kill``) right after
that step to exercise deregistration and re-queueing.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import time
from typing import Callable, Optional, Tuple

import jax
import numpy as np

from glm5_jax.agentic.agent import RolloutPool
from glm5_jax.agentic.coordinator import Coordinator, filter_group
from glm5_jax.agentic.gateway import Gateway, TrajectoryRecord, records_to_batch
from glm5_jax.agentic.loss import agentic_loss, group_centered_advantages
from glm5_jax.agentic.server import pin_process, start_servers
from glm5_jax.fields import require
from glm5_jax.train.observe import fmt_eta

__all__ = ["AgenticConfig", "make_agentic_loss_fn", "run_agentic", "run_summary"]


@dataclasses.dataclass(frozen=True)
class AgenticConfig:
    mode: str = "async"              # sync | async
    steps: int = 20
    groups_per_step: int = 4
    group_size: int = 4
    in_flight_groups: int = 8        # async only: groups kept running (>= groups_per_step)
    tau: int = 2                     # staleness bound (versions)
    push_every: int = 1              # async: push weights every K steps (sync pushes every step)
    servers: int = 2
    server_threads: int = 1          # XLA compute threads per server
    agent_threads: int = 32
    max_batch: int = 16              # slots (concurrent requests) per server engine
    row_buckets: Optional[Tuple[int, ...]] = None  # rows a server's decode step may run over (None: the server's default)
    width_buckets: Optional[Tuple[int, ...]] = None  # padded widths of a server's prefills (None: the server's default)
    # disaggregated placement (empty: no pinning): the trainer process and the rollout servers on
    # their own CPUs, as GLM-5 runs rollout engines and the trainer on separate accelerators
    trainer_cpus: Tuple[int, ...] = ()
    server_cpus: Tuple[int, ...] = ()
    server_mesh: str = ""            # each rollout server's engine on a mesh of its own devices ("data:2,expert:2")
    # how a push reaches the servers: "transfer" (the trainer's device arrays pulled by each server over JAX's
    # transfer server, glm5_jax.agentic.weights) | "object_store" (host gather + one ray.put)
    weight_transport: str = "transfer"
    max_len: int = 48
    max_new_tokens: int = 10
    max_turns: int = 3
    temperature: float = 1.0
    learning_rate: float = 3e-4
    frozen_patterns: tuple = ("indexer",)   # leaves with a zero update (the DSA indexer is frozen in RL)
    eps_low: float = 0.2
    eps_high: float = 0.28
    env_crash_p: float = 0.0
    kill_worker_at_step: int = 0     # 0: never
    heartbeat_s: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ("sync", "async"):
            raise ValueError(f"AgenticConfig.mode={self.mode!r}: choose sync | async")
        if self.in_flight_groups < self.groups_per_step:
            raise ValueError(f"AgenticConfig.in_flight_groups={self.in_flight_groups} must be >= "
                             f"groups_per_step={self.groups_per_step}")
        for f in ("steps", "groups_per_step", "group_size", "servers", "push_every", "agent_threads"):
            if getattr(self, f) < 1:
                raise ValueError(f"AgenticConfig.{f}={getattr(self, f)!r} must be >= 1")
        if self.weight_transport not in ("transfer", "object_store"):
            raise ValueError(f"AgenticConfig.weight_transport={self.weight_transport!r}: choose transfer | object_store")
        if self.tau < 0:
            raise ValueError(f"AgenticConfig.tau={self.tau} must be >= 0")
        if self.agent_threads < self.in_flight_groups * self.group_size:
            # one agent thread plays one trajectory end to end: fewer threads silently cap the
            # trajectories in flight (and a sync step would not run all its trajectories at once)
            raise ValueError(f"AgenticConfig.agent_threads={self.agent_threads} must be >= in_flight_groups * "
                             f"group_size = {self.in_flight_groups * self.group_size}")
        if self.row_buckets and max(self.row_buckets) != self.max_batch:
            raise ValueError(f"AgenticConfig.row_buckets={self.row_buckets} must end at max_batch={self.max_batch}")
        if self.width_buckets and max(self.width_buckets) != self.max_len - self.max_new_tokens:
            raise ValueError(f"AgenticConfig.width_buckets={self.width_buckets} must end at max_len - max_new_tokens "
                             f"= {self.max_len - self.max_new_tokens}")
        if set(self.trainer_cpus) & set(self.server_cpus):
            raise ValueError(f"AgenticConfig.trainer_cpus={self.trainer_cpus} and server_cpus={self.server_cpus} "
                             "overlap: disaggregated placement needs disjoint CPU sets")
        if self.kill_worker_at_step and self.servers < 2:
            raise ValueError("AgenticConfig.kill_worker_at_step needs servers >= 2 (one must survive)")


def make_agentic_loss_fn(config, eps_low: float, eps_high: float, temperature: float = 1.0):
    """loss_fn(params, batch) -> (loss, (metrics, {})) for make_train_step: the agentic loss on the
    training engine's log-probs of the recorded tokens, at the servers' sampling temperature (the
    rollout log-probs are of the temperature-scaled distribution; greedy = 1)."""
    from glm5_jax.rl.program import token_logprobs

    def loss_fn(params, batch):
        logp = token_logprobs(config, params, batch["inputs"], batch["targets"],
                              temperature=temperature if temperature > 0 else 1.0)
        loss, m = agentic_loss(logp, None, batch["infer_logp"], batch["advantages"], batch["mask"],
                               eps_low=eps_low, eps_high=eps_high)
        return loss, (dict(m, loss=loss), {})

    return loss_fn


def run_agentic(model_cfg, params, cfg: AgenticConfig, vocab, sample_task: Callable, *,
                log: Callable[[str], None] = print, workers: Optional[dict] = None, drain: bool = True,
                snapshot_wall_s: Optional[float] = None, ckpt_dir: Optional[str] = None,
                ckpt_every: int = 10, mesh=None) -> dict:
    """Train ``cfg.steps`` steps from ``params``. ``workers``: existing server handles (else started
    here, and killed at the end). ``snapshot_wall_s``: also return the policy as it stood at that many
    seconds into the timed region (the last step finished by then; the start params if none), to
    compare arms at the same wall-clock time. Returns {"params", "history", "accounting", "staleness",
    "wall_s", "trained_tokens", "trainer_idle_s", "dead", "requeued", "server_busy_s" (decode seconds in
    the timed region per server still alive at the end), "snapshot" ({"step", "params"}, or None)}.
    mesh: where the trainer's state lives and its update runs (default one device); the servers own
    their devices (``cfg.server_mesh``). A push (``push_bytes`` in the row: the policy's bytes), with
    ``cfg.weight_transport="transfer"``: the policy's device arrays offered on the trainer's JAX transfer
    server and pulled by each server into its devices (glm5_jax.agentic.weights: no host gather, no
    object store); with "object_store": one gather to the trainer's host and one ``ray.put`` (shared
    memory: the servers on this node map it); in each server then a copy into its engine's serving
    shards (docs/agentic_rl.md, "On a mesh").

    ckpt_dir: checkpoints inside the stage (glm5_jax.train.checkpoint.Checkpointer) every ``ckpt_every``
    steps, at the last step and on SIGTERM (then ``Preempted``, exit 143): the train state (params,
    optimizer), the policy version, the history and the prompt stream's state. A rerun resumes from the
    newest readable one: the servers start from its params (pushed as its version) and the prompt stream
    continues where it was. Rollouts in flight at the kill are not kept (they are re-drawn), so resumed
    rows are the same steps, params and prompts but not bitwise the rows of an uninterrupted async run.
    Guard: an update whose loss, gradient or new state is non-finite is not applied (the one step's
    guard) and its step pushes nothing (``skipped`` in the row), so no server ever gets NaN weights."""
    import ray
    from glm5_jax.rl.program import RLConfig, make_rl_optimizer, rl_train_config
    from glm5_jax.train.state import init_train_state
    from glm5_jax.train.step import make_train_step

    rl = RLConfig(loss="none", steps=cfg.steps, prompts_per_step=cfg.groups_per_step, group_size=cfg.group_size,
                  minibatches=1, learning_rate=cfg.learning_rate, optimizer="adamw", adam_b2=0.999,
                  weight_decay=0.0, mismatch="none", frozen_patterns=tuple(cfg.frozen_patterns), eps_low=cfg.eps_low,
                  eps_high=cfg.eps_high, seed=cfg.seed)
    from glm5_jax.train.checkpoint import Checkpointer
    from glm5_jax.train.preempt import PREEMPTED_EXIT_CODE, Preempted, PreemptionWatch
    from glm5_jax.train.state import abstract_state
    tx, _ = make_rl_optimizer(params, rl, model_cfg)
    update = make_train_step(model_cfg, rl_train_config(rl), tx, mesh,
                             loss_fn=make_agentic_loss_fn(model_cfg, cfg.eps_low, cfg.eps_high, cfg.temperature))
    ckpt, found = None, None
    if ckpt_dir is not None:
        require("run_agentic: ckpt_every", ckpt_every, ValueError, integer=True, min=1)
        ckpt = Checkpointer(ckpt_dir, keep=2, async_save=False, log=log)
        if ckpt.all_steps():
            found = ckpt.restore_latest(abstract_state(model_cfg, None, update.mesh, tx)[0])
    if found is not None:
        first, state, saved = found[0] + 1, found[1], found[2]
        params = jax.device_get(state["params"])
        log(f"[{cfg.mode}] resumed from step {found[0]} ({ckpt.directory})")
    else:
        first, saved = 1, None
        state, _ = init_train_state(model_cfg, rl_train_config(rl), mesh, tx=tx, params=params)
    own = workers is None
    if own:
        workers = start_servers(cfg.servers, model_cfg, params, threads=cfg.server_threads, max_batch=cfg.max_batch,
                                max_len=cfg.max_len, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                stop_tokens=(vocab.newline_id,), seed=cfg.seed, row_buckets=cfg.row_buckets,
                                cpus=cfg.server_cpus or None, width_buckets=cfg.width_buckets,
                                mesh=cfg.server_mesh or None)
    coord = Coordinator(workers, heartbeat_s=cfg.heartbeat_s, log=log)
    publisher = None
    if cfg.weight_transport == "transfer":
        from glm5_jax.agentic.weights import WeightPublisher, transfer_available
        if not transfer_available():
            raise RuntimeError("AgenticConfig.weight_transport='transfer' needs jax.experimental.transfer (not in "
                               f"jax {jax.__version__}); use weight_transport='object_store'")
        publisher = WeightPublisher()
    coord.check_health()                                  # waits for every actor to be up
    ray.get([h.warmup.remote() for h in coord.live().values()])   # every decode shape compiled, untimed
    coord.start_heartbeats()
    gateway = Gateway()
    pool = RolloutPool(coord, gateway, vocab, group_size=cfg.group_size, threads=cfg.agent_threads,
                       max_turns=cfg.max_turns, max_len=cfg.max_len, max_new_tokens=cfg.max_new_tokens,
                       env_crash_p=cfg.env_crash_p, seed=cfg.seed, log=log)
    rng = random.Random(cfg.seed * 1_000_003 + 17)
    n_groups = [0]
    version = 0
    history, skipped_total = [], 0
    if saved is not None:
        version, history = saved["version"], list(saved["history"])
        skipped_total = int(history[-1].get("skipped_updates", 0)) if history else 0
        coord.push_weights(version, params, wait=True)      # servers started from these params: label them

    def submit():
        gid = f"g{n_groups[0]:05d}"
        n_groups[0] += 1
        pool.submit_group(gid, sample_task(rng))

    # warm up: one group compiles every server's decode outside the timed region (both modes alike);
    # its records are accounted as "warmup", never trained
    staleness, trained, dropped, warmup = [], [], [], []
    for _ in range(cfg.servers):
        submit()
    for _ in range(cfg.servers):
        warmup += [r.traj_id for r in pool.get_group()]
    if saved is not None:            # the prompt stream (and group ids) continue where the checkpoint was
        rng.setstate(_rng_state(saved["rng"]))
        n_groups[0] = saved["n_groups"]
    trained_tokens, idle_s = 0, 0.0
    # compile the update outside the timed region too: with all-zero advantages the gradient is 0 and
    # AdamW (no weight decay) leaves the parameters exactly as they are
    n = cfg.groups_per_step * cfg.group_size
    warm = records_to_batch([TrajectoryRecord(traj_id="w", group_id="w", tokens=[1, 2], logp=[0.0, 0.0],
                                              mask=[0, 1], versions=[-1, 0])] * n, np.zeros(n), cfg.max_len)
    warm.pop("versions")
    state, _ = update(state, jax.device_put(warm, update.batch_sharding))
    jax.block_until_ready(state)
    if cfg.mode == "async":
        for _ in range(cfg.in_flight_groups):
            submit()
    busy0 = _busy(coord)
    # disaggregated placement for the timed region: the update (this process's other threads) on
    # trainer_cpus; the agent threads (which play the episodes and call the servers) on the rollout
    # side's server_cpus. They still share this process's GIL (the update releases it while XLA runs).
    prev_cpus = pin_process(cfg.trainer_cpus)
    if prev_cpus is not None:
        pin_process(cfg.server_cpus, tids=pool.native_ids())
    snapshot = None if snapshot_wall_s is None else {"step": 0, "params": params}
    t0 = time.time()
    watch = PreemptionWatch().__enter__() if ckpt is not None else None
    try:
        for step in range(first, cfg.steps + 1):
            t_wait = time.time()
            if cfg.mode == "sync":
                for _ in range(cfg.groups_per_step):
                    submit()
            batch_recs, info_sum, rewards = [], {"stale": 0, "broken": 0, "refilled": 0, "dropped": 0}, []
            while len(batch_recs) < cfg.groups_per_step * cfg.group_size:
                group = pool.get_group()
                if cfg.mode == "async":
                    submit()                              # keep in_flight_groups running
                rewards += [r.reward for r in group]
                kept, info = filter_group(group, version, cfg.tau)
                for k in info:
                    info_sum[k] += info[k]
                if kept is None:
                    dropped += [r.traj_id for r in group]
                    if cfg.mode == "sync":
                        submit()                          # sync: replace the dropped group
                    continue
                staleness += [version - r.min_version for r in kept if r.refill_of is None]
                dropped += [r.traj_id for r in group if r.traj_id not in {k.traj_id for k in kept}]
                batch_recs += kept
            t_train = time.time()
            idle_s += t_train - t_wait
            adv = np.asarray(group_centered_advantages(np.array([r.reward for r in batch_recs]), cfg.group_size))
            batch = records_to_batch(batch_recs, adv, cfg.max_len)
            batch.pop("versions")
            state, met = update(state, jax.device_put(batch, update.batch_sharding))
            met = jax.device_get(met)
            t_push = time.time()
            skipped = float(met["skipped"]) > 0
            host, push_bytes = None, 0
            if skipped:       # not applied (non-finite loss / gradient / update): the policy did not change
                skipped_total += 1
                log(f"[{cfg.mode}] step {step}: the update is non-finite, not applied and not pushed "
                    f"({skipped_total} so far)")
            else:
                version += 1
            if not skipped and (cfg.mode == "sync" or step % cfg.push_every == 0):
                # sync: the next rollouts must use the new weights, so wait; async: don't block the
                # trainer on busy servers (replies checked at the next push)
                if publisher is not None:     # the servers pull from the trainer's devices: no host copy
                    push_bytes = int(sum(a.nbytes for a in jax.tree.leaves(state["params"])))
                    coord.push_weights(version, state["params"], wait=cfg.mode == "sync", publisher=publisher)
                else:
                    host = jax.device_get(state["params"])
                    push_bytes = int(sum(a.nbytes for a in jax.tree.leaves(host)))
                    coord.push_weights(version, host, wait=cfg.mode == "sync")
            trained += [r.traj_id for r in batch_recs if r.refill_of is None]
            ntok = int(batch["mask"].sum())
            trained_tokens += ntok
            row = {"step": step, "wall_s": time.time() - t0, "reward_mean": float(np.mean([r.reward for r in batch_recs])),
                   "tokens": ntok, "wait_s": t_train - t_wait, "train_s": time.time() - t_train,
                   "update_s": t_push - t_train, "push_s": time.time() - t_push,
                   "loss": float(met["loss"]), "masked_frac": float(met["masked_frac"]),
                   "abs_logratio": float(met["abs_logratio"]), "live_workers": len(coord.live()),
                   "push_bytes": push_bytes, "push_transport": cfg.weight_transport if push_bytes else "",
                   "skipped_updates": skipped_total, **info_sum}
            history.append(row)
            if snapshot is not None and row["wall_s"] <= snapshot_wall_s:   # a copy: the next update reuses buffers
                host = jax.device_get(state["params"]) if host is None else host
                snapshot = {"step": step, "params": jax.tree.map(np.array, host)}
            log(f"[{cfg.mode}] step {step}/{cfg.steps} reward {row['reward_mean']:.3f} tokens {ntok} "
                f"wait {row['wait_s']:.1f}s train {row['train_s']:.1f}s masked {row['masked_frac']:.3f} "
                f"stale {info_sum['stale']} ({row['wall_s']:.0f} s, "
                f"ETA {fmt_eta(row['wall_s'] / (step - first + 1) * (cfg.steps - step))})")
            preempted = watch is not None and watch.reached(step)
            if ckpt is not None and (step % ckpt_every == 0 or step == cfg.steps or preempted):
                ckpt.save(step, state, {"version": version, "n_groups": n_groups[0], "rng": _rng_json(rng),
                                        "history": history})
                ckpt.wait()
            if preempted:
                msg = (f"[{cfg.mode}] preempted ({watch.signal_name}): checkpoint of step {step} written to "
                       f"{ckpt.directory}; exiting with code {PREEMPTED_EXIT_CODE}; re-run the same command "
                       "to continue from it")
                log(msg)
                raise Preempted(msg, step)
            if cfg.kill_worker_at_step == step:
                victim = sorted(coord.live())[0]
                log(f"[{cfg.mode}] killing rollout worker {victim} (in flight: {pool.in_flight_groups} groups)")
                ray.kill(workers[victim], no_restart=True)
        wall = time.time() - t0
        busy = {n: b - busy0[n] for n, b in _busy(coord).items() if n in busy0}
        unused = []
        if drain:       # let the in-flight groups finish so every issued id is accounted for
            while pool.in_flight_groups or not pool.done.empty():
                unused += [r.traj_id for r in pool.get_group()]
    finally:
        if watch is not None:
            watch.close()
        if ckpt is not None:
            ckpt.close()
        coord.settle()
        pin_process(sorted(prev_cpus) if prev_cpus else None)
        coord.stop()
        pool.close()
    if own:
        for h in workers.values():
            ray.kill(h, no_restart=True)
    return {"params": state["params"], "history": history, "staleness": staleness, "wall_s": wall,
            "trained_tokens": trained_tokens, "trainer_idle_s": idle_s, "dead": list(coord.dead),
            "requeued": pool.requeued, "server_busy_s": busy, "snapshot": snapshot,
            "accounting": {"issued": list(pool.issued), "trained": trained, "dropped": dropped,
                           "unused": unused, "warmup": warmup, "open": gateway.open_ids()}}



def run_summary(r: dict, group_size: int) -> dict:
    """The figures of one run_agentic result: trained tokens/s, the trainer's idle fraction and step-time
    split (in an async run the trainer shares the CPU and the driver's GIL with the rollouts), the
    accounting of trajectory ids (every issued id trained, dropped, unused or warm-up exactly once: lost /
    duplicated), staleness, dropped groups and the fleet's busy fraction (decode seconds / (wall x servers
    alive at the end))."""
    acc, h, wall = r["accounting"], r["history"], r["wall_s"]
    counted = acc["trained"] + acc["dropped"] + acc["unused"] + acc["warmup"]
    mean = lambda k: float(np.mean([x[k] for x in h]))
    return {"tokens_per_s": r["trained_tokens"] / wall,
            "train_reward_last5": float(np.mean([x["reward_mean"] for x in h[-5:]])), "wall_s": wall,
            "trained_tokens": r["trained_tokens"], "trainer_idle_frac": r["trainer_idle_s"] / wall,
            "steps": len(h), "dead_workers": r["dead"], "requeued": r["requeued"], "ids_issued": len(acc["issued"]),
            "ids_accounted": len(counted), "ids_duplicated": len(counted) - len(set(counted)),
            "ids_lost": len(set(acc["issued"]) - set(counted)), "curve": [[x["wall_s"], x["reward_mean"]] for x in h],
            "train_step_s_mean": mean("train_s"), "update_s_mean": mean("update_s"), "push_s_mean": mean("push_s"),
            "masked_frac_mean": mean("masked_frac"), "stale_dropped": int(sum(x["stale"] for x in h)),
            "groups_dropped": int(sum(x["dropped"] for x in h)) // group_size,
            "server_busy_frac": (float(np.mean(list(r["server_busy_s"].values()))) / wall if r["server_busy_s"]
                                 else float("nan")),
            "staleness": dict(collections.Counter(r["staleness"]))}

def _rng_json(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_state(saved) -> tuple:
    return (saved[0], tuple(saved[1]), saved[2])


def _busy(coord) -> dict:
    """Seconds each live server has spent decoding so far (its ``busy_s`` counter)."""
    import ray
    live = coord.live()
    out = {}
    for n, h in live.items():
        try:
            out[n] = ray.get(h.ping.remote(), timeout=coord.ping_timeout_s)["busy_s"]
        except Exception:      # died in between: the heartbeat deregisters it
            pass
    return out


def evaluate(workers: dict, vocab, tasks, params=None, *, version: int = 10 ** 6, threads: int = 32,
             max_turns: int = 3, max_len: int = 48, max_new_tokens: int = 10) -> dict:
    """Sampled pass@1 of the served policy on ``tasks`` (one trajectory each, played through the same
    servers, gateway and agent loop as training). ``params``: pushed first as ``version``. Returns
    {"reward", "n", "successes", "rewards" (per task, in the order of ``tasks``)}."""
    coord = Coordinator(workers)
    coord.check_health()
    if params is not None:
        coord.push_weights(version, jax.device_get(params))
    pool = RolloutPool(coord, Gateway(), vocab, group_size=1, threads=threads, max_turns=max_turns,
                       max_len=max_len, max_new_tokens=max_new_tokens)
    try:
        for i, t in enumerate(tasks):
            pool.submit_group(f"eval{i:05d}", t)
        recs = sorted((pool.get_group()[0] for _ in tasks), key=lambda r: r.group_id)
    finally:
        pool.close()
    rewards = [r.reward for r in recs]
    return {"reward": float(np.mean(rewards)), "n": len(rewards), "successes": int(sum(rewards)),
            "rewards": rewards}
