"""RL stage: GRPO/IcePop losses, verifiable tasks, a sandboxed code runner and the GRPO program.

Submodules: ``losses`` (JAX), ``tasks`` and ``sandbox`` (pure Python; importing them does not
import JAX), ``sft`` (character vocabulary; packing of (prompt, answer) pairs and rendered chat samples; SFT iterator), ``rollout`` (inference-engine
rollouts, mismatch switch, training batch), ``program`` (jitted update step, GRPO loop) and ``distill``
(on-policy cross-stage distillation).
Names are re-exported lazily.
"""

_LOSS_NAMES = (
    "LOSSES",
    "get_loss",
    "grpo_icepop_loss",
    "group_advantages",
    "no_correction_loss",
    "truncated_is_loss",
)

_PROGRAM_NAMES = ("RLConfig", "evaluate_accuracy", "make_rl_optimizer", "make_update_step", "run_grpo",
                  "token_logprobs")
_ROLLOUT_NAMES = ("MISMATCH_MODES", "Rollout", "build_batch", "collect_rollouts", "fake_quant", "rollout_params")
_SFT_NAMES = ("CharVocab", "SFTIterator", "pack_examples")
_DISTILL_NAMES = ("distill_advantages", "make_teacher_advantage_fn", "run_distill")

__all__ = list(_LOSS_NAMES + _PROGRAM_NAMES + _ROLLOUT_NAMES + _SFT_NAMES + _DISTILL_NAMES)


def __getattr__(name):
    import importlib

    for mod, names in (("losses", _LOSS_NAMES), ("program", _PROGRAM_NAMES), ("rollout", _ROLLOUT_NAMES),
                       ("sft", _SFT_NAMES), ("distill", _DISTILL_NAMES)):
        if name in names:
            return getattr(importlib.import_module(f"glm5_jax.rl.{mod}"), name)
    raise AttributeError(f"module 'glm5_jax.rl' has no attribute {name!r}")
