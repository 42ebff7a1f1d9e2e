"""The experiment registry: name -> (description, settings per scale, run function).

An experiment is a small composition of library calls. Its settings are a flat dict; each scale
("tiny" = the CPU default, "small" = one accelerator) is a full set of them, and `--set key=value`
overrides single fields with the type of the default value.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

MODULES = ("experiments.dsa_vs_mla", "experiments.muon_split", "experiments.mtp_sharing", "experiments.grpo_icepop")


class ExperimentError(ValueError):
    """Unknown experiment, scale or setting, or a value of the wrong type."""


@dataclasses.dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    scales: dict[str, dict[str, Any]]
    run: Callable[[dict, str, Callable[[str], None]], dict]   # (settings, workdir, log) -> report dict


REGISTRY: dict[str, Experiment] = {}


def register(name: str, description: str, scales: dict[str, dict[str, Any]]):
    def deco(fn):
        REGISTRY[name] = Experiment(name, description, scales, fn)
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


def _coerce(key: str, raw: str, default: Any) -> Any:
    if raw.lower() in ("none", "null") and default is None:
        return None
    try:
        if isinstance(default, bool):
            if raw.lower() in ("1", "true", "yes"):
                return True
            if raw.lower() in ("0", "false", "no"):
                return False
            raise ValueError(raw)
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        raise ExperimentError(f"setting {key}={raw!r}: expected a {type(default).__name__} like {default!r}") from None
    return raw


def resolve_settings(exp: Experiment, scale: str, overrides: list[str] | dict[str, Any] = (),
                     steps: int | None = None) -> dict[str, Any]:
    if scale not in exp.scales:
        raise ExperimentError(f"experiment {exp.name!r} has no scale {scale!r}; allowed: {', '.join(exp.scales)}")
    settings = dict(exp.scales[scale])
    if steps is not None:
        settings["steps"] = steps
    items = overrides.items() if isinstance(overrides, dict) else [_split(o) for o in overrides]
    for key, raw in items:
        if key not in settings:
            raise ExperimentError(f"experiment {exp.name!r} has no setting {key!r}; valid settings: "
                                  f"{', '.join(sorted(settings))}")
        settings[key] = _coerce(key, raw, settings[key]) if isinstance(raw, str) else raw
    return settings


def _split(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise ExperimentError(f"--set expects key=value, got {item!r}")
    k, v = item.split("=", 1)
    return k.strip(), v.strip()
