"""The planner's whole input checked before any arithmetic, with the Rules the run uses (kvbench.config.rules):
every key of conf/plan.yaml, the hardware preset, the method and grid (kvbench.preflight.entrance), the model's
written-down shape (kvbench.preflight.model_fields); each bad value is one `KvbenchError` line naming the fix."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvbench import KvbenchError
from kvbench.config.rules import Rule, check_value, did_you_mean, plain
from kvbench.config.spec import TOP_LEVEL
from kvbench.preflight.entrance import _lookup, check_grid_entry, check_method_params, method_class

MAX_CONTEXT = 1 << 24  # the longest context planned (16M tokens), as the fit search's cap (kvbench.plan.model)
MAX_BATCH = 1 << 20
KV_BITS = {"fp8": 8, "float8": 8, "int8": 8, "int4": 4}  # named cache storages, bits per element
KV_DTYPE_FIX = "kv_dtype=fp8, int8, int4, a bit count from 1 to 32 (kv_dtype=6) or null (the compute dtype)"

PLAN: dict[str, Rule] = {
    "context": Rule(
        "list",
        "context=4096 or 'context=[4096,32768]' (tokens per request)",
        non_empty=True,
        item=Rule("int", "token counts", min=1, max=MAX_CONTEXT),
    ),
    "batch": Rule(
        "list",
        "batch=8 or 'batch=[1,8,32]' (concurrent requests)",
        non_empty=True,
        item=Rule("int", "request counts", min=1, max=MAX_BATCH),
    ),
    "headroom": Rule("float", "headroom=0.1 (the fraction of device memory kept free, in [0, 1))", min=0, below=1),
    "prefix": Rule("int", "prefix=0 (tokens every request of the batch shares; 0 = none)", min=0, max=MAX_CONTEXT),
    "reuse_from": Rule("path", "reuse_from=PATH (the rows of a run with prefix_cache=true) or null", nullable=True),
    "plot": Rule("bool", "plot=true (write plan_regions.png) or plot=false"),
    "extrapolate": Rule(
        "bool", "extrapolate=true (plan contexts beyond the model's max_position_embeddings) or extrapolate=false"
    ),
    "kv_dtype": Rule("any", KV_DTYPE_FIX, nullable=True),
    **{key: TOP_LEVEL[key] for key in ("budget", "dtype", "query_aware", "reuse", "page_size")},
    **{key: TOP_LEVEL[key] for key in ("prefill", "prefill_chunk")},
    **{key: TOP_LEVEL[key] for key in ("grid", "grid.method", "grid.budget")},
}
HARDWARE: dict[str, Rule] = {
    "name": Rule("str", "hardware.name=my-gpu"),
    "memory_gib": Rule("float", "hardware.memory_gib=80 (GiB of device memory, > 0)", nullable=True, above=0),
    "bandwidth_gb_s": Rule(
        "float", "hardware.bandwidth_gb_s=3350 (GB/s of memory bandwidth, > 0)", nullable=True, above=0
    ),
    "peak_tflops": Rule("float", "hardware.peak_tflops=989 (dense bf16 TFLOP/s, > 0)", nullable=True, above=0),
    "calibrate": Rule("bool", "hardware.calibrate=true (measure this CPU) or false"),
    "recalibrate": Rule("bool", "hardware.recalibrate=true (measure again) or false"),
}
GROUPS = ("model", "method", "hardware")
NOT_JOB_KEYS = ("defaults", "hydra")


def _unknown(keys, known, where: str, source: str) -> None:
    for key in keys:
        if key not in known:
            hint = did_you_mean(key, known, prefix=where)
            raise KvbenchError(f"{where}{key} is not a planner setting; {hint}the settings are listed in {source}")


def listed(value: Any) -> Any:
    """`context=4096` and `context=[4096]` alike: a single value is a list of one."""
    return value if isinstance(value, list) else [value]


def check_plan(cfg) -> dict:
    """Every check that needs no arithmetic; returns the configuration as plain containers."""
    try:
        config: dict = dict(plain(cfg))
    except Exception as error:  # an interpolation that does not resolve
        raise KvbenchError(f"the configuration does not resolve ({str(error).splitlines()[0]})") from None
    _unknown(config, set(PLAN) | set(GROUPS) | set(NOT_JOB_KEYS), "", "conf/plan.yaml")
    for key, rule in PLAN.items():
        present, value = _lookup(config, key)
        if present and key in ("context", "batch") and not isinstance(value, list):
            check_value(key, value, replace(rule.item or rule, fix=rule.fix))  # both have item rules
        elif present:
            check_value(key, value, rule)
    hardware = config.get("hardware") or {}
    _unknown(hardware, HARDWARE, "hardware.", "conf/hardware/*.yaml")
    for key, value in hardware.items():
        check_value(f"hardware.{key}", value, HARDWARE[key])
    from kvbench.methods import build_method
    from kvbench.preflight.model_fields import check_model

    method = config.get("method") or {}
    params = {k: v for k, v in method.items() if k != "name"}
    check_method_params("method", method_class("method", method.get("name")), params)
    build_method(method["name"], params)
    for index, entry in enumerate((config.get("grid") or {}).get("method") or []):
        check_grid_entry(index, entry)
    check_model(config.get("model") or {})
    kv_bits(config.get("kv_dtype"))
    return config


def kv_bits(value: Any) -> int | None:
    """Bits per cached element of `kv_dtype` (None: the compute dtype's)."""
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in KV_BITS:
        return KV_BITS[value.lower()]
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 32:
        return value
    raise KvbenchError(f"kv_dtype={value} is not a cache storage the planner knows; use {KV_DTYPE_FIX}")


def check_options(config: dict, configurations, arch) -> None:
    """What a run would refuse: a (method, model) pair (kvbench.preflight.support, the run's rule), `prefill_chunk`
    without `prefill=inline`, and a `kv_dtype` beside a method that sets the cache's precision itself."""
    from kvbench.preflight.support import budget_refusal, refusal

    if config.get("prefill_chunk") is not None and config.get("prefill", "shared") != "inline":
        raise KvbenchError(
            f"prefill_chunk={config['prefill_chunk']} needs prefill=inline (a shared prefill has no chunks); add "
            "prefill=inline or set prefill_chunk=null"
        )
    bits = kv_bits(config.get("kv_dtype"))
    for c in configurations:
        # the full cache is the model's own: planned even where kvbench cannot run the model (DeepSeek-V3.2's DSA)
        why = (refusal(c.method, arch.config) if c.method.name != "full" else None) or budget_refusal(
            c.method, c.budget
        )
        if why:
            raise KvbenchError(f"{why} (the run refuses it; the planner plans what runs)")
        family = c.method.caps.family
        quantizes = family == "precision" or (family == "composite" and c.method.precision is not None)
        if bits is not None and quantizes:
            raise KvbenchError(
                f"kv_dtype={config.get('kv_dtype')} with method {c.method.name}: the method sets the cache's "
                "precision itself; plan one of them (kv_dtype=null, or a method without quantization)"
            )


def check_contexts(contexts: list[int], arch, extrapolate: bool) -> None:
    """Contexts beyond the model's position limit are refused unless `extrapolate=true` says plan them anyway."""
    longest = max(contexts)
    if arch.max_context and longest > arch.max_context and not extrapolate:
        raise KvbenchError(
            f"context={longest} is beyond {arch.name}'s max_position_embeddings={arch.max_context}; lower context, "
            "or add extrapolate=true to plan it anyway (the model was not trained that long)"
        )
