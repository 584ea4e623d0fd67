"""Declarative validation: a `Rule` says what a value may be; `check_value` raises one `KvbenchError` line naming
the key, the bad value, what is wrong and the fix. Used by the whole-input check (kvbench.preflight.entrance) and by
tasks declaring their knobs. Importable without torch."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from kvbench import KvbenchError


@dataclass(frozen=True)
class Rule:
    """What a value may be. `kind`: int | float | bool | str | list | dict | budget | any, or a path given as a
    string: file (an existing file), path (an existing file or directory), out_dir (a directory that is or can be
    created and written)."""

    kind: str
    fix: str = ""  # a good value to show, e.g. "limit=10 (at most 10 examples) or limit=null (all)"
    nullable: bool = False
    min: float | None = None
    max: float | None = None
    above: float | None = None  # exclusive bounds: a value must be > above and < below
    below: float | None = None
    choices: tuple = ()
    item: Rule | None = None  # the rule every list item follows
    non_empty: bool = False  # lists: [] is an error (it would silently mean "the default")


BOOL_FIX = "true or false"
INT_LIMIT = 2**63 - 1  # the largest integer a row's int64 column (and torch, numpy) holds: larger ones overflow later


def _show(value: Any) -> str:
    """A value as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and abs(value) > INT_LIMIT:
        return f"{str(value)[:8]}…({len(str(abs(value)))} digits)"
    if isinstance(value, (list, tuple)):
        return f"[{','.join(map(_show, value))}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return str(value)


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _problem(value: Any, rule: Rule) -> str | None:
    """What is wrong with `value` under `rule`, or None."""
    if value is None:
        return None if rule.nullable or rule.kind == "any" else "must be set (null is not allowed)"
    kind = rule.kind
    if kind == "bool":
        return None if isinstance(value, bool) else "is not a boolean"
    if kind in ("int", "float", "budget"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "is not a number"
        if isinstance(value, float) and not math.isfinite(value):
            return "is not a finite number"
        if abs(value) > INT_LIMIT:  # checked before float(value): a 400-digit int does not fit a float
            return "is too large (beyond 2^63 − 1)"
        if kind == "int" and isinstance(value, float):  # 6.0 too: a count written as a float is a typo or a YAML 1e6
            return "is not an integer" if not value.is_integer() else "is a float, not an integer (drop the .0)"
        if kind == "budget":
            if value <= 0:
                return "must be > 0"
            if value > 1 and not float(value).is_integer():
                return "is above 1, so a token count, and must be an integer"
    elif kind == "str":
        if not isinstance(value, str) or not value:
            return "is not a non-empty string"
    elif kind == "list":
        if not isinstance(value, (list, tuple)):
            return "is not a list"
        if rule.non_empty and not value:
            return "is an empty list"
        for i, item in enumerate(value):
            problem = _problem(item, rule.item) if rule.item else None
            if problem:
                return f"item {i} ({_show(item)}) {problem}"
    elif kind == "dict":
        if not isinstance(value, dict):
            return "is not a mapping"
    elif kind in PATH_KINDS:
        return _path_problem(value, kind)
    elif kind != "any":
        raise ValueError(f"unknown Rule kind {kind!r}")
    if rule.min is not None and isinstance(value, (int, float)) and value < rule.min:
        return f"must be ≥ {_bound(rule.min)}"
    if rule.max is not None and isinstance(value, (int, float)) and value > rule.max:
        return f"must be ≤ {_bound(rule.max)}"
    if rule.above is not None and isinstance(value, (int, float)) and not value > rule.above:
        return f"must be > {_bound(rule.above)}"
    if rule.below is not None and isinstance(value, (int, float)) and not value < rule.below:
        return f"must be < {_bound(rule.below)}"
    if rule.choices and value not in rule.choices:
        return f"is not one of {', '.join(map(_show, rule.choices))}"
    return None


PATH_KINDS = ("file", "path", "out_dir")


def _path_problem(value: Any, kind: str) -> str | None:
    """What is wrong with `value` as a path of `kind` (nothing is created: out_dir looks for the nearest existing
    parent and whether this process may write there)."""
    import os
    from pathlib import Path

    if not isinstance(value, (str, os.PathLike)) or not str(value):
        return "is not a path"
    path = Path(value).expanduser()
    if kind == "file":
        if path.is_file():
            return None
        return "is a directory, not a file" if path.is_dir() else "does not exist (no such file or directory)"
    if kind == "path":
        return None if path.exists() else "does not exist (no such file or directory)"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"is not a directory ({existing} is a file)" if existing != path else "is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"is not writable ({existing}: permission denied)"
    return None


def check_value(key: str, value: Any, rule: Rule) -> None:
    """Raise one line naming `key`, the bad value, what is wrong and the fix."""
    problem = _problem(value, rule)
    if problem:
        raise KvbenchError(f"{key}={_show(value)} {problem}; use {rule.fix or 'a valid value'}")


def check_args(args, rules: dict[str, Rule]) -> None:
    """A command line's parsed arguments (argparse) checked by the same Rules, before any work: `rules` maps each
    flag as typed (`--max-drop`, read from argparse's dest max_drop) or positional by its dest (`results`; each of
    several values checked) to its Rule."""
    import os

    def plain_value(value):
        return str(value) if isinstance(value, os.PathLike) else value

    for flag, rule in rules.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if isinstance(value, list) and rule.kind != "list":  # a positional taking several values: each one
            for item in value:
                check_value(flag, plain_value(item), rule)
        else:
            check_value(flag, plain_value(value), rule)


def rule_from_annotation(annotation: Any, example: str, metadata: typing.Mapping) -> Rule:
    """The Rule a dataclass field's annotation (and `knob()` metadata) implies; `example` shows a good value."""
    nullable = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(annotation))
        annotation = args[0] if len(args) == 1 else Any
        origin = typing.get_origin(annotation)
    choices = tuple(metadata.get("choices", ()))
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        annotation = type(choices[0])
    base = origin or annotation
    kind = {bool: "bool", int: "int", float: "float", str: "str", list: "list", tuple: "list", dict: "dict"}.get(
        base, "any"
    )
    item = None
    if kind == "list" and typing.get_args(annotation):
        inner = typing.get_args(annotation)[0]
        item = rule_from_annotation(inner, example, {}) if inner is not Ellipsis else None
    low = metadata.get("min", 0 if kind in ("int", "float") else None)
    return Rule(kind, example, nullable=nullable, min=low, max=metadata.get("max"), choices=choices, item=item)


def check_fields(where: str, cls: type, params: dict, example=None) -> None:
    """Type and range of each given knob of a dataclass (a method's), by its annotation and `knob()` metadata:
    the same rules wherever the knobs are given (method.*, a grid entry, a wrapped scorer's scorer_params, a
    composition's overrides). Unknown knobs are build_dataclass's to name. `example(knob, shown_default)` writes a
    good value the way the user gives it (default: WHERE.knob=value)."""
    from dataclasses import MISSING, fields

    example = example or (lambda name, shown: f"{where}.{name}={shown}")
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if not f.init or f.name not in params:
            continue
        default = (
            f.default
            if f.default is not MISSING
            else (f.default_factory() if f.default_factory is not MISSING else None)
        )
        rule = rule_from_annotation(hints.get(f.name, Any), example(f.name, _show(default)), f.metadata)
        check_value(f"{where}.{f.name}", plain(params[f.name]), rule)  # a DictConfig/ListConfig as plain Python


def plain(node: Any) -> Any:
    """A config node as plain Python containers, interpolations resolved (a non-config value as it is)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def did_you_mean(key, known, prefix: str = "", suffix: str = "") -> str:
    """ "did you mean PREFIX<closest>SUFFIX? " for a misspelt `key` among `known`, or "" when none is close."""
    import difflib

    close = difflib.get_close_matches(str(key), sorted(map(str, known)), n=1)
    return f"did you mean {prefix}{close[0]}{suffix}? " if close else ""
