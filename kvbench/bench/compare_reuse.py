"""Compress once vs per question, paired per request, from two workload runs (their run directories, rows.parquet
files or stores): per configuration n, mean score with its 95 % interval, how many requests compress-once answered
better / worse, the partial score where the task has one, and the bytes held after the last paired request. Reads
rows only (no model).

    python -m kvbench.bench compare_reuse bench.per_question=RUN_PER_QUESTION bench.compress_once=RUN_COMPRESS_ONCE

`bench.per_question`: the rows of a run with prefix_cache=true reuse=per_question; `bench.compress_once`: the same
workload with reuse=compress_once. Prints a Markdown table per task.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench import KvbenchError
from kvbench.bench.common import tool_options

OPTIONS = {"per_question": None, "compress_once": None}


def load(path: str, reuse: str) -> pd.DataFrame:
    """The prefix-cached rows of one reuse mode, `method` the variant label (as the report's rows)."""
    from kvbench.report.sections.prefix import prefix_cached
    from kvbench.store.aggregate import with_variants
    from kvbench.store.results import read_rows

    rows = read_rows(Path(path))
    if "reuse" not in rows:
        raise KvbenchError(f"compare_reuse: {path} holds no workload rows (no `reuse` column)")
    rows = prefix_cached(rows)  # a run without the prefix cache also writes reuse=per_question
    rows = rows[rows.reuse == reuse]
    return rows.assign(method=with_variants(rows)["variant"]).sort_values("request_index")


def main(overrides: list[str]) -> int:
    from kvbench.report.sections.prefix import compare

    opts = tool_options(overrides, OPTIONS, "compare_reuse", required=("per_question", "compress_once"))
    table = compare(load(str(opts["per_question"]), "per_question"), load(str(opts["compress_once"]), "compress_once"))
    if not len(table):
        raise KvbenchError("compare_reuse: no request ran in both modes (same task, configuration and example_id)")
    for task, part in table.groupby("task", sort=False):
        part = part.drop(columns="task").loc[:, lambda t: (t != "").any()]
        print(f"\n{task}\n| " + " | ".join(part.columns) + " |\n|" + "---|" * len(part.columns))
        for r in part.itertuples(index=False):
            print("| " + " | ".join(map(str, r)) + " |")
    return 0
