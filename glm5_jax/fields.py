"""Config field rules, declared once on the fields of the config dataclasses, and the one validator that
reads them.

    @dataclasses.dataclass(frozen=True)
    class TrainConfig:
        steps: int = setting(100, integer=True, min=1)
        learning_rate: float = setting(3e-3, gt=0)
        lr_schedule: str = setting("cosine", choices=LR_SCHEDULES)
        log_every: int = setting(10, integer=True, min=1, runtime=True)

        def __post_init__(self):
            check_fields(self)          # every declared rule, in field order
            ...                         # rules over several fields stay hand-written, with invalid()

A rule: `integer` (an int, not a bool), `min` / `max` (inclusive), `gt` / `lt` (exclusive), `choices`,
`optional` (None is allowed too), `finite`; `when(cfg)` limits it to configs where it applies (MLA
widths only for MLA attention); `note` is added to the message. Every message has one form, naming
the field, the bad value and what is allowed:

    TrainConfig.steps=0 is invalid: must be an integer >= 1
    ModelConfig.attention='sliding' is invalid: allowed: mha, gqa, mla, dsa

Field kinds, also in the metadata (read with `fields_with`):
  runtime=True       how the run executes, not what it computes: may change on resume or between
                     stages with the same results up to float round-off (chunk sizes, remat, kernel
                     choice, logging and checkpoint cadence);
  same_weights=True  changes the computation but not what the weights mean: a checkpoint of one
                     value starts a run of another (dtypes, MoE dispatch and capacity, MTP depth).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Iterable

from glm5_jax.errors import ConfigError

RULE_KEYS = ("integer", "min", "max", "gt", "lt", "choices", "optional", "finite", "when", "note")


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            integer: bool = False, min: float | None = None, max: float | None = None, gt: float | None = None,
            lt: float | None = None, choices: Iterable | None = None, optional: bool = False, finite: bool = False,
            when: Callable[[Any], bool] | None = None, note: str = "", runtime: bool = False,
            same_weights: bool = False):
    """A dataclass field with its rule and kind in the metadata (module docstring)."""
    rule = {"integer": integer, "min": min, "max": max, "gt": gt, "lt": lt,
            "choices": None if choices is None else tuple(choices), "optional": optional, "finite": finite,
            "when": when, "note": note}
    meta = {"rule": {k: v for k, v in rule.items() if v is not None and v is not False and v != ""}, "runtime": runtime,
            "same_weights": same_weights}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def invalid(owner: str, field: str, value: Any, allowed: str) -> ConfigError:
    """The one message form: "OWNER.FIELD=VALUE is invalid: ALLOWED"."""
    return ConfigError(f"{owner}.{field}={value!r} is invalid: {allowed}")


def describe(rule: dict) -> str:
    """What `rule` allows, in words ("must be an integer >= 1", "allowed: a, b", "must be in [0, 1]")."""
    if "choices" in rule:
        text = "allowed: " + ", ".join(str(c) for c in rule["choices"])
    else:
        what = "an integer" if rule.get("integer") else ""
        lo = ("[", rule["min"]) if "min" in rule else ("(", rule["gt"]) if "gt" in rule else None
        hi = ("]", rule["max"]) if "max" in rule else (")", rule["lt"]) if "lt" in rule else None
        if lo and hi:
            text = f"{what + ' ' if what else ''}in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
        elif lo:
            text = f"{what + ' ' if what else ''}{'>=' if lo[0] == '[' else '>'} {lo[1]}"
        elif hi:
            text = f"{what + ' ' if what else ''}{'<=' if hi[0] == ']' else '<'} {hi[1]}"
        else:
            text = what or ("a finite number" if rule.get("finite") else "")
        if rule.get("finite") and (lo or hi):
            text = "a finite number " + text
        text = ("must be None or " + text) if rule.get("optional") else ("must be " + text)
    return text + (f" {rule['note']}" if rule.get("note") else "")


def breaks(rule: dict, v: Any) -> bool:
    """Whether value `v` breaks `rule`."""
    if v is None and rule.get("optional"):
        return False
    if "choices" in rule:
        return v not in rule["choices"]
    if isinstance(v, bool) or not isinstance(v, numbers.Real):      # numpy scalars count as numbers
        return True
    if rule.get("integer") and not isinstance(v, numbers.Integral):
        return True
    if rule.get("finite") and not math.isfinite(v):
        return True
    return not (("min" not in rule or v >= rule["min"]) and ("max" not in rule or v <= rule["max"])
                and ("gt" not in rule or v > rule["gt"]) and ("lt" not in rule or v < rule["lt"]))


def check_fields(obj, prefix: str | None = None, error: type[Exception] = ConfigError) -> None:
    """Raise `error` for the first field of dataclass `obj` (in declaration order) whose value breaks its
    declared rule (rules whose `when(obj)` is false are skipped). The message names the field as
    PREFIX + name (default prefix "Class."; a CLI's flags: "--")."""
    prefix = f"{type(obj).__name__}." if prefix is None else prefix
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("rule")
        if not rule or ("when" in rule and not rule["when"](obj)):
            continue
        v = getattr(obj, f.name)
        if breaks(rule, v):
            raise error(f"{prefix}{f.name}={v!r} is invalid: {describe(rule)}")


def require(name: str, value: Any, error: type[Exception] = ConfigError, **rule) -> Any:
    """`value` if it keeps `rule` (the keywords of `setting`), else `error` in the one message form
    "NAME=VALUE is invalid: ..." (a function argument's check, e.g. require("batch_size", b, integer=True, min=1))."""
    if breaks(rule, value):
        raise error(f"{name}={value!r} is invalid: {describe(rule)}")
    return value


def fields_with(cls, kind: str) -> tuple[str, ...]:
    """Names of the fields of dataclass `cls` declared with `kind`=True ("runtime", "same_weights")."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get(kind))


__all__ = ["RULE_KEYS", "breaks", "check_fields", "describe", "fields_with", "invalid", "require", "setting"]
