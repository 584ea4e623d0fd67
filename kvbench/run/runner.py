"""One run: load the model and task, then for each example prefill once and decode every configuration.

Configurations = the full-cache baseline + the requested (method, budget) pairs (one from `method`/`budget`, or
the grid `grid.method × grid.budget`). Methods that share the prefill get one prefill per example with the union
of their statistics; rows are identical to running each configuration alone (tests/run/test_sweep.py).
"""

from __future__ import annotations

import itertools
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig
from tqdm import tqdm

from kvbench import ConfigurationsFailed, KvbenchError
from kvbench.config.spec import RunSpec
from kvbench.guide.diagnose_run import thresholds_for
from kvbench.model.device import resolve_device
from kvbench.model.load import load_model
from kvbench.native.bandwidth import memory_bandwidth
from kvbench.native.engine import Engine
from kvbench.native.graph_decode import check_setting as check_graph_setting
from kvbench.preflight.entrance import check_model_support, check_run
from kvbench.rows import modes
from kvbench.rows.build import RowContext
from kvbench.rows.config_hash import grid_batching, grid_padding, hash_configuration
from kvbench.rows.modes import RunFacts
from kvbench.run.example_work import ExampleWork
from kvbench.store.aggregate import summarize, with_variants
from kvbench.store.intervals import interval_text
from kvbench.store.results import (
    COLUMNS,
    ResultStore,
    StoreFault,
    check_writable,
    code_fingerprint,
    data_digests,
    fault_text,
    provenance,
    write_csv,
    write_rows,
)
from kvbench.tasks import build_task
from kvbench.tasks.base import check_fits


def run(cfg: DictConfig, output_dir: str | Path | None = None) -> pd.DataFrame:
    """Run the configured job in this process (or one launcher shard of it); returns this run's rows (computed
    and reused). Writes store + run directory. `kvbench.__main__.launch` picks a launcher first."""
    spec, confs = check_run(cfg)
    check_graph_setting(spec.decode_graph, resolve_device(spec.device))  # before a model loads
    lm = load_model(spec.model, spec.device, spec.dtype)
    check_model_support(spec, confs, lm.config)
    task = build_task(spec.task, lm.tokenizer, spec.seed, lm.max_context)
    # with `limit`, only the first examples are built (a million facts with limit=1 build one)
    examples = list(itertools.islice(task.iter_examples(), spec.limit)) if spec.limit else task.examples()
    if not examples:
        raise KvbenchError("the task selected no examples; check the task's grid/subsets and `limit`")
    if task.kind != "stream":  # a stream may run past the context window: that is what it measures
        check_fits(examples, lm.max_context)
    data = data_digests(task.data_files())
    store = ResultStore(spec.results_dir)  # checked only once the input is known to be good
    out_dir = check_outputs(store, output_dir)
    serving_engine = start_serving_engine(spec, lm)  # a serving engine's worker process (engine=kvbench: None)
    try:
        return run_examples(spec, confs, lm, task, examples, data, store, out_dir, serving_engine)
    finally:
        if serving_engine is not None:
            serving_engine.close()


def start_serving_engine(spec: RunSpec, lm):
    """engine=<serving engine>: its ServingEngine, its worker started on the run's model at kvbench's resolved dtype
    (the engine's weights and activations then match the full cache it is compared with; kvbench.engines)."""
    if spec.engine_name == "kvbench":
        return None
    from kvbench.engines import ENGINES

    serving_engine = ENGINES.get(spec.engine_name)()
    print(f"[kvbench] starting engine={spec.engine_name} in its own process ({serving_engine.venv})", flush=True)
    serving_engine.start(spec.model, str(lm.dtype).removeprefix("torch."))
    return serving_engine


def run_examples(spec: RunSpec, confs, lm, task, examples, data, store, out_dir: Path, serving_engine) -> pd.DataFrame:
    """The examples × configurations of a checked run, into the store and the run directory."""
    version = serving_engine.version if serving_engine is not None else None
    for c in confs:
        c.hash = hash_configuration(c, spec, lm, data, version)

    run_id = f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    shard = spec.shard
    if shard:
        examples = examples[shard[0] :: shard[1]]  # a launcher's shard: every n-th example, prefills stay whole
        run_id += f"-shard{shard[0]}-{spec.attempt or uuid.uuid4().hex[:6]}"
        if not examples:
            return pd.DataFrame()
    common = {"run_id": run_id, "seed": spec.seed, **provenance(lm.device), **modes.row_keys(spec)}
    bandwidth = memory_bandwidth(lm.device)  # probed once per machine, cached
    common["memory_bandwidth"] = bandwidth  # bytes/s: what each row's bandwidth_share is a share of
    common.update(engine=spec.engine_name, engine_version=version or common["kvbench_version"])
    ctx = RowContext(
        Engine(lm, graphs=spec.decode_graph),
        task,
        common,
        diagnose=thresholds_for(spec, task) if spec.diagnose else None,
        prefill=spec.prefill,
        prefill_chunk=spec.prefill_chunk,
        grid_batch=grid_batching(spec, lm, requested=len(confs) - 1),  # confs[0]: the baseline
        grid_padding=grid_padding(spec),
        serving_engine=serving_engine,
        fidelity=spec.fidelity,
        bandwidth=bandwidth,
    )
    facts = RunFacts(spec, type(task), tuple(c.method for c in confs), lm.layout.has_sliding, lm.layout.is_hybrid)
    if modes.batched(facts):
        from kvbench.run.batched_work import BatchedWork  # examples of equal length decoded together
    work = (BatchedWork if modes.batched(facts) else ExampleWork)(spec, confs, ctx, store, run_id, facts, out_dir)
    started = time.perf_counter()
    try:
        for ex in tqdm(examples, desc=f"{task.name} × {len(confs)} configs", unit="example"):
            work.do(ex)
        work.finish_claimed_elsewhere()
    except OSError as error:  # the store's disk filled, went read-only, ...: every row saved before is intact
        raise StoreFault(work.fault(error)) from None
    finally:
        work.claims.release_all()
    frame = pd.DataFrame(work.rows) if work.rows else pd.DataFrame(columns=COLUMNS)
    frame = frame[COLUMNS + [c for c in frame.columns if c not in COLUMNS]]
    if shard:
        frame.attrs["failed"] = dict(work.failed)  # the driver names them with the other shards'
        return frame  # the launcher's driver gathers the shards and writes the run's outputs
    if not len(frame) and work.failed:  # every configuration failed: no outputs to write, the failures named
        raise ConfigurationsFailed(failures_text(work.failed, rows=0))
    frame.attrs["work_s"] = time.perf_counter() - started  # the examples' work, the model loaded (kvbench.bench)
    finish_run(spec, frame, out_dir, store, len(work.computed), frame.attrs["work_s"])
    if work.failed:
        raise ConfigurationsFailed(failures_text(work.failed, rows=len(frame)))
    return frame


def failures_text(failed: dict[str, str], rows: int) -> str:
    """The failed configurations, one line each (exit 1): the others' rows are written, or none was."""
    head = (
        f"{len(failed)} configuration(s) failed; the other rows are written"
        if rows
        else f"every configuration failed ({len(failed)}); no row was computed, nothing was written"
    )
    return head + ":\n" + "\n".join(f"  {name}: {why}" for name, why in failed.items())


def check_outputs(store: ResultStore, output_dir: str | Path | None) -> Path:
    """Before the first example: the store's rows and claims folders and the run directory take files (each a
    directory, writable); returns the run directory."""
    check_writable(store.rows_dir)
    check_writable(store.root / "claims")
    out_dir = Path(output_dir) if output_dir else store.root / "last"
    check_writable(out_dir, key="hydra.run.dir" if output_dir else "results_dir")
    return out_dir


def finish_run(
    spec: RunSpec, frame: pd.DataFrame, out_dir: Path, store: ResultStore, n_computed: int, seconds: float
) -> None:
    """The run's own outputs: rows.parquet, summary.csv, the printed summary and (unless report=false) plots."""
    try:
        write_outputs(spec, frame, out_dir, store, n_computed, seconds)
    except OSError as error:  # every row is in the store already: only the run directory's copies are missing
        what, remedy = fault_text(error)
        raise StoreFault(
            f"{what} while writing the run's outputs in {out_dir}: all {len(frame)} rows are safe in the store "
            f"{store.rows_dir}; {remedy}, then rerun to resume (it reuses them) or read them with "
            f"python -m kvbench.report {store.root}"
        ) from None


def write_outputs(
    spec: RunSpec, frame: pd.DataFrame, out_dir: Path, store: ResultStore, n_computed: int, seconds: float
) -> None:
    write_rows(frame, out_dir / "rows.parquet")
    if spec.diagnose:
        from kvbench.guide.diagnose_run import copy_side_records

        copy_side_records(store.rows_dir, frame, out_dir / "rows.parquet")
    labelled = frame.assign(method=with_variants(frame)["variant"])
    summary = summarize(labelled)
    write_csv(summary, out_dir / "summary.csv")
    print_summary(
        summary, out_dir, store, n_computed, len(frame) - n_computed, seconds, stale_rows(frame), batches(labelled)
    )
    for line in compressed_nothing(labelled):
        print(line)
    if "engine_invalid" in frame:  # a serving engine's garbage option: stored, never averaged
        flagged = frame[frame["engine_invalid"].fillna("").astype(str) != ""]
        for method, group in flagged.groupby("method"):
            print(f"not averaged: {method} ({len(group)} rows): {group['engine_invalid'].iloc[0]}")
    if spec.report:
        from kvbench.report.build import build_report  # imported here: matplotlib only when a report is wanted

        files = build_report([out_dir / "rows.parquet"], out_dir / "report", tolerance=0.02)
        plots = [f for f in files if f.suffix == ".png"]
        print(f"plots:   {len(plots)} PNGs in {out_dir / 'report'} (e.g. {plots[0].name})" if plots else "")
        print(f"report:  {out_dir / 'report' / 'report.html'}")


def compressed_nothing(rows: pd.DataFrame) -> list[str]:
    """One line per configuration given a budget below 1 whose every row holds the full cache (kv_ratio 1): stored
    under its name like any other, but nothing was compressed — e.g. every layer slides within a window no longer
    than the budget (a Mistral-style model on a short prompt). Said plainly rather than left to a 1.000 in a column."""
    budgeted = rows[(rows["method"] != "full") & (rows["budget"] < 1.0)]
    lines = []
    for (task, method, budget), group in budgeted.groupby(["task", "method", "budget"], sort=True):
        if (group["kv_ratio"] >= 1.0 - 1e-9).all():
            lines.append(
                f"note: {method} at budget {budget:g} on {task} compressed nothing: every one of its {len(group)} "
                "rows holds the full cache (kv_ratio 1.000); the layers it compresses were kept whole at this budget "
                "(sliding windows no longer than the budget, or a prompt shorter than its minimum)"
            )
    return lines


def stale_rows(frame: pd.DataFrame) -> int:
    """Reused rows computed by other code than this run's (or by code that recorded no fingerprint)."""
    if "reused" not in frame or not len(frame):
        return 0
    recorded = frame["code_fingerprint"] if "code_fingerprint" in frame else pd.Series(None, index=frame.index)
    return int((frame["reused"].astype(bool) & (recorded != code_fingerprint())).sum())


BATCH_KEYS = ["model", "task", "method", "budget", "query_aware"]  # a configuration's rows within a task


def batches(rows: pd.DataFrame) -> pd.DataFrame:
    """Per configuration of a task: the sizes of the batches its rows decoded in (`1`, `2`, `1–8`: grid_batch,
    batch_size), whose step time a row's decode_ms_per_token is where it is > 1 (rows without the column: 1)."""
    size = rows["batch_size"].fillna(1).astype(int) if "batch_size" in rows else pd.Series(1, index=rows.index)
    sizes = size.groupby([rows[k] for k in BATCH_KEYS], dropna=False).agg(["min", "max"])
    text = [f"{lo}" if lo == hi else f"{lo}–{hi}" for lo, hi in zip(sizes["min"], sizes["max"])]
    return sizes.assign(batch_size=text, batched=sizes["max"] > 1)[["batch_size", "batched"]].reset_index()


def print_summary(
    summary: pd.DataFrame,
    out_dir: Path,
    store: ResultStore,
    n_new: int,
    n_reused: int,
    seconds: float,
    stale: int = 0,
    batch: pd.DataFrame | None = None,
) -> None:
    """The per-task table (configurations compared on the same examples; others listed apart with their n).

    `batch` (`batches(rows)`): a configuration decoded in batches shows its time under `batch_ms_per_step`, the
    batch's step shared by every row of the batch, with the batch sizes — never as its own decode_ms_per_token."""
    table = summary[summary["level"] == "task"].assign(
        ci95=lambda t: [interval_text(lo, hi, digits=3) for lo, hi in zip(t["ci_low"], t["ci_high"])]
    )
    timing = ["decode_ms_per_token"]
    if batch is not None and batch["batched"].any():
        table = table.merge(batch, on=BATCH_KEYS, how="left")
        shared = table["batched"].fillna(False).astype(bool)
        table["batch_ms_per_step"] = table["decode_ms_per_token"].where(shared)
        table["decode_ms_per_token"] = table["decode_ms_per_token"].where(~shared)
        timing = ["decode_ms_per_token", "batch_ms_per_step", "batch_size"]
    cols = (
        ["task", *(["length"] if table["length"].any() else []), "method", "budget", "n", "score", "ci95"]
        + (["score_partial"] if "score_partial" in table else [])
        + ["drop_vs_full", "kv_ratio", "prefill_s", *timing]
        + (["bandwidth_share"] if table["bandwidth_share"].notna().any() else [])
    )

    def show(part: pd.DataFrame) -> str:
        return part[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}", na_rep="–")

    print()
    print(show(table[table["compared"]]))
    apart = table[~table["compared"]]
    if len(apart):
        print("\nran on only part of the examples (not comparable with the rows above):")
        print(show(apart))
    if len(timing) > 1:
        print(
            "batch_ms_per_step: one decode step of a batch of batch_size rows decoded together (configurations: "
            "grid_batch; examples: batch_size), the same for every row of the batch; per-method decode_ms_per_token "
            "comes from rows decoded alone (grid_batch=false)"
        )
    print(f"\n{n_new} rows computed, {n_reused} reused from the store, in {seconds:.0f} s")
    if stale:
        print(
            f"note: {stale} of the {n_reused} reused rows were computed by different kvbench code (another "
            "code_fingerprint); rerun=true to recompute"
        )
    print(f"rows:    {out_dir / 'rows.parquet'}\nsummary: {out_dir / 'summary.csv'}\nstore:   {store.rows_dir}")
