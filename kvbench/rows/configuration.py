"""A run's configurations: the full-cache baseline + the requested (method, budget) pairs, and the hash that
keys their rows in the store (model, dtype, device, task settings and data digests, method, parameters, budget)."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench import KvbenchError
from kvbench.config.spec import RunSpec
from kvbench.methods import METHODS, Budget, Capabilities, Method, build_method, method_defaults

DEFAULT_BUDGET = 0.5  # for methods that take a budget, when `budget` is not given


@dataclass
class Configuration:
    method: Method
    budget: Budget | None  # None: the method has no budget (full, quantization)
    query_aware: bool
    hash: str = ""

    @property
    def budget_value(self) -> float:
        return 1.0 if self.budget is None else self.budget.value


PRECISION = Capabilities(family="precision", has_budget=False)


@dataclass(frozen=True)
class EngineOption:
    """What stands for a method in a configuration run by a serving engine (kvbench.engines): one of the engine's
    own KV options (`ServingEngine.options`) or a kvbench method it applies inside the engine
    (`ServingEngine.applies`), with the engine knobs the run overrides. `caps.has_budget`: it evicts, with kvbench's
    budget."""

    name: str
    knobs: tuple = ()  # (knob, value) pairs the run sets beyond the option's own
    caps: Capabilities = PRECISION

    def params(self) -> dict:
        return dict(self.knobs)


def engine_options(spec: RunSpec) -> list[Configuration]:
    """The run's configurations on a serving engine: its uncompressed `full` first, then the requested options
    (method / grid.method: option names, or {name: option, knob: value}), each refused in one line when the engine
    lacks it (kvbench.engines.<engine>)."""
    from kvbench.engines import ENGINES

    serving_engine = ENGINES.get(spec.engine_name)
    valid = [*serving_engine.options, *serving_engine.applies]

    def option(entry, budget) -> Configuration:
        entry = dict(entry) if isinstance(entry, dict) else {"name": entry}
        name = entry.pop("name", None)
        if name not in valid:
            raise KvbenchError(
                f"engine={spec.engine_name} has no option {name!r}; valid: {', '.join(valid)} "
                f"(e.g. 'grid.method=[{valid[1] if len(valid) > 1 else valid[0]}]')"
            )
        defaults = method_defaults(name) if name in METHODS.names() else {}  # the kvbench method's yaml knobs
        knobs = tuple(sorted((k, v) for k, v in entry.items() if defaults.get(k, object()) != v))
        evicts = serving_engine.evicts(name)
        caps = Capabilities(family="eviction" if evicts else "precision", has_budget=evicts)
        return Configuration(EngineOption(name, knobs, caps), Budget.parse(budget) if evicts else None, True)  # type: ignore[arg-type]  # stands for a Method

    grid = spec.grid
    entries = list(grid.get("method") or [spec.method])
    budgets = list(grid.get("budget") or [DEFAULT_BUDGET if spec.budget is None else spec.budget])
    out = [option("full", 1.0)]
    for c in (option(e, b) for e in entries for b in budgets):
        if all((c.method != o.method or c.budget != o.budget) for o in out):
            out.append(c)
    return out


def method_config(name: str) -> dict:
    """conf/method/<name>.yaml as a dict (for grid entries given by name)."""
    return {"name": name, **method_defaults(name)}


def grid_entry(entry, spec: RunSpec) -> dict:
    """A grid.method entry: a method name (its yaml's knobs; the selected `method` keeps its overrides) or a
    mapping {name: ..., knob: value} for parameter variants, e.g. {name: kivi, bits: 2}."""
    if isinstance(entry, dict):
        if "name" not in entry:
            raise KvbenchError(f"grid.method entry {entry} needs a `name`")
        return {**method_config(entry["name"]), **entry}
    if entry == spec.method.get("name"):
        return dict(spec.method)
    return method_config(entry)


def make_configuration(method_cfg: dict, budget, query_aware: bool) -> Configuration:
    params = {k: v for k, v in method_cfg.items() if k != "name"}
    method = build_method(method_cfg["name"], params)
    return Configuration(method, Budget.parse(budget) if method.caps.has_budget else None, query_aware)


def configurations(spec: RunSpec) -> list[Configuration]:
    """Baseline first, then the requested configurations (duplicates dropped)."""
    if spec.engine_name != "kvbench":
        return engine_options(spec)
    query_aware, budget, grid = spec.query_aware, spec.budget, spec.grid
    if grid.get("method") or grid.get("budget"):
        entries = list(grid.get("method") or [spec.method["name"]])
        budgets = list(grid.get("budget") or [DEFAULT_BUDGET if budget is None else budget])
        requested = [make_configuration(grid_entry(e, spec), b, query_aware) for e in entries for b in budgets]
    else:
        requested = [make_configuration(dict(spec.method), DEFAULT_BUDGET if budget is None else budget, query_aware)]
        method = requested[0].method
        if budget is not None and not method.caps.has_budget and method.caps.family != "none":
            knobs = ", ".join(f"method.{k}" for k in method.params()) or "none"
            raise KvbenchError(
                f"method {method.name} takes no budget (it keeps every token); drop budget= and "
                f"use its own knobs instead: {knobs}"
            )
    out = [make_configuration({"name": "full"}, 1.0, query_aware)]
    for c in requested:
        if all((c.method != o.method or c.budget != o.budget) for o in out):
            out.append(c)
    return out
