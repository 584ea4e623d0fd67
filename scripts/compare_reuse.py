"""Compress once vs per question, paired per request, from two workload runs (their run directories, rows.parquet
files or stores): per configuration n, mean score with its 95 % interval, how many requests compress-once answered
better / worse, the partial score where the task has one, and the bytes held after the last paired request.

    python scripts/compare_reuse.py RUN_PER_QUESTION RUN_COMPRESS_ONCE     # prints a Markdown table per task
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from kvbench.aggregate import with_variants
from kvbench.intervals import mean_interval
from kvbench.results import read_rows


def load(path: str, reuse: str) -> pd.DataFrame:
    rows = read_rows(path)
    if "reuse" not in rows:
        sys.exit(f"compare_reuse: {path} holds no workload rows (no `reuse` column)")
    return with_variants(rows[rows.reuse == reuse]).sort_values("request_index")


def compare(per_question: pd.DataFrame, once: pd.DataFrame) -> pd.DataFrame:
    out = []
    for (task, variant, budget), a in per_question.groupby(["task", "variant", "budget"], sort=False):
        b = once[(once.task == task) & (once.variant == variant) & (once.budget == budget)]
        pair = a.merge(b, on="example_id", suffixes=("_pq", "_once"))
        if not len(pair):
            continue
        m1, lo1, hi1, _ = mean_interval(pair.score_pq.to_numpy())
        m2, lo2, hi2, _ = mean_interval(pair.score_once.to_numpy())
        last = pair.sort_values("request_index_pq").iloc[-1]  # held after the last paired request
        row = {
            "task": task,
            "method": variant,
            "budget": "–" if variant.startswith("kivi") or variant == "full" else f"{budget:g}",
            "n": len(pair),
            "score per q.": f"{m1:.3f} ({lo1:.2f}–{hi1:.2f})",
            "score once": f"{m2:.3f} ({lo2:.2f}–{hi2:.2f})",
            "once better/worse": f"{(pair.score_once > pair.score_pq).sum()}/{(pair.score_once < pair.score_pq).sum()}",
            "partial per q. / once": (
                f"{pair.score_partial_pq.mean():.3f} / {pair.score_partial_once.mean():.3f}"
                if "score_partial_pq" in pair and pair.score_partial_pq.notna().any()
                else ""
            ),
            "held MB per q. / once": f"{last.held_bytes_pq / 1e6:.1f} / {last.held_bytes_once / 1e6:.1f}",
        }
        out.append(row)
    return pd.DataFrame(out)


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
