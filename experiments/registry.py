"""The experiment registry: name -> (description, one typed config per scale, run function).

An experiment is a small composition of library calls. Its settings are one frozen dataclass composed
of `model: ModelConfig`, `train: TrainConfig`, `data: DataConfig` (where it reads LM data) and its
own knobs; each scale ("tiny" = the CPU default, "small" = one accelerator) is one value of that
dataclass. `resolve_config` applies `--steps` and dotted `--set a.b=value` overrides
(glm5_jax.overrides) and so validates the whole tree before anything compiles.

A config class may declare two class attributes:
  STEPS_KEY  the dotted key `--steps N` sets (default "train.steps")
  DERIVED    {key: source} for fields computed from others in `__post_init__` (e.g. model.vocab_size
             from data.vocab_size); overriding one of them is refused with a pointer to its source.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Iterable, Mapping

from glm5_jax.overrides import OverrideError, apply_overrides, split_item
from glm5_jax.errors import Glm5Error

MODULES = ("experiments.dsa_vs_mla", "experiments.muon_split", "experiments.mtp_sharing", "experiments.grpo_icepop",
           "experiments.pretrain", "experiments.sft", "experiments.qat", "experiments.distill_recovery",
           "experiments.async_vs_sync", "experiments.long_context", "experiments.post_train")


class ExperimentError(Glm5Error):
    """Unknown experiment or scale."""


@dataclasses.dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    scales: dict[str, Any]               # scale -> config (a frozen dataclass instance)
    run: Callable[..., dict]             # (config, workdir, log, mesh=None) -> report dict


REGISTRY: dict[str, Experiment] = {}


def register(name: str, description: str, scales: Mapping[str, Any]):
    for scale, cfg in scales.items():
        if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
            raise TypeError(f"experiment {name!r}: scale {scale!r} must be a dataclass instance, got {cfg!r}")

    def deco(fn):
        REGISTRY[name] = Experiment(name, description, dict(scales), fn)
        return fn
    return deco


def load_all() -> dict[str, Experiment]:
    for m in MODULES:
        try:
            importlib.import_module(m)
        except ModuleNotFoundError as e:
            if e.name != m:          # a missing experiment module is fine; a broken import is not
                raise
    return REGISTRY


def get(name: str) -> Experiment:
    exps = load_all()
    if name not in exps:
        raise ExperimentError(f"unknown experiment {name!r}; registered: {', '.join(sorted(exps))}")
    return exps[name]


def steps_key(cfg) -> str:
    return getattr(type(cfg), "STEPS_KEY", "train.steps")


def resolve_config(exp: Experiment, scale: str, overrides: Iterable[str] | Mapping[str, Any] = (),
                   steps: int | None = None):
    """The scale's config with `steps` (at STEPS_KEY) and then `overrides` applied, validated.

    Raises ExperimentError (unknown scale), OverrideError (unknown key / unparsable value) or
    ConfigError (a combination the configs' own validation rejects)."""
    if scale not in exp.scales:
        raise ExperimentError(f"experiment {exp.name!r} has no scale {scale!r}; allowed: {', '.join(exp.scales)}")
    cfg = exp.scales[scale]
    items = dict(overrides) if isinstance(overrides, Mapping) else dict(split_item(o) for o in overrides)
    if steps is not None:
        items = {steps_key(cfg): steps, **items}          # an explicit --set of the same key wins
    return apply_overrides(cfg, items, getattr(type(cfg), "DERIVED", None))


__all__ = ["Experiment", "ExperimentError", "OverrideError", "REGISTRY", "register", "load_all", "get",
           "resolve_config", "steps_key"]
