"""The run spec: a run's top-level settings as typed values, read once from the Hydra config after
kvbench.run.check has checked it (`check_config`), and handed down instead of the raw DictConfig.

The `model` and `task` sections ride along as plain dicts (what the config hash records); they stay the DictConfig
their registry entry reads (a loader's keys, a task's `Rule`s) where that entry is built, as the `method` and `grid`
sections do where the configurations are built (kvbench.run.configuration). Everything a runner,
an engine mode or the config hash decides on is here, with its default, its type and its meaning in one place
(conf/config.yaml documents the same keys for the command line).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from kvbench.config.rules import plain


@dataclass(frozen=True)
class RunSpec:
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    limit: int | None = None  # at most this many examples
    results_dir: Path = Path("results/runs")
    rerun: bool = False  # recompute rows already in the store
    report: bool = True  # this run's plots and report.html next to its rows
    diagnose: bool = False  # teacher-forced diagnostics (kvbench.guide.diagnose_run)
    query_aware: bool = True
    batch_size: int = 1  # examples of equal prompt length decoded together
    prefill: str = "shared"  # shared | inline
    prefill_chunk: int | None = None  # prefill=inline: tokens per chunk
    prefix_cache: bool = False
    prefix_cache_bytes: int | None = None
    page_size: int = 16
    reuse: str = "per_question"  # per_question | compress_once
    grid_batch: str | bool = "auto"  # auto | true | false
    grid_padding: float | None = None  # a grid batch's memory bound; None: the engine's (grid_decode.MAX_PADDING)
    shard: tuple[int, int] | None = None  # (shard, n_shards) when a launcher runs this process on one shard
    attempt: str | None = None  # a launcher's attempt id for this shard (its rows' file name)
    model: dict = field(default_factory=dict)  # the model section, plain
    task: dict = field(default_factory=dict)  # the task section, plain (its `name` is the task's registry key)
    verdict: dict = field(default_factory=dict)  # diagnose's thresholds (kvbench/guide/verdict.py Thresholds)

    @property
    def task_name(self) -> str:
        return str(self.task.get("name", ""))

    @classmethod
    def of(cls, cfg: DictConfig | RunSpec) -> RunSpec:
        """The spec of a checked config (a RunSpec is returned as it is)."""
        if isinstance(cfg, RunSpec):
            return cfg
        get = cfg.get
        launcher = get("launcher") or {}
        shard = launcher.get("shard")
        chunk, cache_bytes, limit, padding = (
            get(k) for k in ("prefill_chunk", "prefix_cache_bytes", "limit", "grid_padding")
        )
        return cls(
            seed=int(get("seed", 0)),
            device=str(get("device", "auto")),
            dtype=str(get("dtype", "auto")),
            limit=None if not limit else int(limit),
            results_dir=Path(str(get("results_dir", "results/runs"))),
            rerun=bool(get("rerun", False)),
            report=bool(get("report", True)),
            diagnose=bool(get("diagnose", False)),
            query_aware=bool(get("query_aware", True)),
            batch_size=int(get("batch_size") or 1),
            prefill=str(get("prefill") or "shared"),
            prefill_chunk=None if chunk is None else int(chunk),
            prefix_cache=bool(get("prefix_cache", False)),
            prefix_cache_bytes=None if cache_bytes is None else int(cache_bytes),
            page_size=int(get("page_size", 16)),
            reuse=str(get("reuse", "per_question")),
            grid_batch=get("grid_batch", "auto"),
            grid_padding=None if padding is None else float(padding),
            shard=None if shard is None else (int(shard), int(launcher["n_shards"])),
            attempt=launcher.get("attempt"),
            model=plain(get("model")) or {},
            task=plain(get("task")) or {},
            verdict=plain(get("verdict")) or {},
        )
