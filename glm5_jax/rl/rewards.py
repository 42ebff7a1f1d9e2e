"""Hybrid rewards for general RL: rule-based verifiers, an outcome reward model and a generative judge,
weighted per task, each source normalised to [0, 1], then the reward-hacking guards.

Sources of one sample (prompt ids + the policy's generated ids, its decoded text, its task):

* ``rule``  ``task.score(text)`` of the existing verifiers (glm5_jax.rl.tasks: 1 correct, 0 otherwise);
* ``rm``    the reward model's scalar on prompt ids + reply ids (glm5_jax.rl.reward_model.RewardModel: the
            policy's own ids, never re-tokenised), normalised sigmoid((r - rm_center) / rm_scale): a BT
            reward is a preference logit, so this is the probability of beating a reply scored rm_center;
* ``judge`` the generative judge's score (glm5_jax.rl.judge), already (N - low) / (high - low); a parse
            failure is the judge's default_score and counted.

combined = sum_s w_s x_s / sum_s w_s over the sources with w_s > 0 (weights per task kind,
``HybridConfig.weights``; sources with weight 0 are not computed), in [0, 1]; then
``glm5_jax.rl.guards.guard`` (truncation, layout anomalies). Every sample's sources, weights, combined and
guarded rewards and anomalies are returned as one record (``log`` writes them as jsonl rows). The RL
losses take the final reward unchanged: ``make_hybrid_advantage_fn`` plugs the hybrid reward into
``run_grpo(advantage_fn=...)`` (GRPO group advantages of the final rewards on the generated tokens).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from glm5_jax.rl.guards import ANOMALIES, GuardConfig, count, guard

__all__ = ["SOURCES", "TOTAL_KEYS", "HybridConfig", "Sample", "HybridReward", "samples_from_batch", "make_hybrid_advantage_fn"]

SOURCES = ("rule", "rm", "judge")
# the counters HybridReward.totals sums over every batch it scored (plus reward_removed_sum)
TOTAL_KEYS = ("samples", "truncated", "anomalous", *ANOMALIES, "judge_requests", "judge_parse_failures")


def _canonical_weights(weights) -> tuple:
    items = weights.items() if isinstance(weights, dict) else weights
    out = []
    for kind, w in items:
        w = tuple(float(x) for x in (w.get(s, 0.0) for s in SOURCES)) if isinstance(w, dict) else tuple(map(float, w))
        if len(w) != len(SOURCES) or any(x < 0 or math.isnan(x) for x in w) or sum(w) <= 0:
            raise ValueError(f"HybridConfig.weights[{kind!r}]={w!r} is invalid: three weights (rule, rm, judge) "
                             f">= 0 with a positive sum")
        out.append((str(kind), w))
    return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    # per task kind ("arithmetic", "countdown", "function", "general", ...; "default" for the rest):
    # (rule, rm, judge) weights; a dict {kind: (w_rule, w_rm, w_judge) or {"rule": ..}} is accepted
    weights: tuple = (("default", (1.0, 0.0, 0.0)),)
    rm_center: float = 0.0
    rm_scale: float = 1.0
    guards: GuardConfig = GuardConfig()

    def __post_init__(self):
        object.__setattr__(self, "weights", _canonical_weights(self.weights))
        if not self.rm_scale > 0:
            raise ValueError(f"HybridConfig.rm_scale={self.rm_scale!r} is invalid: must be > 0")

    def weights_for(self, kind: str) -> tuple:
        table = dict(self.weights)
        if kind in table:
            return table[kind]
        if "default" in table:
            return table["default"]
        raise ValueError(f"HybridConfig.weights has no entry for task kind {kind!r} and no 'default'; "
                         f"kinds: {', '.join(sorted(table))}")


@dataclasses.dataclass
class Sample:
    task: object                    # .kind, .prompt; .score(text) -> (reward, status) for rule-based kinds
    prompt_ids: List[int]
    response_ids: List[int]         # as generated, stop token included when there is one
    text: str                       # decoded response (rules and guards read text)
    truncated: bool                 # no stop token within the budget
    question: object = None         # what the judge is asked about (default: task.prompt)


class HybridReward:
    """``hybrid(samples) -> (rewards float32 [N], records, counters)``.

    reward_model: seqs (lists of ids) -> raw rewards [N] (RewardModel); judge: a GenerativeJudge. Either
    may be None when no task kind gives its source a weight. Over a run: ``totals`` (every TOTAL_KEYS
    counter summed over the batches, and reward_removed_sum = the reward the guards took away, summed over
    samples) and ``source_means`` (per source, each batch's mean of it; the sources computed only)."""

    def __init__(self, cfg: HybridConfig = HybridConfig(), *, reward_model: Optional[Callable] = None, judge=None,
                 log: Optional[str] = None):
        self.cfg, self.reward_model, self.judge, self.log_path = cfg, reward_model, judge, log
        self.totals: Dict[str, float] = {**{k: 0 for k in TOTAL_KEYS}, "reward_removed_sum": 0.0}
        self.source_means: Dict[str, List[float]] = {k: [] for k in SOURCES}

    def __call__(self, samples: Sequence[Sample]):
        cfg = self.cfg
        n = len(samples)
        w = np.array([cfg.weights_for(getattr(s.task, "kind", "default")) for s in samples], np.float64).reshape(n, 3)
        x = np.zeros((n, 3), np.float64)
        recs = [{"task": getattr(s.task, "kind", "default"), "weights": dict(zip(SOURCES, w[i].tolist()))}
                for i, s in enumerate(samples)]
        for i, s in enumerate(samples):
            if w[i, 0] > 0:
                if not hasattr(s.task, "score"):
                    raise ValueError(f"sample {i}: task kind {recs[i]['task']!r} has a rule weight but no verifier "
                                     f"(task.score)")
                r, status = s.task.score(s.text)
                x[i, 0] = float(r)
                recs[i].update(rule=float(r), rule_status=status)
        need = [i for i in range(n) if w[i, 1] > 0]
        if need:
            if self.reward_model is None:
                raise ValueError("a task kind gives the reward model a weight but HybridReward has no reward_model")
            raw = np.asarray(self.reward_model([list(samples[i].prompt_ids) + list(samples[i].response_ids)
                                                for i in need]), np.float64)
            norm = 1.0 / (1.0 + np.exp(-(raw - cfg.rm_center) / cfg.rm_scale))
            for j, i in enumerate(need):
                x[i, 1] = norm[j]
                recs[i].update(rm_raw=float(raw[j]), rm=float(norm[j]))
        need = [i for i in range(n) if w[i, 2] > 0]
        if need:
            if self.judge is None:
                raise ValueError("a task kind gives the judge a weight but HybridReward has no judge")
            res = self.judge.judge_batch([(samples[i].question if samples[i].question is not None
                                           else samples[i].task.prompt, samples[i].response_ids) for i in need])
            for j, i in enumerate(need):
                x[i, 2] = res[j].score
                recs[i].update(judge_raw=res[j].raw, judge=res[j].score, judge_parsed=res[j].parsed)
        combined = (w * x).sum(1) / w.sum(1)
        guarded = [guard(combined[i], s.text, s.truncated, cfg.guards) for i, s in enumerate(samples)]
        for i, g in enumerate(guarded):
            recs[i].update(combined=float(combined[i]), reward=g.reward, truncated=g.truncated, anomalies=g.anomalies)
        counters = count(guarded)
        counters["judge_parse_failures"] = sum(1 for r in recs if r.get("judge_parsed") is False)
        counters["judge_requests"] = sum(1 for r in recs if "judge_parsed" in r)
        for k, j in (("rule", 0), ("rm", 1), ("judge", 2)):
            sel = w[:, j] > 0
            counters[f"{k}_mean"] = float(x[sel, j].mean()) if sel.any() else None
        for k in TOTAL_KEYS:
            self.totals[k] += int(counters.get(k, 0) or 0)
        self.totals["reward_removed_sum"] += float(counters["reward_removed"]) * int(counters["samples"])
        for k in SOURCES:
            if counters.get(f"{k}_mean") is not None:
                self.source_means[k].append(float(counters[f"{k}_mean"]))
        if self.log_path:
            with open(self.log_path, "a") as f:
                for r in recs:
                    f.write(json.dumps(r) + "\n")
        return np.array([g.reward for g in guarded], np.float32), recs, counters


def samples_from_batch(row_tasks: Sequence, batch: dict, decode: Callable, stop_ids: Sequence[int]) -> List[Sample]:
    """Samples from an RL training batch (glm5_jax.rl.rollout.build_batch / gateway.records_to_batch layout:
    row = inputs[:, 0] + targets, mask on the generated tokens): the ids exactly as generated."""
    stop = {int(t) for t in stop_ids}
    out = []
    inputs, targets, mask = (np.asarray(batch[k]) for k in ("inputs", "targets", "mask"))
    for b, task in enumerate(row_tasks):
        pos = np.flatnonzero(mask[b] > 0)
        seq = np.concatenate([inputs[b, :1], targets[b]]).astype(np.int64)
        if pos.size == 0:
            raise ValueError(f"batch row {b} has no generated tokens (mask all 0)")
        prompt, resp = seq[:pos[0] + 1].tolist(), seq[pos[0] + 1:pos[-1] + 2].tolist()
        out.append(Sample(task=task, prompt_ids=prompt, response_ids=resp, text=decode(resp),
                          truncated=int(resp[-1]) not in stop))
    return out


def make_hybrid_advantage_fn(hybrid: HybridReward, decode: Callable, stop_ids: Sequence[int], group_size: int,
                             on_batch: Optional[Callable[[np.ndarray, list, dict], None]] = None):
    """advantage_fn(row_tasks, batch) -> [B, S] for ``run_grpo(advantage_fn=...)``: the hybrid reward of every
    row, GRPO group advantages of it (glm5_jax.rl.losses.group_advantages), on the generated tokens.
    ``on_batch(rewards, records, counters)`` sees every batch (logging, the reward-hacking counters)."""
    from glm5_jax.rl.losses import group_advantages

    def advantage_fn(row_tasks, batch):
        samples = samples_from_batch(row_tasks, batch, decode, stop_ids)
        rewards, recs, counters = hybrid(samples)
        if on_batch is not None:
            on_batch(rewards, recs, counters)
        adv = np.asarray(group_advantages(rewards, group_size), np.float32)
        return adv[:, None] * (np.asarray(batch["mask"]) > 0)

    return advantage_fn
