"""Name → class registries behind a decorator (methods, tasks, model loaders), as in lm-evaluation-harness."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from kvbench import KvbenchError


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Any] = {}

    def register(self, name: str) -> Callable[[Any], Any]:
        def wrap(obj: Any) -> Any:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = obj
            obj.name = name
            return obj

        return wrap

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> Any:
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
    return cls(**params)
