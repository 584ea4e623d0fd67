"""Name → class registries behind a decorator (methods, tasks, model loaders), as in lm-evaluation-harness."""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Callable
from typing import Any

from kvbench import KvbenchError


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Any] = {}
        self._unavailable: dict[str, str] = {}  # name → why it is not registered here (an extra not installed)
        self._lazy: dict[str, str] = {}  # name → the module that registers it when imported (integrations)

    def register(self, name: str) -> Callable[[Any], Any]:
        def wrap(obj: Any) -> Any:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = obj
            obj.name = name
            return obj

        return wrap

    def unavailable(self, name: str, why: str) -> None:
        """`name` exists but cannot run in this environment: `get(name)` raises `why` (how to install it)."""
        self._unavailable[name] = why

    def lazy(self, name: str, module: str) -> None:
        """`name` is registered by `module` (an integration above this registry's layer), imported on first `get`."""
        self._lazy[name] = module

    def names(self) -> list[str]:
        return sorted({*self._entries, *self._lazy})

    def get(self, name: str) -> Any:
        if name not in self._entries and name in self._lazy:
            import importlib

            importlib.import_module(self._lazy.pop(name))
        if name not in self._entries and name in self._unavailable:
            raise KvbenchError(self._unavailable[name])
        if name not in self._entries:
            raise KvbenchError(f"unknown {self.kind} {name!r}; valid {self.kind}s: {', '.join(self.names())}")
        return self._entries[name]


def build_dataclass(cls: type, params: dict, what: str) -> Any:
    """Instantiate a dataclass from config params, naming the valid fields when one is unknown."""
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise KvbenchError(
            f"{what} has no parameter {', '.join(map(repr, unknown))}; valid parameters: "
            f"{', '.join(sorted(fields)) or '(none)'}"
        )
    try:
        return cls(**params)
    except (TypeError, ValueError, AttributeError) as error:  # a knob of the wrong shape that slipped past validate
        raise KvbenchError(f"{what}: {error}; check its parameters against its conf yaml") from None


# the longest context a token count may name without a model (no published model reads more than ~10M tokens):
# a count of positions, tokens or steps (`knob(..., tokens=True)`) is bounded by it, then by the model's own context
# (kvbench.preflight.support.count_refusal) — a billion future positions or evict_every would ask for gigabytes
MAX_CONTEXT_TOKENS = 2**24


def knob(
    default: Any = dataclasses.MISSING,
    *,
    min: float | None = None,
    max: float | None = None,
    choices: tuple = (),
    tokens: bool = False,
    **field_kwargs: Any,
) -> Any:
    """A dataclass field with the range kvbench.preflight.entrance checks before the model loads, e.g.
    `window_size: int = knob(32, min=1)`, `pooling: str = knob("avg", choices=("avg", "max"))`. Numbers without
    a `min` must be ≥ 0; `min=None` explicitly (knob(0.0, min=None)) is not expressible: use -math.inf.
    `tokens=True`: a count of token positions or decode steps, at most MAX_CONTEXT_TOKENS and the model's context."""
    metadata: dict[str, Any] = {}
    if tokens:
        metadata["tokens"] = True
        max = MAX_CONTEXT_TOKENS if max is None else builtins.min(max, MAX_CONTEXT_TOKENS)
    if min is not None:
        metadata["min"] = min
    if max is not None:
        metadata["max"] = max
    if choices:
        metadata["choices"] = tuple(choices)
    return dataclasses.field(default=default, metadata=metadata, **field_kwargs)


def field_defaults(cls: type) -> dict[str, Any]:
    """A dataclass's knobs and their defaults: every init field that has one (a default_factory called)."""
    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.init and f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.init and f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return defaults


def drift(cls: type, given: dict[str, Any], skip: tuple[str, ...] = ("name",)) -> list[str]:
    """How a config file's keys differ from the dataclass that declares them, the one source of its knobs and
    defaults: a key that is no field, a field the file lacks, a value other than the field's default (keys in `skip`
    left out); [] when the file repeats the dataclass exactly."""
    defaults = field_defaults(cls)
    given = {k: v for k, v in given.items() if k not in skip}
    problems = [f"{k} is not a field (fields: {', '.join(defaults) or 'none'})" for k in given if k not in defaults]
    problems += [f"lacks {k} (default {v!r})" for k, v in defaults.items() if k not in given]
    problems += [
        f"{k}: {given[k]!r} where the default is {v!r}" for k, v in defaults.items() if k in given and given[k] != v
    ]
    return problems
