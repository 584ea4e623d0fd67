"""One run: load the model and task, then for each example prefill once and decode every configuration.

Configurations = the full-cache baseline + the requested (method, budget) pairs (one from `method`/`budget`, or
the grid `grid.method × grid.budget`). Methods that share the prefill get one prefill per example with the union
of their statistics; rows are identical to running each configuration alone (tests/test_sweep.py).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig
from tqdm import tqdm

from kvbench import KvbenchError, inline, workload
from kvbench.aggregate import summarize, with_variants
from kvbench.attention import StatsRequest
from kvbench.batched import batch_columns
from kvbench.claims import Claims
from kvbench.engine import Engine, Generation
from kvbench.grid_decode import MAX_PADDING
from kvbench.methods import Budget, Method, build_method, method_defaults
from kvbench.models import load_model
from kvbench.results import (
    COLUMNS,
    ResultStore,
    check_writable,
    code_fingerprint,
    config_hash,
    file_digest,
    provenance,
    write_csv,
    write_rows,
)
from kvbench.tasks import TASKS, Example, build_task
from kvbench.tasks.base import check_fits
from kvbench.validate import check_config, plain

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


def method_config(name: str) -> dict:
    """conf/method/<name>.yaml as a dict (for grid entries given by name)."""
    return {"name": name, **method_defaults(name)}


def grid_entry(entry, cfg: DictConfig) -> dict:
    """A grid.method entry: a method name (its yaml's knobs; the selected `method` keeps its overrides) or a
    mapping {name: ..., knob: value} for parameter variants, e.g. {name: kivi, bits: 2}."""
    if isinstance(entry, dict):
        if "name" not in entry:
            raise KvbenchError(f"grid.method entry {entry} needs a `name`")
        return {**method_config(entry["name"]), **entry}
    if entry == cfg.method.name:
        return plain(cfg.method)
    return method_config(entry)


def make_configuration(method_cfg: dict, budget, query_aware: bool) -> Configuration:
    params = {k: v for k, v in method_cfg.items() if k != "name"}
    method = build_method(method_cfg["name"], params)
    return Configuration(method, Budget.parse(budget) if method.has_budget else None, query_aware)


def configurations(cfg: DictConfig) -> list[Configuration]:
    """Baseline first, then the requested configurations (duplicates dropped)."""
    query_aware = bool(cfg.query_aware)
    grid = cfg.get("grid") or {}
    if grid.get("method") or grid.get("budget"):
        entries = plain(grid.get("method")) if grid.get("method") else [cfg.method.name]
        budgets = list(grid.get("budget") or [DEFAULT_BUDGET if cfg.budget is None else cfg.budget])
        requested = [make_configuration(grid_entry(e, cfg), b, query_aware) for e in entries for b in budgets]
    else:
        method_cfg = plain(cfg.method)
        requested = [make_configuration(method_cfg, DEFAULT_BUDGET if cfg.budget is None else cfg.budget, query_aware)]
        method = requested[0].method
        if cfg.budget is not None and not method.has_budget and method.family != "none":
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


def grid_batching(cfg: DictConfig, lm) -> bool:
    """Whether a grid's configurations of one example decode together (kvbench.grid_decode): grid_batch=auto does
    where the rows are identical to one by one (tested); true always; false never."""
    setting = cfg.get("grid_batch", "auto")
    return grid_rows_as_alone(lm) if setting == "auto" else bool(setting)


def grid_rows_as_alone(lm) -> bool:
    """Whether a grid row decodes as it does alone: with the row-independent linear kernel (CPU, float32 or
    bfloat16: kvbench.kernels.decode_linear) bit for bit; in float32 without it, token for token in every test
    (MKL's several-row products differ from its one-row product in the last bit); else not (bf16 products round
    a row by the batch size)."""
    return decode_kernels(lm) or str(lm.dtype).removeprefix("torch.") == "float32"


def forced_grid_keys(cfg: DictConfig) -> dict:
    """Hash keys of rows grid-batched where rows depend on their batch: the setting, and a non-default padding."""
    padding = float(cfg.get("grid_padding", MAX_PADDING))
    return {"grid_batch": True, **({"grid_padding": padding} if padding != MAX_PADDING else {})}


def decode_kernels(lm) -> bool:
    """Whether decode steps run kvbench's C kernels (kernels/decode_linear.py, decode_attention.py)."""
    from kvbench.kernels import decode_linear

    return decode_linear.installed(lm.model)


def bf16_kernels(lm) -> bool:
    """Whether a bf16 model's prompts run kvbench's AVX512-BF16 C kernels (CPU): the causal attention
    (kernels/prefill_attention.py, head sizes 64 and 128) instead of sdpa, and H2O's all-query column sums
    (kernels/attention_stats.py) by dot products instead of widened sgemm — both sum in their own order."""
    from kvbench.kernels import prefill_attention

    # supported(64): the kernels were built with AVX512-BF16 (asked last: CUDA and fp32 runs build nothing)
    return lm.device.type == "cpu" and str(lm.dtype) == "torch.bfloat16" and prefill_attention.supported(64)


def hash_configuration(c: Configuration, cfg: DictConfig, lm, data: dict[str, str] | None = None) -> str:
    """`data`: path → sha256 of each file the task reads (task.data_files()): an edited file is a new key."""
    selection = TASKS.get(cfg.task.name).selection_keys  # they pick examples, not change them: rows stay reusable
    task = {k: v for k, v in plain(cfg.task).items() if k not in selection}
    return config_hash(
        {
            "model": plain(cfg.model),
            "dtype": str(lm.dtype),
            "device": lm.device.type,
            "task": task,
            "seed": cfg.seed,
            "method": c.method.name,
            "params": c.method.params(),
            "budget": c.budget_value,
            "query_aware": c.query_aware,
            **({"data": data} if data else {}),
            **workload.hash_keys(cfg),
            **inline.hash_keys(cfg),
            **({"batch_size": int(cfg.batch_size)} if int(cfg.get("batch_size") or 1) > 1 else {}),  # its own timings
            # outside float32, decoding configurations together may change a last bit (and a token), and which rows
            # share a batch (grid_padding) with it: apart
            **(forced_grid_keys(cfg) if grid_batching(cfg, lm) and not grid_rows_as_alone(lm) else {}),
            # the C decode kernels round differently from torch's products and sdpa: their rows are their own
            **({"decode_kernels": "c"} if decode_kernels(lm) else {}),
            **({"bf16_kernels": "c"} if bf16_kernels(lm) else {}),
        }
    )


def row_for(c: Configuration, ex: Example, task, common: dict, lm, **measured) -> dict:
    """One result row: provenance and what ran (shared by every task kind) + the measured columns."""
    return {
        **common,
        "config_hash": c.hash,
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "model": lm.name,
        "task": task.name,
        "subset": ex.subset,
        "method": c.method.name,
        "budget": c.budget_value,
        "method_params": json.dumps(c.method.params(), sort_keys=True),
        "query_aware": c.query_aware,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "reused": False,
        **measured,
        **ex.meta,
    }


def make_row(c: Configuration, ex: Example, gen: Generation, scores: dict, common: dict, task, lm) -> dict:
    return row_for(
        c,
        ex,
        task,
        common,
        lm,
        example_id=ex.example_id,
        context_tokens=gen.context_tokens,
        new_tokens=len(gen.token_ids),
        metric=task.metric_of(ex),
        prediction=gen.text,
        answers=json.dumps(ex.answers),
        kv_bytes=gen.kv_bytes,
        kv_bytes_full=gen.kv_bytes_full,
        kv_ratio=gen.kv_ratio,
        kv_bytes_mha=gen.kv_bytes_mha,
        peak_mem_bytes=gen.peak_mem_bytes,
        peak_mem_delta_bytes=gen.peak_mem_delta_bytes,
        prefill_s=gen.prefill_s,
        decode_s=gen.decode_s,
        decode_ms_per_token=gen.decode_ms_per_token,
        **batch_columns(gen),
        **scores,
    )


def generation_rows(
    engine: Engine,
    todo: list[Configuration],
    ex: Example,
    task,
    common: dict,
    lm,
    diagnose=None,
    side: list | None = None,
    prefill=None,
    inline_chunk: tuple[str, int | None] = ("shared", None),
    grid_batch: bool = False,
    grid_padding: float = MAX_PADDING,
) -> list[dict]:
    """One prefill serves every configuration that shares it; methods that change the model get their own.

    diagnose: verdict Thresholds when `diagnose=true` (kvbench.diagnose_run): rows gain the diagnostic columns and
    the per-(layer, KV head) records are appended to `side`. `prefill(ids, request)` replaces engine.prefill for
    the shared one (the prefix cache: kvbench.workload). `inline_chunk` = (prefill, prefill_chunk): with
    prefill=inline every configuration prefills on its own, compressing inside the forward pass (kvbench.inline).
    grid_batch: the configurations sharing the prefill decode together where their caches allow
    (kvbench.grid_decode), in batches holding at most grid_padding × their own cache bytes; rows are the same,
    timings the batch's."""
    prompt_ids, suffix_ids = ex.split(todo[0].query_aware)
    mode, chunk = inline_chunk
    shared = [c for c in todo if c.method.shares_prefill and mode == "shared"]
    request = StatsRequest()
    for c in shared:
        request = request | c.method.stats_request()
    prefill = (prefill or engine.prefill)(prompt_ids, request) if shared else None
    rows, together = [], {}
    if grid_batch and len(shared) > 1 and diagnose is None and prefill.adopt is None:  # type: ignore[union-attr]
        from kvbench.grid_decode import generate_grid  # configurations of this example decoded as one batch

        confs = [(c.method, c.budget) for c in shared]
        gens = generate_grid(engine, prefill, confs, suffix_ids, ex.max_new_tokens, ex.stop, grid_padding)
        together = {id(c): gen for c, gen in zip(shared, gens)}
    for c in todo:
        if id(c) in together:
            gen = together[id(c)]
            rows.append(make_row(c, ex, gen, task.score(gen.text, ex), common, task, lm))
            continue
        own = engine if c.method.shares_prefill else engine.prepared(c.method)
        if mode == "inline":
            source = inline.prefill(own, c.method, c.budget, prompt_ids, chunk)
        elif prefill is not None and c.method.shares_prefill:
            source = prefill
        else:
            source = own.prefill(prompt_ids, c.method.stats_request())
        gen = own.generate(source, c.method, c.budget, suffix_ids, ex.max_new_tokens, ex.stop)
        rows.append(make_row(c, ex, gen, task.score(gen.text, ex), common, task, lm))
    if diagnose is not None:
        from kvbench.diagnose_run import diagnose_example

        side.extend(diagnose_example(engine, todo, ex, task, prefill, rows, diagnose))  # type: ignore[union-attr]  # given with diagnose
    return rows


def stream_rows(engine: Engine, c: Configuration, ex: Example, task, common: dict, lm) -> list[dict]:
    """Perplexity tasks: one row per window of the streamed text (see kvbench.streaming)."""
    from kvbench.streaming import stream_budget, stream_perplexity

    ids = ex.context_ids
    budget = stream_budget(c.budget, len(ids))  # fraction of the text → tokens
    windows = stream_perplexity(  # headmerge: its model; prefill=inline bounds each layer inside the forward
        engine.prepared(c.method), c.method, budget, ids, task.chunk, inline=common["prefill"] == "inline"
    )
    rows, nll, predicted = [], 0.0, 0
    for w, row_id in zip(windows, task.row_ids(ex)):
        nll, predicted = nll + w.nll_sum, predicted + w.n_predicted
        row = row_for(
            c,
            ex,
            task,
            common,
            lm,
            example_id=row_id,
            context_tokens=w.tokens_seen,
            new_tokens=w.n_predicted,
            metric=task.metric,
            prediction="",
            answers="[]",
            score=w.perplexity,
            kv_bytes=w.kv_bytes,
            kv_bytes_full=w.kv_bytes_full,
            kv_ratio=w.kv_bytes / w.kv_bytes_full,
            peak_mem_bytes=w.peak_mem_bytes,
            peak_mem_delta_bytes=w.peak_mem_delta_bytes,
            prefill_s=w.seconds,
            decode_s=0.0,
            decode_ms_per_token=1000 * w.seconds / max(1, w.n_predicted),
            window=w.index,
            cache_tokens=w.cache_tokens,
            perplexity_so_far=math.exp(nll / predicted),
        )
        rows.append(row)
    return rows


def run(cfg: DictConfig, output_dir: str | Path | None = None) -> pd.DataFrame:
    """Run the configured job; returns this run's rows (computed and reused). Writes store + run directory."""
    check_config(cfg)  # every key, knob and grid entry, before the model loads
    workload.check(cfg)
    confs = configurations(cfg)
    inline.check(cfg, [c.method for c in confs], TASKS.get(cfg.task.name))
    if (cfg.get("launcher") or {}).get("name", "local") == "ray" and shard_of(cfg) is None:
        if cfg.get("prefix_cache") or TASKS.get(cfg.task.name).workload:
            raise KvbenchError(
                "launcher=ray splits a run's examples across workers, which would split a workload's "
                "requests from their shared prefix; run prefix_cache / workload tasks with "
                "launcher=local (or one Hydra multirun job per workload)"
            )
        from kvbench.launch_ray import run_ray  # the driver: shards go to Ray workers, each loads the model once

        return run_ray(cfg, output_dir)
    lm = load_model(cfg.model, cfg.device, cfg.dtype)
    task = build_task(cfg.task, lm.tokenizer, int(cfg.seed), lm.max_context)
    examples = task.examples()
    if cfg.get("limit"):
        examples = examples[: int(cfg.limit)]
    if not examples:
        raise KvbenchError("the task selected no examples; check the task's grid/subsets and `limit`")
    if not task.streaming:  # a stream may run past the context window: that is what it measures
        check_fits(examples, lm.max_context)
    data = {str(path): file_digest(path) for path in task.data_files()}
    for c in confs:
        c.hash = hash_configuration(c, cfg, lm, data)
    store = ResultStore(cfg.results_dir)  # checked only once the input is known to be good
    check_writable(store.rows_dir)
    out_dir = Path(output_dir) if output_dir else store.root / "last"
    check_writable(out_dir)

    run_id = f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    shard = shard_of(cfg)
    if shard:
        examples = examples[shard[0] :: shard[1]]  # a launcher's shard: every n-th example, prefills stay whole
        run_id += f"-shard{shard[0]}-{cfg.launcher.get('attempt') or uuid.uuid4().hex[:6]}"
        if not examples:
            return pd.DataFrame()
    common = {"run_id": run_id, "seed": int(cfg.seed), **provenance(lm.device), **inline.row_keys(cfg)}
    batched = (
        int(cfg.get("batch_size") or 1) > 1
        and not task.streaming
        and not cfg.get("diagnose")
        and not cfg.get("prefix_cache")
        and not task.workload
        and not hasattr(task, "compute_rows")
    )
    if batched:
        from kvbench.batched_work import BatchedWork  # examples of equal length decoded together
    work = (BatchedWork if batched else ExampleWork)(cfg, confs, task, Engine(lm), store, run_id, common, lm)
    started = time.perf_counter()
    try:
        for ex in tqdm(examples, desc=f"{task.name} × {len(confs)} configs", unit="example"):
            work.do(ex)
        work.finish_claimed_elsewhere()
    finally:
        work.claims.release_all()
    frame = pd.DataFrame(work.rows)
    frame = frame[COLUMNS + [c for c in frame.columns if c not in COLUMNS]]
    if shard:
        return frame  # the launcher's driver gathers the shards and writes the run's outputs
    finish_run(cfg, frame, out_dir, store, len(work.computed), time.perf_counter() - started)
    return frame


def shard_of(cfg: DictConfig) -> tuple[int, int] | None:
    """(shard, n_shards) when a launcher runs this process on one shard of the examples."""
    launcher = cfg.get("launcher") or {}
    return (int(launcher["shard"]), int(launcher["n_shards"])) if launcher.get("shard") is not None else None


class ExampleWork:
    """Rows of one example × configurations: reused from the store, computed here, or — when another process
    has claimed them (concurrent writers, see kvbench.claims) — awaited and collected from the store."""

    def __init__(self, cfg, confs, task, engine, store, run_id, common, lm):
        self.cfg, self.confs, self.task, self.engine, self.store = cfg, confs, task, engine, store
        self.run_id, self.common, self.lm = run_id, common, lm
        # workload tasks and prefix caching run requests in order: a sequence is measured whole, never partly reused
        self.requests = workload.WorkloadRunner(engine, cfg, lm) if cfg.get("prefix_cache") or task.workload else None
        self.seen = store.versions()  # before reading: a file written in between is read again, never missed
        self.existing = {} if cfg.get("rerun") or self.requests else store.existing()
        self.claims = Claims(store.root)
        self.rows: list[dict] = []
        self.computed: list[dict] = []
        self.elsewhere: list[tuple[Example, list[Configuration]]] = []
        self.side: list[dict] = []  # diagnose=true: per-(layer, KV head) records (kvbench.diagnose_run)
        self.diagnose = None
        if cfg.get("diagnose"):
            from kvbench.diagnose_run import thresholds_for

            self.diagnose = thresholds_for(cfg, task)

    def _reuse(self, c: Configuration, ex: Example) -> list[dict] | None:
        old = [self.existing.get((c.hash, row_id)) for row_id in self.task.row_ids(ex)]
        done = all(r is not None and (self.diagnose is None or isinstance(r.get("verdict"), str)) for r in old)
        return [{**r, "reused": True} for r in old] if done else None

    def do(self, ex: Example) -> None:
        todo = self.todo(ex)
        if not todo:
            return
        if hasattr(self.task, "compute_rows"):  # tasks that drive the engine themselves (lm-eval's requests)
            new = self.task.compute_rows(self.engine, todo, ex, self.common, self.lm)
        elif self.task.streaming:
            new = [row for c in todo for row in stream_rows(self.engine, c, ex, self.task, self.common, self.lm)]
        elif self.requests:
            new = self.requests.rows(todo, ex, self.task, self.common, self.lm, self.diagnose, self.side)
        else:
            args = (self.engine, todo, ex, self.task, self.common, self.lm, self.diagnose, self.side)
            grid_batch = grid_batching(self.cfg, self.lm)
            padding = float(self.cfg.get("grid_padding", MAX_PADDING))
            new = generation_rows(
                *args, inline_chunk=inline.settings(self.cfg), grid_batch=grid_batch, grid_padding=padding
            )
        self.save(new, [(c.hash, ex.example_id) for c in todo])

    def todo(self, ex: Example) -> list[Configuration]:
        """The configurations this process computes for `ex` (others are reused, or claimed elsewhere)."""
        todo, busy = [], []
        for c in self.confs:
            old = self._reuse(c, ex)
            if old is not None:
                self.rows.extend(old)
            elif self.claims.try_claim(c.hash, ex.example_id):
                todo.append(c)
            else:
                busy.append(c)
        if busy:
            self.elsewhere.append((ex, busy))
        if todo and not self.requests:  # a claim won just after another process saved these rows and released it
            for row in self.store.rows_since(self.seen, self.store.rows_dir / f"{self.run_id}.parquet"):
                self.existing[(row["config_hash"], row["example_id"])] = row
            done = [c for c in todo if self._reuse(c, ex) is not None]
            for c in done:
                self.rows.extend(self._reuse(c, ex) or [])
            self.claims.release((c.hash, ex.example_id) for c in done)
            todo = [c for c in todo if c not in done]
        return todo

    def save(self, new: list[dict], claimed: list[tuple[str, str]]) -> None:
        self.computed.extend(new)
        self.rows.extend(new)
        path = self.store.save_run(self.run_id, self.computed)  # after every example: an interrupted sweep resumes
        if self.diagnose is not None:
            from kvbench.diagnose_run import write_side_table

            write_side_table(self.side, path)
        self.claims.release(claimed)

    def finish_claimed_elsewhere(self, poll_s: float = 2.0) -> None:
        """Wait for rows other processes were computing, then take them from the store (or compute what a
        process that died left undone)."""
        pending, self.elsewhere = self.elsewhere, []
        if pending:
            print(f"[kvbench] waiting for {sum(len(b) for _, b in pending)} rows claimed by another process")
        for ex, busy in pending:
            while any(self.claims.held_elsewhere(c.hash, ex.example_id) for c in busy):
                time.sleep(poll_s)
            self.existing = self.store.existing()
            confs, self.confs = self.confs, busy
            try:
                self.do(ex)
            finally:
                self.confs = confs
        if self.elsewhere:  # claimed again meanwhile (another late process): wait once more
            self.finish_claimed_elsewhere(poll_s)


def finish_run(
    cfg: DictConfig, frame: pd.DataFrame, out_dir: Path, store: ResultStore, n_computed: int, seconds: float
) -> None:
    """The run's own outputs: rows.parquet, summary.csv, the printed summary and (unless report=false) plots."""
    write_rows(frame, out_dir / "rows.parquet")
    if cfg.get("diagnose"):
        from kvbench.diagnose_run import copy_side_records

        copy_side_records(store.rows_dir, frame, out_dir / "rows.parquet")
    summary = summarize(frame.assign(method=with_variants(frame)["variant"]))
    write_csv(summary, out_dir / "summary.csv")
    print_summary(summary, out_dir, store, n_computed, len(frame) - n_computed, seconds, stale_rows(frame))
    if cfg.get("report", True):
        from kvbench.report import build_report  # imported here: matplotlib only when a report is wanted

        files = build_report([out_dir / "rows.parquet"], out_dir / "report", tolerance=0.02)
        plots = [f for f in files if f.suffix == ".png"]
        print(f"plots:   {len(plots)} PNGs in {out_dir / 'report'} (e.g. {plots[0].name})" if plots else "")
        print(f"report:  {out_dir / 'report' / 'report.html'}")


def stale_rows(frame: pd.DataFrame) -> int:
    """Reused rows computed by other code than this run's (or by code that recorded no fingerprint)."""
    if "reused" not in frame or not len(frame):
        return 0
    recorded = frame["code_fingerprint"] if "code_fingerprint" in frame else pd.Series(None, index=frame.index)
    return int((frame["reused"].astype(bool) & (recorded != code_fingerprint())).sum())


def print_summary(
    summary: pd.DataFrame, out_dir: Path, store: ResultStore, n_new: int, n_reused: int, seconds: float, stale: int = 0
) -> None:
    """The per-task table (configurations compared on the same examples; others listed apart with their n)."""
    table = summary[summary["level"] == "task"].assign(
        ci95=lambda t: [f"{lo:.3f}–{hi:.3f}" if hi == hi else "n<5" for lo, hi in zip(t["ci_low"], t["ci_high"])]
    )
    cols = (
        ["task", "method", "budget", "n", "score", "ci95"]
        + (["score_partial"] if "score_partial" in table else [])
        + ["drop_vs_full", "kv_ratio", "prefill_s", "decode_ms_per_token"]
    )
    print()
    print(table[table["compared"]][cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    apart = table[~table["compared"]]
    if len(apart):
        print("\nran on only part of the examples (not comparable with the rows above):")
        print(apart[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"\n{n_new} rows computed, {n_reused} reused from the store, in {seconds:.0f} s")
    if stale:
        print(
            f"note: {stale} of the {n_reused} reused rows were computed by different kvbench code (another "
            "code_fingerprint); rerun=true to recompute"
        )
    print(f"rows:    {out_dir / 'rows.parquet'}\nsummary: {out_dir / 'summary.csv'}\nstore:   {store.rows_dir}")
