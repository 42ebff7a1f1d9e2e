"""Training system: TrainConfig, the train state on a mesh, the one train step, orbax checkpoints and
the loop; staged training (context extension) on top of the loop."""

from glm5_jax.train.config import TrainConfig
from glm5_jax.train.loop import TrainingDiverged, evaluate, train
from glm5_jax.train.stages import Stage, train_stages
from glm5_jax.train.state import init_train_state
from glm5_jax.train.step import make_train_step

__all__ = ["Stage", "TrainConfig", "TrainingDiverged", "evaluate", "init_train_state", "make_train_step", "train",
           "train_stages"]
