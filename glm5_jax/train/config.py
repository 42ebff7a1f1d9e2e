"""TrainConfig: everything about one training run except the model and the data."""

from __future__ import annotations

import dataclasses

from glm5_jax.config import ConfigError
from glm5_jax.optim.schedules import LR_SCHEDULES, lr_schedule

INDEXER_LOSSES = (None, "dense", "sparse")
OPTIMIZERS = ("adamw", "muon", "muon_split")
NONFINITE = ("stop", "skip")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 8                  # the global batch (all processes) of one optimizer step
    grad_accum: int = 1                  # micro-batches per step (batch_size / grad_accum rows each)
    seq_len: int = 256
    learning_rate: float = 3e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    lr_schedule: str = "cosine"          # cosine | wsd (warmup-stable-decay: glm5_jax.optim.schedules)
    decay_fraction: float = 0.2          # wsd: the last round(decay_fraction * steps) steps decay the LR
    optimizer: str = "adamw"
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    z_loss: float = 0.0
    logits_chunk: int = 0                # > 0: LM head + cross-entropy per chunk of this many tokens of each
                                         # sequence shard, recomputed in the backward (no [B, T, V] logits)
    mtp_weight: float = 0.3              # GLM-4.5/5 use 0.3 early, 0.1 later
    indexer_loss: str | None = None      # None | dense (warm-up) | sparse (sparse adaptation)
    indexer_loss_weight: float = 1.0
    trainable_pattern: str | None = None  # regex on '/'-joined param paths; others frozen
    bias_update_rate: float = 1e-3       # aux-loss-free MoE balancing step (0 disables)
    eval_every: int = 50
    monitor_every: int = 0               # > 0: record per-layer max attention logits every N steps (0 = off)
    eval_batches: int = 4
    log_every: int = 10
    ckpt_every: int = 50
    keep_checkpoints: int = 2
    keep_period: int = 0                 # > 0: checkpoints at multiples of this step are never deleted
    ckpt_every_minutes: float = 0.0      # > 0: also checkpoint when this many minutes passed since the last one
    nonfinite: str = "stop"              # a step with a NaN/inf loss, gradient or update is never applied;
                                         # stop: end the run naming the last (finite) checkpoint; skip: go on
    max_skipped_steps: int = 10          # skip: stop after this many consecutive skipped steps
    spike_window: int = 0                # > 0: also skip a (finite) step whose loss or gradient norm exceeds
    spike_k: float = 6.0                 # mean + spike_k * std of the last spike_window applied steps
    async_checkpoints: bool = True
    seed: int = 0
    profile_steps: tuple[int, int] | None = None  # (first, last) steps to trace with jax.profiler

    def __post_init__(self):
        for f in ("steps", "batch_size", "grad_accum", "seq_len", "eval_every", "eval_batches", "log_every", "ckpt_every",
                  "keep_checkpoints"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"TrainConfig.{f}={v!r} is invalid: must be an integer >= 1")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"TrainConfig.batch_size={self.batch_size} is not divisible by "
                              f"TrainConfig.grad_accum={self.grad_accum}: each micro-batch has batch_size / grad_accum rows")
        if self.profile_steps is not None:
            ps = self.profile_steps
            if not (isinstance(ps, tuple) and len(ps) == 2 and all(isinstance(s, int) for s in ps) and 1 <= ps[0] <= ps[1]):
                raise ConfigError(f"TrainConfig.profile_steps={ps!r} is invalid: (first, last) steps with "
                                  "1 <= first <= last, or None")
        if not isinstance(self.logits_chunk, int) or isinstance(self.logits_chunk, bool) or self.logits_chunk < 0:
            raise ConfigError(f"TrainConfig.logits_chunk={self.logits_chunk!r} is invalid: must be an integer >= 0 "
                              "(0 = whole logits)")
        if not isinstance(self.monitor_every, int) or self.monitor_every < 0:
            raise ConfigError(f"TrainConfig.monitor_every={self.monitor_every!r} is invalid: must be an integer >= 0 (0 = off)")
        if not self.learning_rate > 0:
            raise ConfigError(f"TrainConfig.learning_rate={self.learning_rate!r} is invalid: must be > 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"TrainConfig.warmup_steps={self.warmup_steps!r} is invalid: must be >= 0 (clipped to steps)")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"TrainConfig.lr_schedule={self.lr_schedule!r} is invalid: allowed: {', '.join(LR_SCHEDULES)}")
        if isinstance(self.decay_fraction, bool) or not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError(f"TrainConfig.decay_fraction={self.decay_fraction!r} is invalid: must be in [0, 1] "
                              "(the share of steps at the end of a wsd schedule that decay the LR)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"TrainConfig.min_lr_ratio={self.min_lr_ratio!r} is invalid: must be in [0, 1]")
        if self.nonfinite not in NONFINITE:
            raise ConfigError(f"TrainConfig.nonfinite={self.nonfinite!r} is invalid: allowed: {', '.join(NONFINITE)}")
        if isinstance(self.spike_window, bool) or not isinstance(self.spike_window, int) or self.spike_window < 0 \
                or self.spike_window == 1:
            raise ConfigError(f"TrainConfig.spike_window={self.spike_window!r} is invalid: must be 0 (off) or an "
                              "integer >= 2 (the applied steps whose loss / grad norm mean and std define a spike)")
        if isinstance(self.spike_k, bool) or not isinstance(self.spike_k, (int, float)) or not self.spike_k > 0:
            raise ConfigError(f"TrainConfig.spike_k={self.spike_k!r} is invalid: must be > 0 (standard deviations)")
        for f in ("keep_period", "max_skipped_steps"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"TrainConfig.{f}={v!r} is invalid: must be an integer >= 0")
        if isinstance(self.ckpt_every_minutes, bool) or not self.ckpt_every_minutes >= 0:
            raise ConfigError(f"TrainConfig.ckpt_every_minutes={self.ckpt_every_minutes!r} is invalid: must be >= 0 "
                              "(0 = only step-based checkpoints)")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"TrainConfig.optimizer={self.optimizer!r} is invalid: allowed: {', '.join(OPTIMIZERS)}")
        if self.indexer_loss not in INDEXER_LOSSES:
            raise ConfigError(f"TrainConfig.indexer_loss={self.indexer_loss!r} is invalid: allowed: None, dense, sparse")
        for f in ("mtp_weight", "z_loss", "indexer_loss_weight", "bias_update_rate", "weight_decay", "grad_clip"):
            if getattr(self, f) < 0:
                raise ConfigError(f"TrainConfig.{f}={getattr(self, f)!r} is invalid: must be >= 0")

    def schedule(self):
        """The learning rate as a function of the optimizer's step count (lr_schedule over `steps`)."""
        return lr_schedule(self.lr_schedule, self.learning_rate, min(self.warmup_steps, self.steps), self.steps,
                           self.min_lr_ratio, self.decay_fraction)

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw)
