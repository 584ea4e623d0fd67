"""`diagnose=true` inside a run: per example, one full-cache pass, one teacher-forced pass per configuration; row
columns + a verdict, and the per-(layer, KV head) side table `<run_id>.diagnose.parquet` next to the rows.

Side table columns: the row keys (`config_hash`, `example_id`, `run_id`, `model`, `task`, `subset`, `method`,
`budget`, `method_params`, `query_aware`) + `layer`, `kv_head`, `mass_recall`, `entropy_full`,
`entropy_compressed`, `evidence_retention`, `evidence_mass_full`, `evidence_mass_compressed`, `evicted_share`,
`evidence_kept` (one 0/1 per evidence token, kept by that head at the first decode step; "" without evidence).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd

from kvbench import KvbenchError
from kvbench.guide.diagnose import answer_text, compare, evidence_positions, teacher_forced
from kvbench.guide.verdict import Thresholds, verdict
from kvbench.model.attention import StatsRequest
from kvbench.store.results import write_rows

SIDE_SUFFIX = ".diagnose.parquet"  # kvbench.store.results.read_rows skips these: they are not result rows
KEYS = [
    "config_hash",
    "example_id",
    "run_id",
    "model",
    "task",
    "subset",
    "method",
    "budget",
    "method_params",
    "query_aware",
]


def thresholds_for(spec, task) -> Thresholds:
    """A run's verdict thresholds (`spec`: its kvbench.config.spec.RunSpec)."""
    if task.kind == "stream":
        raise KvbenchError(f"diagnose=true compares decoded answers; task {task.name} streams a text (no answer)")
    return Thresholds.from_config(spec.verdict)


def diagnose_example(
    engine,
    todo,
    ex,
    task,
    prefill,
    rows: list[dict],
    thresholds: Thresholds,
    reused: list | None = None,
    query_aware: bool | None = None,
) -> list[dict]:
    """Add the diagnostic columns and `verdict` to `rows` (one per configuration in `todo`, same order); returns
    the side-table records. `reused`: per configuration the (compression, cache) to decode from instead of compressing
    (compress once: its compressed context, kvbench.run.requests.reused_copy); `query_aware`: the split those rows
    used."""
    prompt_ids, suffix_ids = ex.split(todo[0].query_aware if query_aware is None else query_aware)
    reused = reused or [(None, None) for c in todo]
    if prefill is None:
        prefill = engine.prefill(prompt_ids, StatsRequest())
    full_method = next((c.method for c in todo if c.method.name == "full"), None)
    if full_method is None:
        from kvbench.methods import build_method

        full_method = build_method("full")
    full = teacher_forced(engine, prefill, full_method, None, suffix_ids, None, ex.max_new_tokens, ex.stop)
    full_score = task.score(answer_text(engine, full.token_ids, ex.stop), ex)["score"]
    evidence = evidence_positions(engine.lm.tokenizer, prompt_ids + list(suffix_ids), ex.evidence)
    records = []
    for c, (compression, cache), row in zip(todo, reused, rows):
        if c.method.name == "full":
            other = full
        else:
            shares = c.method.caps.shares_prefill
            own = engine if shares else engine.prepared(c.method)
            source = prefill if shares else own.prefill(prompt_ids, c.method.stats_request())
            if cache is not None:  # compressed once: decode from it
                source = replace(source, compressed=cache, compression=compression)
            other = teacher_forced(own, source, c.method, c.budget, suffix_ids, full.token_ids, ex.max_new_tokens)
        columns, per_head = compare(full, other, evidence, engine.full_kv_heads)
        row.update(
            columns,
            full_score=full_score,
            evidence_tokens=int(evidence.numel()),
            diagnose_s=other.seconds + full.seconds / len(todo),
        )
        row["verdict"] = verdict(row, full_score, thresholds)
        records += [{**{k: row[k] for k in KEYS}, **r} for r in per_head]
    return records


def side_table_path(rows_path: Path) -> Path:
    """`<dir>/<name>.diagnose.parquet` for the rows file `<dir>/<name>.parquet`."""
    return rows_path.with_name(rows_path.name.removesuffix(".parquet") + SIDE_SUFFIX)


def write_side_table(records: list[dict], rows_path: Path) -> None:
    if records:
        write_rows(pd.DataFrame(records), side_table_path(rows_path))


def copy_side_records(store_rows: Path, rows: pd.DataFrame, rows_path: Path) -> None:
    """The side table next to a run directory's rows: the store's records of those rows, reused ones included."""
    table = read_side_tables(store_rows)
    if len(table):
        keys = set(zip(rows["config_hash"], rows["example_id"]))
        mine = [k in keys for k in zip(table["config_hash"], table["example_id"])]
        write_side_table(table[mine].to_dict("records"), rows_path)


def read_side_tables(path: Path) -> pd.DataFrame:
    """Every side table under `path` (a file, a run directory or a store), newest row version per key."""
    path = Path(path)
    if path.is_file():
        files = [path] if path.name.endswith(SIDE_SUFFIX) else [side_table_path(path)]
    else:
        files = sorted(path.rglob(f"*{SIDE_SUFFIX}"))
    frames = [pd.read_parquet(f) for f in files if f.exists()]
    if not frames:
        return pd.DataFrame()
    table = pd.concat(frames, ignore_index=True)
    return table.drop_duplicates(["config_hash", "example_id", "layer", "kv_head"], keep="last")
