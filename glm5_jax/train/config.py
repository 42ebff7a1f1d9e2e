"""TrainConfig: everything about one training run except the model and the data."""

from __future__ import annotations

import dataclasses

from glm5_jax.errors import ConfigError
from glm5_jax.fields import check_fields, invalid, setting
from glm5_jax.optim.schedules import LR_SCHEDULES, lr_schedule

INDEXER_LOSSES = (None, "dense", "sparse")
OPTIMIZERS = ("adamw", "muon", "muon_split")
NONFINITE = ("stop", "skip")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Field rules and kinds (runtime: may change on resume without changing the computation) are declared
    on the fields (glm5_jax.fields.setting) and checked by check_fields; __post_init__ adds the rules
    over several fields."""
    steps: int = setting(100, integer=True, min=1)
    batch_size: int = setting(8, integer=True, min=1)   # the global batch (all processes) of one optimizer step
    grad_accum: int = setting(1, integer=True, min=1)   # micro-batches per step (batch_size / grad_accum rows each)
    seq_len: int = setting(256, integer=True, min=1)
    learning_rate: float = setting(3e-3, gt=0)
    warmup_steps: int = setting(10, min=0, note="(clipped to steps)")
    min_lr_ratio: float = setting(0.1, min=0, max=1)
    lr_schedule: str = setting("cosine", choices=LR_SCHEDULES)   # cosine | wsd (warmup-stable-decay: glm5_jax.optim.schedules)
    decay_fraction: float = setting(0.2, min=0, max=1, note="(the share of steps at the end of a wsd schedule that "
                                    "decay the LR)")           # wsd: the last round(decay_fraction * steps) steps decay the LR
    optimizer: str = setting("adamw", choices=OPTIMIZERS)
    weight_decay: float = setting(0.1, min=0)
    grad_clip: float = setting(1.0, min=0)
    z_loss: float = setting(0.0, min=0)
    logits_chunk: int = setting(0, integer=True, min=0, note="(0 = whole logits)", runtime=True)
                                         # > 0: LM head + cross-entropy per chunk of this many tokens of each
                                         # sequence shard, recomputed in the backward (no [B, T, V] logits)
    mtp_weight: float = setting(0.3, min=0)   # GLM-4.5/5 use 0.3 early, 0.1 later
    indexer_loss: str | None = setting(None, choices=INDEXER_LOSSES)   # None | dense (warm-up) | sparse (sparse adaptation)
    indexer_loss_weight: float = setting(1.0, min=0)
    trainable_pattern: str | None = None  # regex on '/'-joined param paths; others frozen
    bias_update_rate: float = setting(1e-3, min=0)   # aux-loss-free MoE balancing step (0 disables)
    eval_every: int = setting(50, integer=True, min=1, runtime=True)
    monitor_every: int = setting(0, integer=True, min=0, note="(0 = off)", runtime=True)
                                         # > 0: record per-layer max attention logits every N steps (0 = off)
    eval_batches: int = setting(4, integer=True, min=1, runtime=True)
    log_every: int = setting(10, integer=True, min=1, runtime=True)
    ckpt_every: int = setting(50, integer=True, min=1, runtime=True)
    keep_checkpoints: int = setting(2, integer=True, min=1, runtime=True)
    keep_period: int = setting(0, integer=True, min=0, runtime=True)   # > 0: checkpoints at multiples of this step are never deleted
    ckpt_every_minutes: float = setting(0.0, min=0, note="(0 = only step-based checkpoints)", runtime=True)
                                         # > 0: also checkpoint when this many minutes passed since the last one
    nonfinite: str = setting("stop", choices=NONFINITE)
                                         # a step with a NaN/inf loss, gradient or update is never applied;
                                         # stop: end the run naming the last (finite) checkpoint; skip: go on
    max_skipped_steps: int = setting(10, integer=True, min=0)   # skip: stop after this many consecutive skipped steps
    spike_window: int = 0                # > 0: also skip a (finite) step whose loss or gradient norm exceeds
    spike_k: float = setting(6.0, gt=0, note="(standard deviations)")   # mean + spike_k * std of the last spike_window applied steps
    async_checkpoints: bool = setting(True, runtime=True)
    seed: int = 0
    profile_steps: tuple[int, int] | None = setting(None, runtime=True)  # (first, last) steps to trace with jax.profiler
    init_from: str | None = setting(None, runtime=True)
                                         # a fresh run's starting weights (HF folder, params checkpoint or run
                                         # workdir; glm5_jax.train.checkpoint.load_params); a resumed run ignores it

    def __post_init__(self):
        check_fields(self)
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"TrainConfig.batch_size={self.batch_size} is not divisible by "
                              f"TrainConfig.grad_accum={self.grad_accum}: each micro-batch has batch_size / grad_accum rows")
        if self.profile_steps is not None:
            ps = self.profile_steps
            if not (isinstance(ps, tuple) and len(ps) == 2 and all(isinstance(s, int) for s in ps) and 1 <= ps[0] <= ps[1]):
                raise invalid("TrainConfig", "profile_steps", ps, "(first, last) steps with 1 <= first <= last, or None")
        if isinstance(self.spike_window, bool) or not isinstance(self.spike_window, int) or self.spike_window < 0 \
                or self.spike_window == 1:
            raise invalid("TrainConfig", "spike_window", self.spike_window, "must be 0 (off) or an integer >= 2 (the "
                          "applied steps whose loss / grad norm mean and std define a spike)")

    def schedule(self):
        """The learning rate as a function of the optimizer's step count (lr_schedule over `steps`)."""
        return lr_schedule(self.lr_schedule, self.learning_rate, min(self.warmup_steps, self.steps), self.steps,
                           self.min_lr_ratio, self.decay_fraction)

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw)
