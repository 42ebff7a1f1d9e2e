"""Training system: TrainConfig, the jitted train/eval steps, orbax checkpoints and the loop."""

from glm5_jax.train.config import TrainConfig
from glm5_jax.train.loop import TrainingDiverged, evaluate, train

__all__ = ["TrainConfig", "TrainingDiverged", "evaluate", "train"]
