"""async_vs_sync: the same multi-turn tool task trained synchronously and asynchronously.

The task (glm5_jax.agentic.agent.ChainTask): pointer chasing through a key-value tool, one lookup per
turn, with the number of lookups drawn per task from a truncated power law (``max_hops``,
``hop_alpha``): most episodes take 2-3 turns, a few take up to ``max_hops + 1``. That long tail is what
GLM-5's asynchronous design is for: a synchronous step waits for its slowest episode while the
servers run near-empty batches; the asynchronous trainer takes whatever groups are ready while the
servers keep full batches of new episodes.

Phases:
  sft     a tiny DSA model (character vocabulary) is fine-tuned briefly on worked transcripts
          (look up, read, look up again ..., reply; glm5_jax.agentic.agent) through
          glm5_jax.train.train with DSA's dense warm-up (the indexer learns its KL to the dense
          attention), so RL starts from a partly competent policy (served sparse, top-k)
  arms    from that checkpoint, with the same seed and prompts: ``sync`` (rollout, then train, then
          push weights) and ``async`` (rollouts keep running while the trainer consumes finished
          groups; staleness bound tau; weights pushed every step), each on its own Ray rollout fleet
          (glm5_jax.agentic.server: ``servers`` actors, 1 XLA thread each) on a local Ray cluster.
          Both arms: the same servers, row buckets, groups per step and data; the sync arm runs all
          ``groups_per_step`` groups at once on all servers, then trains.
          The async arm kills one rollout worker halfway (``kill_in_async``): the coordinator must
          deregister it and re-queue its trajectories, and the run must finish.
Primary metric (named before the run): trained tokens per second, async / sync (target >= 1.5);
secondary: held-out TEST sampled reward after RL per arm (prompts never trained on, never used to
choose settings), reward against wall time (TEST reward of both arms' policies at the async arm's
end, paired over tasks; training reward in equal wall-clock windows), trainer idle fraction,
staleness histogram. The async arm runs first: its wall time is where the sync arm's policy is kept.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import random
import time
from typing import ClassVar

import numpy as np

from experiments.registry import register
from experiments.report import md_table, plot_curves, write_report
from glm5_jax.intervals import fmt_interval, mean_interval, paired_interval, proportion_interval
from glm5_jax.agentic.agent import make_chain_task, sft_example
from glm5_jax.agentic.server import ray_init, start_servers, stop_servers
from glm5_jax.agentic.trainer import AgenticConfig, evaluate, run_agentic, run_summary
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.rl.sft import CharVocab, SFTIterator, char_policy
from glm5_jax.rl.tasks import distinct_tasks, draw_excluding
from glm5_jax.train import TrainConfig, train
from glm5_jax.train.observe import write_scalars

# async first: its wall time is the clock point at which the sync arm's policy is kept for the matched
# comparison (the async arm, at >= 1.5x the throughput, is the shorter one)
ARMS = ("async", "sync")


@dataclasses.dataclass(frozen=True)
class AsyncVsSyncConfig:
    """model: the policy; train: the SFT warm start; agentic: the RL settings shared by both arms
    (agentic.mode is set per arm)."""
    model: ModelConfig
    train: TrainConfig
    agentic: AgenticConfig
    test_tasks: int = 128
    # SFT steps run of train.steps' schedule: cut while the copying is half formed (tiny, validation
    # split: greedy 0.69, sampled 0.54; the full 400 steps reach 1.0), so RL has room to climb
    sft_steps: int = 300
    max_hops: int = 8             # tool lookups per episode: 1..max_hops, P(k) ~ k^-hop_alpha
    hop_alpha: float = 1.5        # P(1 hop) 0.52, P(>= 5 hops) 0.13: a sync step of 8 tasks usually waits on one
    kill_in_async: bool = True
    ray_cpus: int = 2
    reward_windows: int = 5       # equal wall-clock windows of the training-reward comparison

    STEPS_KEY: ClassVar[str] = "agentic.steps"
    DERIVED: ClassVar[dict] = {"model.vocab_size": "the character vocabulary", "agentic.mode": "the arm",
                               "agentic.kill_worker_at_step": "kill_in_async"}

    def __post_init__(self):
        object.__setattr__(self, "model", self.model.replace(vocab_size=CharVocab().padded_size()))
        if self.test_tasks < 1:
            raise ConfigError(f"AsyncVsSyncConfig.test_tasks={self.test_tasks!r} is invalid: must be >= 1")
        if not 1 <= self.sft_steps <= self.train.steps:
            raise ConfigError(f"AsyncVsSyncConfig.sft_steps={self.sft_steps!r} is invalid: must be in [1, train.steps="
                              f"{self.train.steps}]")
        if self.reward_windows < 1:
            raise ConfigError(f"AsyncVsSyncConfig.reward_windows={self.reward_windows!r} is invalid: must be >= 1")
        if self.agentic.max_turns < self.max_hops + 1:
            raise ConfigError(f"AsyncVsSyncConfig.agentic.max_turns={self.agentic.max_turns} must be >= max_hops + 1 = "
                              f"{self.max_hops + 1} (every lookup is a turn, then the answer)")
        # bos + 'kkk:' + hops x ('(kkk)\n' + '>kkk\n') + 'vv\n': the longest episode must fit the context
        need = 8 + 11 * self.max_hops
        if self.agentic.max_len < need or self.train.seq_len < need:
            raise ConfigError(f"AsyncVsSyncConfig: agentic.max_len={self.agentic.max_len} and train.seq_len="
                              f"{self.train.seq_len} must be >= {need} (the longest {self.max_hops}-hop episode)")
        if self.kill_in_async and self.agentic.servers < 2:
            raise ConfigError("AsyncVsSyncConfig.kill_in_async needs agentic.servers >= 2")


TINY = AsyncVsSyncConfig(
    model=char_policy(64, 4, 2, 192),
    # indexer_loss="dense": DSA's dense warm-up. The indexer learns only from its KL to the main
    # attention; without it the SFT's sparse attention picks its top-16 keys with a random indexer and
    # the copying the task needs never forms (validation probe: sampled reward ~0.06 after 800 steps)
    train=TrainConfig(steps=400, batch_size=16, seq_len=128, learning_rate=3e-3, warmup_steps=20, min_lr_ratio=0.1,
                      weight_decay=0.0, eval_every=300, log_every=100, ckpt_every=300, seed=0, indexer_loss="dense"),
    # tau=8: the longest episode (9 turns) spans several trainer versions in the async arm; a small tau
    # would drop exactly the long tasks (a length bias), so the bound is set above the longest
    # episode's usual span and the double-sided ratio mask handles the off-policy tokens
    agentic=AgenticConfig(steps=100, groups_per_step=8, group_size=4, in_flight_groups=16, tau=8, push_every=1,
                          servers=2, server_threads=1, agent_threads=64, max_batch=32, max_len=104,
                          max_new_tokens=6, max_turns=10, learning_rate=2e-4, trainer_cpus=(0,), server_cpus=(1,),
                          row_buckets=(8, 32), width_buckets=(32, 98),
                          frozen_patterns=("indexer", "embed", "layer_0/attn"), seed=0),
)

SMALL = dataclasses.replace(
    TINY, model=char_policy(128, 4, 4, 384),
    train=TINY.train.replace(steps=1000, batch_size=32, eval_every=750, log_every=250, ckpt_every=750), sft_steps=750,
    agentic=dataclasses.replace(TINY.agentic, steps=200, groups_per_step=16, in_flight_groups=32, servers=4,
                                agent_threads=128),
    test_tasks=512)


def test_split(n: int, make_task, seed: int = 12345) -> list:
    """Tasks with distinct held-out prompts (start keys); training draws exclude them."""
    return distinct_tasks(make_task, n, random.Random(seed))


@register("async_vs_sync", "multi-turn calculator-tool RL, synchronous vs asynchronous (Ray rollout servers, "
          "TITO gateway, staleness bound, worker kill)", {"tiny": TINY, "small": SMALL})
def run(cfg: AsyncVsSyncConfig, workdir: str, log, mesh=None) -> dict:
    t_start = time.time()
    vocab = CharVocab()
    make_task = functools.partial(make_chain_task, max_hops=cfg.max_hops, alpha=cfg.hop_alpha)
    test = test_split(cfg.test_tasks, make_task)
    exclude = {t.prompt for t in test}

    sample_task = functools.partial(draw_excluding, make_task, exclude)

    log("primary metric (named before the run): trained tokens/s async / sync (>= 1.5 wanted); "
        "secondary: TEST sampled reward after RL, reward vs wall time")
    it = SFTIterator(sample_task, vocab, cfg.train.batch_size, cfg.train.seq_len, seed=cfg.train.seed,
                     exclude=exclude, encode=lambda t: sft_example(t, vocab))
    sft = train(cfg.model, cfg.train, it, os.path.join(workdir, "sft"), log=log, name="sft", mesh=mesh,
                stop_after=cfg.sft_steps)
    sft_params = sft["params"]
    ray_init(cfg.ray_cpus)
    ag = cfg.agentic
    arms, before, matched = {}, None, {}
    for arm in ARMS:
        acfg = dataclasses.replace(ag, mode=arm,
                                   kill_worker_at_step=(max(1, ag.steps // 2) if arm == "async" and cfg.kill_in_async else 0))
        workers = start_servers(acfg.servers, cfg.model, sft_params, threads=acfg.server_threads,
                                max_batch=acfg.max_batch, max_len=acfg.max_len, max_new_tokens=acfg.max_new_tokens,
                                temperature=acfg.temperature, stop_tokens=(vocab.newline_id,), seed=acfg.seed,
                                row_buckets=acfg.row_buckets, width_buckets=acfg.width_buckets,
                                cpus=acfg.server_cpus or None, mesh=acfg.server_mesh or None)
        if before is None:
            before = evaluate(workers, vocab, test, max_turns=acfg.max_turns, max_len=acfg.max_len,
                              max_new_tokens=acfg.max_new_tokens)
            log(f"[sft] TEST sampled reward {before['reward']:.3f}")
        t_arm = time.time()
        t_match = arms["async"]["wall_s"] if arm == "sync" else None
        r = run_agentic(cfg.model, sft_params, acfg, vocab, sample_task, log=log, workers=workers,
                        snapshot_wall_s=t_match, mesh=mesh)
        write_scalars(os.path.join(workdir, "tensorboard", f"rl_{arm}"), r["history"])     # TensorBoard: the arm's steps
        evaluate_on_test = functools.partial(evaluate, workers, vocab, test, max_turns=acfg.max_turns,
                                             max_len=acfg.max_len, max_new_tokens=acfg.max_new_tokens)
        after = evaluate_on_test(r["params"])
        # each arm's policy as it stood when the async arm finished: async's final one, sync's snapshot
        matched[arm] = (after if arm == "async" else
                        dict(evaluate_on_test(r["snapshot"]["params"]), step=r["snapshot"]["step"]))
        stop_servers(workers)
        arms[arm] = {**run_summary(r, acfg.group_size), "final_reward": after["reward"],
                     "test_reward_interval": proportion_interval(after["successes"], after["n"]),
                     "arm_total_s": time.time() - t_arm}
        log(f"[{arm}] {arms[arm]['tokens_per_s']:.1f} trained tokens/s, idle {arms[arm]['trainer_idle_frac']:.2f}, "
            f"TEST reward {before['reward']:.3f} -> {after['reward']:.3f}, ids lost {arms[arm]['ids_lost']} "
            f"duplicated {arms[arm]['ids_duplicated']}, requeued {r['requeued']}")
    ratio = arms["async"]["tokens_per_s"] / arms["sync"]["tokens_per_s"]
    # reward vs wall time over the window both arms ran: per-step batch rewards in equal wall-clock
    # windows (t intervals over the steps of a window), and their mean over the whole window
    t_common = min(arms[a]["wall_s"] for a in ARMS)
    edges = np.linspace(0.0, t_common, cfg.reward_windows + 1)
    def steps_in(a, lo, hi):
        return [rw for w, rw in arms[a]["curve"] if lo < w <= hi]
    windows = [{"wall_s": [float(lo), float(hi)],
                **{a: (mean_interval(steps_in(a, lo, hi)) if steps_in(a, lo, hi) else None) for a in ARMS}}
               for lo, hi in zip(edges[:-1], edges[1:])]
    # a short run (smoke scale) may finish one arm before the other's first step: no interval then
    time_avg = {a: (mean_interval(steps_in(a, 0.0, t_common)) if steps_in(a, 0.0, t_common) else None)
                for a in ARMS}
    # TEST at the same wall-clock time (the async arm's end), paired over tasks
    diff = paired_interval(matched["async"]["rewards"], matched["sync"]["rewards"])
    matched_report = {"wall_s": arms["async"]["wall_s"], "sync_step": matched["sync"]["step"],
                      "async_step": arms["async"]["steps"],
                      **{a: {"test_reward": matched[a]["reward"],
                             "interval": proportion_interval(matched[a]["successes"], matched[a]["n"])} for a in ARMS},
                      "async_minus_sync": diff}
    hist = {str(k): v for k, v in sorted(arms["async"]["staleness"].items())}
    plot_curves(os.path.join(workdir, "reward_vs_wall.png"),
                {a: ([c[0] for c in arms[a]["curve"]], [c[1] for c in arms[a]["curve"]]) for a in ARMS},
                title="training reward vs wall time", xlabel="wall seconds", ylabel="batch reward")
    hops = collections.Counter(t.hops for t in test)
    report = {"arms": arms, "throughput_ratio": ratio, "staleness_histogram": hist, "before": before,
              "matched_wall": matched_report, "reward_windows": windows, "train_reward_time_avg": time_avg,
              "test_hops_histogram": {str(k): v for k, v in sorted(hops.items())},
              "total_s": time.time() - t_start}
    md = f"""# async_vs_sync

Primary (named before the run): trained tokens/s async / sync = **{ratio:.2f}** (wanted >= 1.5).

{md_table(["arm", "trained tokens/s", "trainer idle frac", "server busy frac", "train step s (update + push)",
           "update s", "wall s", "steps",
           "TEST reward before",
           "TEST reward after (Wilson 95%)", "dead workers", "requeued", "ids lost", "ids duplicated"],
          [[a, arms[a]["tokens_per_s"], arms[a]["trainer_idle_frac"], arms[a]["server_busy_frac"],
            arms[a]["train_step_s_mean"], arms[a]["update_s_mean"], arms[a]["wall_s"], arms[a]["steps"],
            before["reward"], fmt_interval(arms[a]["test_reward_interval"]),
            ",".join(arms[a]["dead_workers"]) or "-", arms[a]["requeued"], arms[a]["ids_lost"],
            arms[a]["ids_duplicated"]] for a in ARMS])}

Reward against wall time. TEST sampled reward of each arm's policy at the same wall-clock time, the
async arm's end ({matched_report["wall_s"]:.0f} s: async step {matched_report["async_step"]}, sync step
{matched_report["sync_step"]}; Wilson 95%): sync {fmt_interval(matched_report["sync"]["interval"])},
async {fmt_interval(matched_report["async"]["interval"])};
async - sync, paired over the TEST tasks (bootstrap 95%): {fmt_interval(diff)}.

Training batch reward over the {t_common:.0f} s both arms ran: mean over the steps of the whole
window (t 95% over steps) sync {fmt_interval(time_avg["sync"])}, async {fmt_interval(time_avg["async"])}; by equal
wall-clock window:

{md_table(["wall s", "sync steps", "sync reward", "async steps", "async reward"],
          [[f"{w['wall_s'][0]:.0f}-{w['wall_s'][1]:.0f}", w["sync"]["n"] if w["sync"] else 0, fmt_interval(w["sync"]),
            w["async"]["n"] if w["async"] else 0, fmt_interval(w["async"])] for w in windows])}

Staleness histogram of the async arm's trained samples (trainer version - oldest token's version):
{hist}; stale samples dropped: sync {arms["sync"]["stale_dropped"]}, async {arms["async"]["stale_dropped"]};
tokens masked by the ratio band (mean per step): sync {arms["sync"]["masked_frac_mean"]:.4f},
async {arms["async"]["masked_frac_mean"]:.4f}.

Hops per TEST task (tool lookups; the training draws follow the same law): {report["test_hops_histogram"]}

Plot: reward_vs_wall.png. Load on the machine is reported in docs/agentic_rl.md with the run.
"""
    write_report(workdir, report, md)
    return report
