"""RL stage: GRPO/IcePop losses, verifiable tasks and a sandboxed code runner."""

from glm5_jax.rl.losses import (  # noqa: F401
    LOSSES,
    get_loss,
    grpo_icepop_loss,
    group_advantages,
    no_correction_loss,
    truncated_is_loss,
)
