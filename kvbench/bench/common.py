"""What every benchmark shares: the configuration composed and checked as `python -m kvbench` does, the model loaded as
a run loads it, the machine named, the prompt and options each benchmark takes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from kvbench import KvbenchError, conf_dir


def compose(overrides: list[str], *defaults: str):
    """kvbench's configuration with `defaults` then the user's `overrides` (theirs win); a refused override is one
    line. `report=false`: a benchmark's runs write no plots."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return hydra_compose("config", overrides=["report=false", *defaults, *overrides])
    except (HydraException, OmegaConfBaseException) as error:
        raise KvbenchError(f"{str(error).splitlines()[0]} (overrides: {' '.join(overrides) or 'none'})") from None


def machine(device: torch.device) -> str:
    """The device, as rows name it, with what decides its speed: the torch threads and, on a CPU, whether it has
    native bf16 (AVX512-BF16 / AMX) — without it `dtype=auto` is fp32."""
    from kvbench.model.device import NATIVE_BF16_CPU_FLAGS, cpu_flags
    from kvbench.store.results import device_name

    if device.type == "cuda":
        return device_name(device)
    bf16 = "native bf16" if set((*NATIVE_BF16_CPU_FLAGS, "bf16")) & cpu_flags() else "no native bf16 (AVX2-class)"
    forced = ", KVBENCH_NO_BF16=1" if os.environ.get("KVBENCH_NO_BF16") == "1" else ""
    return f"{device_name(device)}, {bf16}{forced}, {torch.get_num_threads()} torch threads"


def longest_prompt(spec, lm) -> list[int]:
    """The whole prompt (context + question) of the task's longest example, as a query-aware run feeds it."""
    from kvbench.tasks import build_task

    examples = build_task(spec.task, lm.tokenizer, spec.seed, lm.max_context).examples()
    prompt, suffix = max(examples, key=lambda e: e.n_tokens).split(True)
    return prompt + suffix


def options(overrides: list[str], defaults: Mapping[str, Any], name: str) -> tuple[dict, list[str]]:
    """The benchmark's own `bench.KEY=VALUE` options split off the overrides (the rest go to `compose`): each value
    parsed as YAML and typed like its default (None: any; a float takes an int; a list's items like the default's
    first); an unknown key or a wrong type is one line naming the benchmark's options."""
    import yaml

    values, rest = dict(defaults), []
    known = ", ".join(f"bench.{k}" for k in defaults) or "none"
    for item in overrides:
        if not item.startswith("bench."):
            rest.append(item)
            continue
        key, eq, raw = item.removeprefix("bench.").partition("=")
        if key not in defaults:
            raise KvbenchError(f"{name} has no option bench.{key}; its options: {known}")
        if not eq:
            raise KvbenchError(f"bench.{key} needs a value: bench.{key}={_shown(defaults[key])}")
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError:
            value = raw
        values[key] = _typed(key, value, defaults[key])
    return values, rest


def _shown(value: object) -> str:
    if isinstance(value, list | tuple):
        return "[" + ",".join(map(str, value)) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _typed(key: str, value: object, default: object) -> object:
    """`value` as the type of `default` (a YAML scalar or list), or one line naming the expected form."""
    if default is None or (value is None and not isinstance(default, bool)):
        return value
    fix = f"bench.{key}={_shown(default)}"
    if isinstance(default, list | tuple):
        items = value if isinstance(value, list) else [value]
        return [_typed(key, v, default[0]) for v in items] if default else items
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise KvbenchError(f"bench.{key}={_shown(value)} is not true or false; e.g. {fix}")
        return value
    if isinstance(default, int | float) and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise KvbenchError(f"bench.{key}={_shown(value)} is not a number; e.g. {fix}")
    if isinstance(default, int) and not isinstance(default, bool) and not isinstance(value, int):
        raise KvbenchError(f"bench.{key}={_shown(value)} is not an integer; e.g. {fix}")
    if isinstance(default, float):
        return float(value)  # type: ignore[arg-type]
    return value if isinstance(default, int) else str(value)


def checked(overrides: list[str], *defaults: str):
    """The run spec and its configurations (the full-cache baseline first), every override checked as
    `python -m kvbench` checks it, before anything loads."""
    from kvbench.preflight.entrance import check_run

    return check_run(compose(overrides, *defaults))


def load(spec):
    """The spec's model, as a run loads it (device, dtype, KVBENCH_THREADS)."""
    from kvbench.model.load import load_model

    return load_model(spec.model, spec.device, spec.dtype)


def header(name: str, lm, detail: str = "") -> None:
    """`NAME benchmark: model dtype on machine[; detail]`: the first line every benchmark prints."""
    dtype = str(lm.dtype).removeprefix("torch.")
    print(
        f"{name} benchmark: {lm.name} {dtype} on {machine(lm.device)}" + (f"; {detail}" if detail else ""), flush=True
    )


def random_ids(lm, length: int, generator: torch.Generator) -> list[int]:
    """`length` random token ids the model and its tokenizer both know (memory and speed do not depend on the text)."""
    vocab = min(lm.config.vocab_size, len(lm.tokenizer))
    return torch.randint(vocab, (length,), generator=generator).tolist()


def lengths(spec) -> list[int]:
    """The task's context lengths (task.context_lengths): the random prompts' lengths of a benchmark that reads no
    text."""
    found = spec.task.get("context_lengths")
    if not found:
        raise KvbenchError(f"task={spec.task_name} has no context_lengths; use task=niah 'task.context_lengths=[1024]'")
    return [int(n) for n in found]


def requested(spec, confs: list) -> list:
    """The configurations the grid (or `method`) asks for, in its order: the full-cache baseline only where named."""
    entries = spec.grid.get("method") or [spec.method.get("name")]
    names = [e["name"] if isinstance(e, dict) else e for e in entries]
    return confs if "full" in names else confs[1:]


def label(conf) -> str:
    """`name`, `name:budget` or `name:budget:knob=value,...` (knobs that differ from the method's yaml)."""
    from kvbench.methods import method_defaults

    method = conf.method
    defaults = method_defaults(method.name)
    knobs = ",".join(f"{k}={v}" for k, v in method.params().items() if defaults.get(k, object()) != v)
    budget = f"{conf.budget.value:g}" if conf.budget is not None else ""
    return ":".join([method.name, budget, knobs]).rstrip(":")


def tool_options(overrides: list[str], defaults: Mapping[str, Any], name: str, required: tuple[str, ...] = ()) -> dict:
    """`options` for a tool that reads stored rows or files (no model, no configuration): every argument is a
    `bench.` option, those in `required` must be given."""
    opts, rest = options(overrides, defaults, name)
    known = " ".join(f"bench.{k}=..." for k in defaults)
    if rest:
        raise KvbenchError(f"{name} takes only its own options ({known}), not {rest[0]}")
    missing = [k for k in required if opts[k] in (None, "")]
    if missing:
        raise KvbenchError(f"{name} needs bench.{missing[0]}=...; its options: {known}")
    return opts
