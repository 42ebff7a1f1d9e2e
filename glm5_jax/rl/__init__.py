"""RL stage: GRPO/IcePop losses, verifiable tasks and a sandboxed code runner.

Submodules: ``losses`` (JAX), ``tasks`` and ``sandbox`` (pure Python; importing them does not
import JAX). Loss names are re-exported lazily.
"""

_LOSS_NAMES = (
    "LOSSES",
    "get_loss",
    "grpo_icepop_loss",
    "group_advantages",
    "no_correction_loss",
    "truncated_is_loss",
)

__all__ = list(_LOSS_NAMES)


def __getattr__(name):
    if name in _LOSS_NAMES:
        from glm5_jax.rl import losses

        return getattr(losses, name)
    raise AttributeError(f"module 'glm5_jax.rl' has no attribute {name!r}")
