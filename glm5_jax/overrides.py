"""Dotted overrides of a typed, frozen config tree: `model.index_topk=32`, `train.learning_rate=1e-3`.

A key walks the nested dataclasses field by field; the value string is parsed by the declared type of
the field it lands on (`typing.get_type_hints`): bool (true/false/1/0/yes/no), int, float, str,
`X | None` (`none`/`None`/`null` -> None), tuples (a comma list `a,b,c` or JSON `["a", "b"]`; an empty
value is the empty tuple) and `Any` (JSON if it parses, else the string). Every override is parsed
first; then each touched dataclass is rebuilt once with all of its new fields, bottom-up, so its own
validation (`__post_init__`, ConfigError) judges the combination, not one field at a time.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Iterable, Mapping

from glm5_jax.errors import ConfigError, Glm5Error

NONE_WORDS = ("none", "null")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class OverrideError(Glm5Error):
    """An override names no field, or its value does not parse as the field's type."""


def field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def valid_keys(cfg, prefix: str = "") -> list[str]:
    """Keys of `cfg` at one level: plain fields, and `section.*` for nested configs."""
    out = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out.append(f"{prefix}{f.name}.*" if dataclasses.is_dataclass(v) else f"{prefix}{f.name}")
    return sorted(out)


def all_keys(cfg, prefix: str = "") -> list[str]:
    """Every leaf key of the tree (what `--set` can reach)."""
    out = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out += all_keys(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else [prefix + f.name]
    return out


def flat_items(cfg) -> list[tuple[str, Any]]:
    """(dotted key, value) for every leaf of the tree."""
    out = []
    for key in all_keys(cfg):
        v = cfg
        for part in key.split("."):
            v = getattr(v, part)
        out.append((key, v))
    return out


def type_name(tp) -> str:
    """`int | None`, `tuple[str, ...]`, `float`: the declared type as a person writes it."""
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any (JSON)"
    if _is_union(tp):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple:
        return "tuple[" + ", ".join("..." if a is Ellipsis else type_name(a) for a in args) + "]"
    return tp.__name__ if isinstance(tp, type) else str(tp)


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _bad(key: str, raw: Any, tp, why: str = "") -> OverrideError:
    return OverrideError(f"--set {key}={raw!r}: expected {type_name(tp)}" + (f" ({why})" if why else ""))


def parse_value(key: str, raw: str, tp) -> Any:
    """`raw` (the text after '=') as a value of type `tp`; OverrideError naming key, value and type."""
    if tp is Any:
        try:
            return _from_json(json.loads(raw))
        except ValueError:
            return raw
    if _is_union(tp):
        args = typing.get_args(tp)
        if type(None) in args and raw.strip().lower() in NONE_WORDS:
            return None
        rest = [a for a in args if a is not type(None)]
        for a in rest:
            try:
                return parse_value(key, raw, a)
            except OverrideError:
                continue
        raise _bad(key, raw, tp, "none for None" if type(None) in args else "")
    origin = typing.get_origin(tp)
    if tp is tuple or origin is tuple:
        return _parse_tuple(key, raw, tp)
    if tp is bool:
        low = raw.strip().lower()
        if low in TRUE_WORDS:
            return True
        if low in FALSE_WORDS:
            return False
        raise _bad(key, raw, tp, "true/false")
    if tp is int:
        try:
            return int(raw.strip())
        except ValueError:
            raise _bad(key, raw, tp) from None
    if tp is float:
        try:
            return float(raw.strip())
        except ValueError:
            raise _bad(key, raw, tp) from None
    if tp is str:
        return raw
    if dataclasses.is_dataclass(tp):
        raise OverrideError(f"--set {key}=...: {key} is a section ({tp.__name__}); set its fields, "
                            f"e.g. {key}.{dataclasses.fields(tp)[0].name}=...")
    raise _bad(key, raw, tp, "this type cannot be set from the command line")


def _from_json(v):
    return tuple(_from_json(x) for x in v) if isinstance(v, list) else v


def _parse_tuple(key: str, raw: str, tp) -> tuple:
    args = typing.get_args(tp)
    text = raw.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise _bad(key, raw, tp, f"JSON list: {e}") from None
        if not isinstance(items, list):
            raise _bad(key, raw, tp, "a JSON list")
        items = [x if isinstance(x, str) else json.dumps(x) for x in items]
    elif text.startswith("{"):
        # a mapping for a tuple of (key, value) pairs, e.g. rope_scaling={"type": "linear", "factor": 4}
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise _bad(key, raw, tp, f"JSON object: {e}") from None
        return tuple(sorted((k, _from_json(v)) for k, v in obj.items()))
    else:
        items = [x.strip() for x in text.split(",")] if text else []
    if not args:                                     # bare `tuple`: strings
        return tuple(items)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(parse_value(f"{key}[{i}]", x, args[0]) for i, x in enumerate(items))
    if len(items) != len(args):
        raise _bad(key, raw, tp, f"{len(args)} comma-separated items")
    return tuple(parse_value(f"{key}[{i}]", x, a) for i, (x, a) in enumerate(zip(items, args)))


def split_item(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise OverrideError(f"--set expects key=value, got {item!r}")
    k, v = item.split("=", 1)
    return k.strip(), v.strip()


def _unknown(cfg, key: str, prefix: str) -> OverrideError:
    part = key[len(prefix):].split(".", 1)[0]
    where = f"in section {prefix[:-1]!r} ({type(cfg).__name__})" if prefix else f"in {type(cfg).__name__}"
    msg = f"--set {key}: no field {part!r} {where}; valid keys: {', '.join(valid_keys(cfg, prefix))}"
    if not prefix:
        # a flat key of the first version (`index_topk=32`): point at its section
        near = [k for k in all_keys(cfg) if k.rsplit(".", 1)[-1] == part]
        if near:
            msg += f". Flat keys are not accepted: did you mean {' or '.join(near)}?"
    return OverrideError(msg)


def apply_overrides(cfg, overrides: Iterable[str] | Mapping[str, Any] = (),
                    derived: Mapping[str, str] | None = None):
    """`cfg` with dotted overrides applied. `overrides`: "a.b=value" strings, or a {key: value} mapping
    whose string values are parsed and other values used as they are. `derived`: keys the config
    computes from other fields ({key: "the field to set instead"}), refused with that hint."""
    items = list(overrides.items()) if isinstance(overrides, Mapping) else [split_item(o) for o in overrides]
    tree: dict = {}
    for key, raw in items:
        if derived and key in derived:
            raise OverrideError(f"--set {key}: this experiment derives it from {derived[key]}; set that instead")
        node, prefix, sub = cfg, "", tree
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
                raise _unknown(node, key, prefix)
            if i == len(parts) - 1:
                tp = field_types(type(node))[part]
                if dataclasses.is_dataclass(getattr(node, part)):
                    parse_value(key, str(raw), type(getattr(node, part)))      # raises: a section
                sub[part] = parse_value(key, raw, tp) if isinstance(raw, str) else raw
            else:
                node, prefix = getattr(node, part), prefix + part + "."
                if not dataclasses.is_dataclass(node):
                    raise OverrideError(f"--set {key}: {prefix[:-1]} is a plain field, not a section")
                nxt = sub.setdefault(part, {})
                if not isinstance(nxt, dict):
                    raise OverrideError(f"--set {key}: {prefix[:-1]} was given a value and fields at once")
                sub = nxt
    return _rebuild(cfg, tree, "")


def _rebuild(cfg, tree: dict, prefix: str):
    if not tree:
        return cfg
    new = {k: _rebuild(getattr(cfg, k), v, f"{prefix}{k}.") if isinstance(v, dict) else v for k, v in tree.items()}
    try:
        return dataclasses.replace(cfg, **new)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:          # configs that validate with plain ValueError
        where = prefix[:-1] or type(cfg).__name__
        raise ConfigError(f"{where} ({type(cfg).__name__}): {e}") from e


def as_dict(cfg) -> dict:
    """The resolved config as JSON-safe nested dicts (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
