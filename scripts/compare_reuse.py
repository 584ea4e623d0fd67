"""Compress once vs per question, paired per request, from two workload runs (their run directories, rows.parquet
files or stores): per configuration n, mean score with its 95 % interval, how many requests compress-once answered
better / worse, the partial score where the task has one, and the bytes held after the last paired request.

    python scripts/compare_reuse.py RUN_PER_QUESTION RUN_COMPRESS_ONCE     # prints a Markdown table per task
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from kvbench.report.sections.prefix import compare, prefix_cached
from kvbench.store.aggregate import with_variants
from kvbench.store.results import read_rows


def load(path: str, reuse: str) -> pd.DataFrame:
    """The prefix-cached rows of one reuse mode, `method` the variant label (as the report's rows)."""
    rows = read_rows(path)
    if "reuse" not in rows:
        sys.exit(f"compare_reuse: {path} holds no workload rows (no `reuse` column)")
    rows = prefix_cached(rows)  # a run without the prefix cache also writes reuse=per_question
    rows = rows[rows.reuse == reuse]
    return rows.assign(method=with_variants(rows)["variant"]).sort_values("request_index")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("per_question", help="rows of a run with prefix_cache=true reuse=per_question")
    parser.add_argument("compress_once", help="rows of the same workload with reuse=compress_once")
    args = parser.parse_args(argv)
    table = compare(load(args.per_question, "per_question"), load(args.compress_once, "compress_once"))
    if not len(table):
        sys.exit("compare_reuse: no request ran in both modes (same task, configuration and example_id)")
    for task, part in table.groupby("task", sort=False):
        part = part.drop(columns="task").loc[:, lambda t: (t != "").any()]
        print(f"\n{task}\n| " + " | ".join(part.columns) + " |\n|" + "---|" * len(part.columns))
        for r in part.itertuples(index=False):
            print("| " + " | ".join(map(str, r)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
