"""Check the whole configuration before anything heavy runs (model load, baseline): every top-level key, method
knob, grid entry and task knob, each bad value → one `KvbenchError` line naming the fix (exit 2).

Declarative, so a new key is one line:
- a top-level key: one field of kvbench.config.spec.RunSpec with its `setting(...)` rule (TOP_LEVEL is derived from
  it; a test fails when conf/config.yaml has a key the spec lacks);
- a method knob: its dataclass field's annotation (`int`, `float`, `bool`, `str`, `list[str]`, `dict`, `X | None`,
  `Literal[...]`) is the type; numbers are ≥ 0 unless the field says otherwise with
  `knob(default, min=..., max=..., choices=...)` (kvbench.config.registry); the method's `__post_init__` adds its own
  checks;
- a task knob: the type of its default in conf/task/<name>.yaml, or a `Rule` in the task class's `knobs`.

The run's modes together (kvbench.rows.modes) and each method against the model's layers
(kvbench.preflight.support) are checked by `check_run` and `check_model_support`.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from kvbench import KvbenchError
from kvbench.config.rules import Rule, _show, check_fields, check_value, did_you_mean, plain
from kvbench.config.spec import TOP_LEVEL, RunSpec
from kvbench.rows import modes
from kvbench.rows.modes import RunFacts

# the `launcher` group's keys (conf/launcher/*.yaml); checked when present
LAUNCHER: dict[str, Rule] = {
    "launcher.name": Rule("str", "launcher=local or launcher=ray", choices=("local", "ray")),
    "launcher.workers": Rule("int", "launcher.workers=2 (shards in flight at once)", min=1),
    "launcher.address": Rule(
        "str", "launcher.address=auto (or ray://head:10001); null starts a local cluster", nullable=True
    ),
    "launcher.num_cpus": Rule("float", "launcher.num_cpus=1 (CPUs per worker, > 0)", min=0.01),
    "launcher.num_gpus": Rule("float", "launcher.num_gpus=0 (GPUs per worker, e.g. 1)", min=0),
    "launcher.shards": Rule("int", "launcher.shards=8, or null for 4 × workers", nullable=True, min=1),
    "launcher.max_retries": Rule("int", "launcher.max_retries=3 (retries of a shard whose worker died)", min=0),
    # set by the Ray driver on each worker's copy of the config (kvbench.integrations.ray_launcher)
    "launcher.shard": Rule("int", "(set by the Ray launcher)", nullable=True, min=0),
    "launcher.n_shards": Rule("int", "(set by the Ray launcher)", nullable=True, min=1),
    "launcher.attempt": Rule("str", "(set by the Ray launcher)", nullable=True),
}
# keys that are Hydra's, not the job's (config groups, conf/<group>/, are checked by their own code)
NOT_JOB_KEYS = {"defaults", "hydra"}


# ---- method knobs, from the dataclass annotations -------------------------------------------------------------
def check_method_params(where: str, cls: type, params: dict, example=None) -> None:
    """Type/range of each given knob of a method dataclass (kvbench.config.rules.check_fields)."""
    check_fields(where, cls, params, example)


def method_class(where: str, name: Any) -> type:
    from kvbench.methods import METHODS

    if not isinstance(name, str):
        raise KvbenchError(
            f"{where}: method name {_show(name)} is not a string; valid methods: {', '.join(METHODS.names())}"
        )
    return METHODS.get(name)


def method_yaml_drift(name: str, cls: type | None = None) -> str | None:
    """Where conf/method/<name>.yaml disagrees with the method's dataclass, the one place its knobs and defaults are
    declared (the yaml repeats them so Hydra takes `method.<knob>=...`; a grid entry by name reads the dataclass, so
    a yaml that changed a default would make `method=X` and `grid.method=[X]` two different runs); None when the
    yaml repeats the dataclass exactly, or there is no such yaml."""
    from omegaconf import OmegaConf

    from kvbench import conf_dir
    from kvbench.config.registry import drift

    path = conf_dir() / "method" / f"{name}.yaml"
    if not path.is_file():
        return None
    if cls is None:
        from kvbench.methods import METHODS

        cls = METHODS.get(name)
    loaded = OmegaConf.to_container(OmegaConf.load(path))
    given = {str(k): v for k, v in loaded.items()} if isinstance(loaded, dict) else {}
    problems = drift(cls, given)
    if given.get("name") != name:
        problems.insert(0, f"name: {given.get('name')!r} where the file is {name}.yaml")
    if not problems:
        return None
    return (
        f"conf/method/{name}.yaml disagrees with {cls.__name__} ({cls.__module__}), where {name}'s knobs and "
        f"defaults are declared: {'; '.join(problems)}; make the yaml repeat the dataclass, and give another value "
        f"as method.<knob>=... or in an experiment preset"
    )


def check_grid_entry(index: int, entry: Any) -> None:
    from kvbench.methods import build_method, method_defaults

    where = f"grid.method[{index}]"
    if not isinstance(entry, dict):
        method_class(where, entry)
        build_method(entry, method_defaults(entry))
        return
    if "name" not in entry:
        raise KvbenchError(f"{where}={_show(entry)} has no `name`; use e.g. 'grid.method=[{{name: kivi, bits: 2}}]'")
    name = entry["name"]
    params = {k: v for k, v in entry.items() if k != "name"}
    check_method_params(
        where,
        method_class(where, name),
        params,
        lambda knob, shown: f"'grid.method=[{{name: {name}, {knob}: {shown}}}]'",
    )
    build_method(name, {**method_defaults(name), **params})  # the method's own __post_init__ checks


# ---- task knobs -----------------------------------------------------------------------------------------------
def task_rule(task_name: str, key: str, default: Any, declared: dict[str, Rule]) -> Rule | None:
    """A task knob's rule: the task class's declared `knobs`, else the type of its yaml default (None: any)."""
    if key in declared:
        return declared[key]
    kinds = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}
    kind = kinds.get(type(default))
    if kind is None:
        return None
    shown = f"[{','.join(map(str, default))}]" if isinstance(default, list) else _show(default)
    fix = f"task.{key}={shown} (conf/task/{task_name}.yaml)"
    item = None
    if kind == "list" and default and type(default[0]) in (int, float, str):
        item = Rule(kinds[type(default[0])], fix, min=0 if type(default[0]) in (int, float) else None)
    return Rule(kind, fix, min=0 if kind in ("int", "float") else None, item=item)


def check_task(task_cfg: dict) -> None:
    from kvbench import conf_dir
    from kvbench.tasks import TASKS

    name = str(task_cfg.get("name"))
    cls = TASKS.get(name)
    declared: dict[str, Rule] = dict(getattr(cls, "knobs", {}) or {})
    path = conf_dir() / "task" / f"{name}.yaml"
    defaults: dict = {}
    if path.is_file():
        from omegaconf import OmegaConf

        defaults = plain(OmegaConf.load(path))
    for key, value in task_cfg.items():
        if key == "name":
            continue
        rule = task_rule(name, key, defaults.get(key), declared)
        if rule is not None:
            check_value(f"task.{key}", value, rule)
    check_value_fits(task_cfg)
    cls.check(task_cfg)  # the task's own checks across knobs (no tokenizer, no model)
    cls.check_length(task_cfg)  # lengths no prompt should be built for (the model's window: kvbench.tasks.build_task)


MAX_VALUE_DIGITS = 4096  # a needle's value (an access code, a passkey): Python writes ints of at most 4,300 digits


def check_value_fits(task_cfg: dict) -> None:
    """A needle's `value_length` fits its haystack (`context_lengths`, `context_length`) and is a needle, not a
    text: a billion-digit value would be built (and tokenized) before any length check."""
    value = task_cfg.get("value_length")
    if not isinstance(value, int) or isinstance(value, bool):
        return
    contexts = [n for n in [*(task_cfg.get("context_lengths") or []), task_cfg.get("context_length")] if n]
    shortest = min([int(n) for n in contexts if isinstance(n, int)], default=None)
    if shortest is not None and value >= shortest:
        raise KvbenchError(
            f"task.value_length={value:,} does not fit the shortest context of {shortest:,} tokens; use a value "
            f"shorter than its haystack (e.g. task.value_length=7)"
        )
    if value > MAX_VALUE_DIGITS:
        raise KvbenchError(
            f"task.value_length={value:,} is beyond {MAX_VALUE_DIGITS:,} (a needle's value, not a text); use "
            "e.g. task.value_length=7"
        )


# ---- the whole configuration ----------------------------------------------------------------------------------
def _lookup(config: dict, dotted: str) -> tuple[bool, Any]:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def check_known_keys(config: dict) -> None:
    """A key added with `+key=...` that kvbench does not know (a typo: `+limt=5`) is an error, not ignored."""
    from omegaconf import OmegaConf

    from kvbench import conf_dir

    root = conf_dir()
    known = set(NOT_JOB_KEYS) | {key.split(".")[0] for key in TOP_LEVEL}
    known |= {p.name for p in root.iterdir() if p.is_dir()} | set(OmegaConf.load(root / "config.yaml"))
    for key in config:
        if key not in known:
            hint = did_you_mean(key, known, suffix="=...")
            raise KvbenchError(f"{key} is not a kvbench setting; {hint}the settings are listed in conf/config.yaml")


def check_launcher(config: dict) -> None:
    """Every `launcher.` key is one the launcher reads: a misspelt one (launcher.worker=4) or a Ray key under
    launcher=local would be ignored."""
    launcher = config.get("launcher")
    if launcher is None:
        return
    if not isinstance(launcher, dict):
        raise KvbenchError(f"launcher={_show(launcher)} is not a launcher; use launcher=local or launcher=ray")
    name = launcher.get("name", "local")
    keys = sorted(k.removeprefix("launcher.") for k in LAUNCHER)
    for key in launcher:
        if key not in keys:
            hint = did_you_mean(key, keys, prefix="launcher.")
            raise KvbenchError(f"launcher.{key} is not a launcher setting; {hint}the settings: conf/launcher/ray.yaml")
        if name == "local" and key != "name":
            raise KvbenchError(f"launcher.{key} applies to launcher=ray only; add launcher=ray or drop launcher.{key}")


def check_config(cfg) -> None:
    """Every check that needs no model: raises KvbenchError (one line, the fix named) at the first bad input."""
    try:
        config: dict = dict(plain(cfg))
    except Exception as error:  # an interpolation that does not resolve
        raise KvbenchError(
            f"the configuration does not resolve ({str(error).splitlines()[0]}); fix the ${{...}} reference it names"
        ) from None
    check_known_keys(config)
    check_launcher(config)
    for key, rule in {**TOP_LEVEL, **LAUNCHER}.items():
        present, value = _lookup(config, key)
        if present:
            check_value(key, value, rule)
    from kvbench.guide.verdict import Thresholds

    Thresholds.from_config(config.get("verdict"))  # keys, ranges and order of the verdict's thresholds
    from kvbench.methods import build_method

    method = config.get("method") or {}
    params = {k: v for k, v in method.items() if k != "name"}
    cls = method_class("method", method.get("name"))
    drifted = method_yaml_drift(method["name"], cls)
    if drifted:
        raise KvbenchError(drifted)
    check_method_params("method", cls, params)
    build_method(method["name"], params)  # the method's own __post_init__ checks
    check_engine_keys(config.get("engine") or {})
    engine = str((config.get("engine") or {}).get("name") or "kvbench")
    if engine != "kvbench":  # the grid names the engine's options: kvbench.rows.configuration.engine_options
        check_engine(engine, config)
        return check_task(config.get("task") or {})
    for index, entry in enumerate(((config.get("grid") or {}).get("method")) or []):
        check_grid_entry(index, entry)
    check_task(config.get("task") or {})
    from kvbench.preflight.model_fields import check_model

    check_model(config.get("model") or {})  # a written-down shape: required fields present, of their types


def check_engine_keys(engine: dict) -> None:
    """The `engine` group holds its name only (conf/engine/<name>.yaml): what an engine runs is its class's
    (kvbench.engines.<name>: `options`, `applies`), chosen per configuration in `grid.method`, so any other
    `engine.` key would be ignored."""
    for key in engine:
        if key != "name":
            raise KvbenchError(
                f"engine.{key} is not a setting: the engine group is engine=<name> alone; an engine's KV options and "
                f"their knobs are grid.method entries, e.g. 'grid.method=[{{name: fp8}}]' (kvbench/engines/)"
            )


def check_engine(name: str, config: dict) -> None:
    """engine=<name>: a registered serving engine whose venv is built, able to run every requested option on this
    model."""
    from kvbench.engines import ENGINES

    serving_engine = ENGINES.get(name)()
    grid = config.get("grid") or {}
    for entry in grid.get("method") or [config.get("method") or {}]:
        option = entry.get("name") if isinstance(entry, dict) else entry
        if option in (*serving_engine.options, *serving_engine.applies):  # else engine_options names the valid ones
            reason = serving_engine.unavailable(config.get("model") or {}, option) or renamed_option(
                name, serving_engine.options, str(option), entry if isinstance(entry, dict) else {}
            )
            if reason:
                raise KvbenchError(reason)


def renamed_option(engine: str, options: dict, option: str, entry: dict) -> str | None:
    """Why knobs given with an engine option would run another option under its name (`{name: fp8, kv_cache_dtype:
    int8_per_token_head}`: stored as fp8, computed as int8; a `full` with a cache dtype: a second, different
    baseline): a knob that says what an option is (a key some option of this engine sets) must keep this option's
    value. What reaches the engine is checked, not the option's name."""
    defining = {key for knobs in options.values() for key in knobs}
    own = options.get(option, {})
    for key, value in entry.items():
        if key in defining and own.get(key) != value:
            same = [n for n, knobs in options.items() if knobs.get(key) == value]
            fix = f"use method={same[0]}" if same else f"drop {key}"
            return (
                f"engine={engine} option {option} is {key}={own.get(key, 'the engine default')}; {key}={value} given "
                f"with it would run another option under its name: {fix}"
            )
    return None


def check_run(cfg: DictConfig) -> tuple[RunSpec, list]:
    """Every key, knob, grid entry and run mode, before the model loads; returns the run's spec (its settings typed,
    read once here) and its configurations. The model's own refusals follow once its config is read (here when it
    is cheap to read, else by `check_model_support` after loading)."""
    from kvbench.model.load import model_config, resolve_device
    from kvbench.rows.configuration import configurations
    from kvbench.tasks import TASKS

    check_config(cfg)
    spec = RunSpec.of(cfg)  # the Hydra config ends here: what follows reads the spec
    resolve_device(spec.device)  # a malformed device string, or a GPU this torch cannot see: one line
    confs = configurations(spec)
    modes.check(RunFacts(spec, TASKS.get(spec.task_name), tuple(c.method for c in confs)))
    from kvbench.preflight.support import budget_refusal

    for c in confs if spec.engine_name == "kvbench" else ():
        reason = budget_refusal(c.method, c.budget)
        if reason:
            raise KvbenchError(reason)
    config = model_config(spec.model, cheap=True)
    if config is not None:  # else checked once the model is loaded
        check_model_support(spec, confs, config)
    return spec, confs


def check_model_support(spec: RunSpec, confs: list, config) -> None:
    """Each configuration runs on this model (kvbench.preflight.support), the model's layers are ones kvbench knows
    (kvbench.model.layout), and the run's modes handle its sliding-window layers (kvbench.rows.modes)."""
    import torch

    from kvbench.model.layout import cache_layout
    from kvbench.preflight.support import refusal
    from kvbench.tasks import TASKS

    model_layout = cache_layout(config, torch.float32)  # refuses layer types kvbench does not know
    for c in confs if spec.engine_name == "kvbench" else ():  # a serving engine says what it runs (check_engine)
        reason = refusal(c.method, config)
        if reason:
            raise KvbenchError(reason)
    methods = tuple(c.method for c in confs)
    facts = RunFacts(spec, TASKS.get(spec.task_name), methods, model_layout.has_sliding, model_layout.is_hybrid)
    modes.check(facts)
