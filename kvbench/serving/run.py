"""One serving run: a trace (kvbench.serving.trace) through the scheduler for every configuration (the full cache
first, then `method`/`budget` or `grid.method × grid.budget`) at every `serving.kv_budget_bytes`; rows per request
and per run, with the planner's predictions beside the measured figures.

Writes `serving_requests.parquet` (one row per request × configuration × KV budget: kvbench.serving.metrics'
REQUEST_COLUMNS + the run's keys) and `serving_runs.parquet` (one row per configuration × KV budget: throughput,
percentiles, peak KV bytes, concurrency, goodput, predicted concurrency and tokens/s) into the output directory,
checked writable before the model loads. Both files are rewritten, atomically, as each run ends: a run stopped by a
signal or a full disk keeps every run that finished (`KEPT` says which, for the line that names them).
"""

from __future__ import annotations

import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

KEY_COLUMNS = [
    "run_id",
    "model",
    "task",
    "engine",
    "method",
    "budget",
    "kv_budget_bytes",
    "arrival",
    "rate",
    "dtype",
    "device_name",
]
KEPT: dict = {"started": False, "runs": 0, "out": None}  # what this process's serving run wrote so far (`kept()`)
PLAN_COLUMNS = ["predicted_max_concurrency", "predicted_tokens_s", "predicted_kv_bytes_per_request"]


def kept() -> str:
    """What a stopped serving run keeps, for its last line."""
    if not KEPT["runs"]:
        return "no run had finished, nothing was written"
    runs = Path(KEPT["out"]) / "serving_runs.parquet"
    return f"the {KEPT['runs']} runs that finished are kept in {runs} and serving_requests.parquet beside it"


def check_out(out_dir: Path) -> None:
    """The output folder can be created and written (before the model loads, not after every run is measured)."""
    from kvbench import KvbenchError
    from kvbench.store.results import fault_text

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as error:
        what, remedy = fault_text(error, out_dir)
        raise KvbenchError(
            f"the output folder cannot be written: {what}; {remedy}, or set serving.out=<a writable folder>"
        ) from None


def save(out_dir: Path, req_rows: list[dict], run_rows: list[dict]) -> None:
    """Rewrite both parquet files with every run so far, each atomically: a failed write keeps the previous ones."""
    from kvbench.serving import OutputFailed
    from kvbench.store.results import fault_text, write_atomic

    for name, rows in (("serving_requests.parquet", req_rows), ("serving_runs.parquet", run_rows)):
        try:
            write_atomic(out_dir / name, lambda tmp, rows=rows: pd.DataFrame(rows).to_parquet(tmp, index=False))
        except OSError as error:
            what, remedy = fault_text(error)
            raise OutputFailed(f"writing the serving rows failed: {what}; {kept()}; {remedy}, then rerun") from None
    KEPT.update(runs=len(run_rows), out=out_dir)


def build_requests(cfg, spec, lm):
    """The trace's requests and the task that scores them (None for random prompts)."""
    from kvbench.serving.trace import random_trace, task_trace

    trace_spec = spec.trace_spec(int(cfg.seed))
    if spec.prompts == "random":
        special = set(lm.tokenizer.all_special_ids)
        vocab = [i for i in range(len(lm.tokenizer)) if i not in special]
        return random_trace(trace_spec, vocab), None
    from kvbench.tasks import build_task

    task = build_task(cfg.task, lm.tokenizer, int(cfg.seed), lm.max_context)
    examples = task.examples()
    if cfg.get("limit"):
        examples = examples[: int(cfg.limit)]
    return task_trace(trace_spec, examples, bool(cfg.query_aware)), task


def serve(cfg, out_dir: Path | None = None, hardware=None, echo: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Check, load, run every configuration × KV budget; returns (request rows, run rows) and writes them to
    `out_dir` when given. `hardware`: the planner's Hardware (default: conf/hardware/<serving.hardware>.yaml).
    An engine that failed is named in `runs.attrs["skipped"]` (and in `skipped.txt` in `out_dir`)."""
    from omegaconf import OmegaConf

    from kvbench import conf_dir
    from kvbench.model.load import load_model
    from kvbench.native.engine import Engine
    from kvbench.plan.hardware import build_hardware
    from kvbench.plan.model import arch_of
    from kvbench.serving.inputs import check, check_requests
    from kvbench.serving.metrics import request_row, run_row
    from kvbench.serving.predict import predicted
    from kvbench.serving.scheduler import Scheduler
    from kvbench.store.aggregate import variant_label
    from kvbench.store.results import device_name

    spec, confs = check(cfg)  # every input, before the model loads
    KEPT.update(started=True, runs=0, out=None)
    if out_dir is not None:
        out_dir = Path(out_dir)
        check_out(out_dir)
    if hardware is None:
        path = Path(conf_dir()) / "hardware" / f"{spec.hardware}.yaml"
        if not path.is_file():
            from kvbench import KvbenchError

            raise KvbenchError(
                f"serving.hardware={spec.hardware}: no conf/hardware/{spec.hardware}.yaml; use cpu or h200"
            )
        hardware = build_hardware(OmegaConf.load(path))
    lm = load_model(cfg.model, cfg.device, cfg.dtype)
    if spec.request_bytes is None:  # the bundled model before its first conversion: its shape is known only now
        from kvbench.model.kv_bytes import KVShape

        spec = spec.resolved(cfg, KVShape.of(lm))
    requests, task = build_requests(cfg, spec, lm)
    check_requests(requests, lm, confs, spec.kv_budgets, spec.engines)
    arch = arch_of(cfg.model)
    engine = Engine(lm)
    engine.run(confs[0].method, None, requests[0].prompt_ids[:32], max_new_tokens=2)  # first-call costs, untimed
    run_id = f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    context = round(sum(r.prompt_tokens + r.max_new_tokens for r in requests) / len(requests))
    req_rows: list[dict] = []
    run_rows: list[dict] = []
    skipped: list[str] = []  # engines that failed, one line each (kvbench.serving.engines.serve_engines)

    def record(engine_name: str, method: str, budget: float, kv_budget: int, result, plan: dict, extra: dict) -> None:
        keys = {
            "run_id": run_id,
            "model": lm.name,
            "task": cfg.task.name if task is not None else "random",
            "engine": engine_name,
            "method": method,
            "budget": budget,
            "kv_budget_bytes": kv_budget,
            "arrival": spec.arrival,
            "rate": spec.rate if spec.arrival == "poisson" else float("nan"),
            "dtype": str(lm.dtype).removeprefix("torch."),
            "device_name": device_name(lm.device),
        }
        rows = []
        for s in result.served:
            text = engine.answer_text(s.emitted, s.request.stop)
            score = task.score(text, s.request.example)["score"] if task is not None else None
            rows.append(request_row(s, spec.slo_ttft_s, spec.slo_tpot_s, text, score))
        run = run_row(rows, result, spec.slo_ttft_s, spec.slo_tpot_s)
        req_rows.extend({**keys, **r} for r in rows)
        run_rows.append({**keys, **run, **plan, "hardware": hardware.name, **extra})
        if out_dir is not None:
            save(out_dir, req_rows, run_rows)
        if echo:
            print(
                f"[serving] {method} {budget:g} at {kv_budget / 1e6:.1f} MB: {run['throughput_tokens_s']:.1f} tok/s, "
                f"concurrency {run['max_concurrency']}, {run['preemptions']} preemptions, wall {result.wall_s:.1f} s",
                file=sys.stderr,
            )

    for c in confs:
        for kv_budget in spec.kv_budgets:
            result = Scheduler(engine, c.method, c.budget, kv_budget).run(requests)
            plan = predicted(arch, hardware, c.method, c.budget, lm.dtype, kv_budget, context, len(requests))
            label = variant_label(c.method.name, c.method.params())
            record("kvbench", label, c.budget_value, kv_budget, result, plan, {})
    if spec.engines:
        from kvbench.methods import build_method
        from kvbench.serving.engines import serve_engines

        def record_engine(name: str, option: str, budget: float, kv_budget: int, result, reply: dict) -> None:
            plan = (  # the planner knows the engines' uncompressed caches only (their own options: NaN)
                predicted(arch, hardware, build_method("full"), None, lm.dtype, kv_budget, context, len(requests))
                if option == "full"
                else dict.fromkeys(PLAN_COLUMNS, float("nan")) | {"predicted_context": context}
            )
            record(
                name, f"{name}:{option}", budget, kv_budget, result, plan, {"engine_version": reply["engine_version"]}
            )

        _, skipped = serve_engines((cfg, lm, engine), spec.engines, requests, spec.kv_budgets, confs, record_engine)
    requests_frame, runs_frame = pd.DataFrame(req_rows), pd.DataFrame(run_rows)
    runs_frame.attrs["skipped"] = skipped
    if out_dir is not None:
        (out_dir / "skipped.txt").unlink(missing_ok=True)
        if skipped:
            (out_dir / "skipped.txt").write_text("".join(f"{line}\n" for line in skipped))
    return requests_frame, runs_frame


def table(runs: pd.DataFrame) -> str:
    """The run rows as the printed table."""
    shown = pd.DataFrame(
        {
            "method": runs.method,
            "budget": runs.budget.map(lambda v: f"{v:.2f}"),
            "kv_MB": (runs.kv_budget_bytes / 1e6).map(lambda v: f"{v:.1f}"),
            "conc": runs.max_concurrency,
            "conc_plan": runs.predicted_max_concurrency,
            "tok/s": runs.throughput_tokens_s.map(lambda v: f"{v:.1f}"),
            "tok/s_plan": runs.predicted_tokens_s.map(lambda v: f"{v:,.0f}"),
            "req/s": runs.throughput_requests_s.map(lambda v: f"{v:.3f}"),
            "ttft_p50": runs.ttft_p50_s.map(lambda v: f"{v:.2f}"),
            "ttft_p99": runs.ttft_p99_s.map(lambda v: f"{v:.2f}"),
            "tpot_p50": runs.tpot_p50_s.map(lambda v: f"{v:.3f}"),
            "tpot_p99": runs.tpot_p99_s.map(lambda v: f"{v:.3f}"),
            "preempt": runs.preemptions,
            "peak_kv_MB": (runs.peak_kv_bytes / 1e6).map(lambda v: f"{v:.1f}"),
            "goodput": runs.goodput_requests_s.map(lambda v: f"{v:.3f}"),
            "score": runs.score.map(lambda v: f"{v:.2f}"),
        }
    )
    return shown.to_string(index=False)


def main(cfg, out_dir: Path) -> int:
    started = time.perf_counter()
    from kvbench.report.sections.serving import render

    _, runs = serve(cfg, out_dir)
    page = render(runs, Path(out_dir))  # the report's serving section, on its own page
    skipped = "".join(f"\n- {line}" for line in runs.attrs["skipped"])
    (Path(out_dir) / "serving.md").write_text(
        f"# Serving under a KV memory budget\n\n{page.markdown}\n" + (f"\nNot served:{skipped}\n" if skipped else "")
    )
    print(table(runs))
    for line in runs.attrs["skipped"]:
        print(f"not served: {line}")
    print(f"\n{len(runs)} runs in {time.perf_counter() - started:.0f} s (wall, model load included)")
    for name in ("serving_requests.parquet", "serving_runs.parquet", "serving.md", "serving.png"):
        print(f"{name}: {Path(out_dir) / name}")
    return 0
