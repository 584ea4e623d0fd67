"""The run spec: every top-level setting of a run, declared once — its default, its type and range (the `Rule` the
entrance check applies, kvbench.preflight.entrance), its meaning. `TOP_LEVEL` (the rules by key) is derived from it;
conf/config.yaml repeats the defaults for Hydra and docs/cli.md documents the keys (tests/config/test_spec.py and
tests/test_docs.py hold both to this class).

A run's Hydra config ends at the check: `RunSpec.of(cfg)` types it once, and the runner, the configurations, the
model loader, the task builder, the engine modes and the config hash read the spec. The `model`, `task`, `method`
and `grid` sections ride along as plain dicts (what the config hash records); each registry entry reads its own
section's keys (a loader's, a task's `knobs`, a method's dataclass fields).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kvbench.config.rules import Rule, plain

DTYPE_CHOICES = ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
BUDGET_FIX = "budget=0.25 (a fraction in (0, 1]) or budget=512 (tokens), or budget=null"


def setting(default: Any, kind: str, fix: str, *, factory=None, keys: dict | None = None, **rule: Any) -> Any:
    """A RunSpec field and its rule: `kind` and the keyword arguments are kvbench.config.rules.Rule's; `keys`: the
    rules of a section's own keys (`grid.method`), checked as `<name>.<key>`."""
    metadata = {"rule": Rule(kind, fix, **rule), "keys": keys or {}}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def section(fix: str) -> Any:
    """A config group or block carried as a plain dict (its keys are its builder's to check)."""
    return setting(None, "dict", fix, factory=dict)


GRID_KEYS = {
    "method": Rule(
        "list",
        "grid.method=[snapkv,h2o] (a list; null: the selected method)",
        nullable=True,
        non_empty=True,
        item=Rule("any"),
    ),
    "budget": Rule(
        "list",
        "grid.budget=[0.25,0.5] (a list; null: budget)",
        nullable=True,
        non_empty=True,
        item=Rule("budget", "budget fractions in (0, 1] or token counts"),
    ),
}


@dataclass(frozen=True)
class RunSpec:
    # what runs: config groups (conf/model, conf/task, conf/method) and the grid
    model: dict = section("model=smollm2-135m (conf/model/)")
    task: dict = section("task=niah (conf/task/)")
    method: dict = section("method=snapkv (conf/method/)")
    engine: dict = section("engine=kvbench (conf/engine/: kvbench or a serving engine of kvbench.engines)")
    budget: float | int | None = setting(None, "budget", BUDGET_FIX, nullable=True)  # None: 0.5 where one is taken
    grid: dict = setting(None, "dict", "grid.method=[snapkv,h2o] grid.budget=[0.25,0.5]", factory=dict, keys=GRID_KEYS)
    query_aware: bool = setting(True, "bool", "query_aware=true or query_aware=false")
    limit: int | None = setting(
        None, "int", "limit=10 (at most 10 examples) or limit=null (every example)", nullable=True, min=1
    )
    seed: int = setting(0, "int", "seed=0 (any integer)")
    device: str = setting("auto", "str", "device=auto, device=cpu or device=cuda (cuda:N)")
    dtype: str = setting(
        "auto", "str", "dtype=auto (native bf16 else fp32), bfloat16, float16 or float32", choices=DTYPE_CHOICES
    )
    results_dir: Path = setting(Path("results/runs"), "str", "results_dir=PATH (a directory for the results store)")
    rerun: bool = setting(False, "bool", "rerun=true (recompute stored rows) or rerun=false")
    report: bool = setting(True, "bool", "report=true or report=false")  # plots and report.html beside the rows
    # teacher-forced diagnostics (kvbench.guide.diagnose_run) and the verdict's thresholds (kvbench/guide/verdict.py)
    diagnose: bool = setting(
        False, "bool", "diagnose=true (teacher-forced diagnostics and a verdict per row) or diagnose=false"
    )
    verdict: dict = section("verdict.recall_high=0.9 (the thresholds of kvbench/guide/verdict.py)")
    batch_size: int = setting(1, "int", "batch_size=8 (examples decoded together; 1 = one at a time)", min=1)
    prefill: str = setting(
        "shared",
        "str",
        "prefill=shared (compress after the whole prefill; grids share it) or prefill=inline (each layer "
        "compressed inside the forward pass)",
        choices=("shared", "inline"),
    )
    prefill_chunk: int | None = setting(
        None,
        "int",
        "prefill_chunk=1024 (tokens per chunk, with prefill=inline) or prefill_chunk=null (whole prompt)",
        nullable=True,
        min=1,
    )
    prefix_cache: bool = setting(False, "bool", "prefix_cache=true (reuse cached prefixes) or prefix_cache=false")
    prefix_cache_bytes: int | None = setting(
        None, "int", "prefix_cache_bytes=500000000 (bytes) or null (no limit)", nullable=True, min=0
    )
    page_size: int = setting(16, "int", "page_size=16 (tokens per prefix-cache page; 1 = token level)", min=1)
    reuse: str = setting(
        "per_question", "str", "reuse=per_question or reuse=compress_once", choices=("per_question", "compress_once")
    )
    grid_batch: str | bool = setting(
        "auto",
        "any",
        "grid_batch=auto (a grid's configurations decoded together where rows stay identical), grid_batch=true or "
        "grid_batch=false",
        choices=("auto", True, False),
    )
    fidelity: bool = setting(True, "bool", "fidelity=true (KL columns vs the full cache) or fidelity=false")
    decode_graph: bool = setting(
        False, "bool", "decode_graph=true (CUDA: a configuration's decode step captured once, replayed) or false"
    )
    grid_padding: float = setting(
        3.0,
        "float",
        "grid_padding=3 (a grid batch may hold this × its rows' own cache bytes, pads included, + one row; ≥ 1)",
        min=1,
    )
    # set by a launcher on each worker's copy (kvbench.integrations.ray_launcher), from `launcher.*`
    shard: tuple[int, int] | None = None  # (shard, n_shards)
    attempt: str | None = None  # the attempt id for this shard (its rows' file name)

    @property
    def task_name(self) -> str:
        return str(self.task.get("name", ""))

    @property
    def engine_name(self) -> str:
        return str(self.engine.get("name") or "kvbench")

    @classmethod
    def of(cls, cfg: DictConfig | RunSpec) -> RunSpec:
        """The spec of a checked config (a RunSpec is returned as it is): each setting typed by its rule."""
        if isinstance(cfg, RunSpec):
            return cfg
        values: dict[str, Any] = {}
        for f in fields(cls):
            if "rule" not in f.metadata:
                continue
            value = plain(cfg.get(f.name)) if f.name in cfg else None
            values[f.name] = _typed(f.metadata["rule"], value, f)
        launcher = plain(cfg.get("launcher")) or {}
        shard = launcher.get("shard")
        return cls(
            **values,
            shard=None if shard is None else (int(shard), int(launcher["n_shards"])),
            attempt=launcher.get("attempt"),
        )


def _typed(rule: Rule, value: Any, f) -> Any:
    """A checked value as its field holds it: the default where it is absent (null for a nullable setting)."""
    if value is None:
        if rule.nullable:
            return None
        return f.default_factory() if f.default_factory is not MISSING else f.default
    if f.name == "results_dir":
        return Path(str(value))
    cast = {"int": int, "float": float, "bool": bool, "str": str}.get(rule.kind)
    return cast(value) if cast else value


def top_level_rules() -> dict[str, Rule]:
    """Every top-level key's rule (dotted for a section's own keys: `grid.method`), from the spec's fields."""
    out: dict[str, Rule] = {}
    for f in fields(RunSpec):
        if "rule" in f.metadata:
            out[f.name] = f.metadata["rule"]
            out.update({f"{f.name}.{key}": rule for key, rule in f.metadata["keys"].items()})
    return out


# ★ every top-level key of conf/config.yaml (config groups are checked by their own code)
TOP_LEVEL: dict[str, Rule] = {
    k: r for k, r in top_level_rules().items() if k not in ("model", "task", "method", "engine")
}
