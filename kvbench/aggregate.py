"""Pure aggregation of result rows: loading + schema check, means with confidence intervals, drop vs the
full cache on matched examples, knees and Pareto frontiers. Shared by `kvbench.report` and `kvbench.check`.

Levels of the summary (column `level`):
- "subset":  one row per (model, task, subset, method, budget, query_aware);
- "task":    pooled over the task's subsets (subset = ALL);
- "overall": pooled over every task (task = subset = ALL).
Pooling is over examples (a micro average), so the confidence interval stays a plain Student-t interval on the
per-example scores.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from kvbench import KvbenchError
from kvbench.results import COLUMNS, SCHEMA_VERSION, read_rows

GROUP_KEYS = ["model", "task", "subset", "method", "budget", "query_aware"]
# an example of a method is compared with the full cache's result on the same example in the same setting
MATCH_KEYS = ["model", "task", "subset", "query_aware", "example_id"]
SCOPE_KEYS = ["level", "model", "task", "subset", "query_aware"]  # one curve per method inside a scope
ALL = "(all)"
LOWER_IS_BETTER = {"perplexity"}  # metrics where a smaller score is better: signs flip, never pooled with others
FULL = "full"


# ----------------------------------------------------------------------------------------------- loading


def load_rows(paths: Iterable[str | Path]) -> pd.DataFrame:
    """Rows from files, run directories or stores; one row per (config_hash, example_id), the newest wins."""
    frames = []
    for path in map(Path, paths):
        if not path.exists():
            raise KvbenchError(f"{path}: no such file or directory")
        try:
            frame = read_rows(path)
        except Exception as error:  # pyarrow/pandas raise many types for a non-Parquet or damaged file
            raise KvbenchError(f"{path}: cannot read result rows ({error})") from None
        if len(frame):
            frames.append(frame)
    if not frames:
        raise KvbenchError(f"no result rows under {', '.join(map(str, paths))} (run `python -m kvbench` first)")
    rows = pd.concat(frames, ignore_index=True)
    validate(rows)
    newest_first = pd.to_datetime(rows["timestamp"], utc=True, errors="coerce").sort_values(
        ascending=False, kind="stable").index
    rows = rows.loc[newest_first].drop_duplicates(["config_hash", "example_id"])
    return rows.reset_index(drop=True)


def validate(rows: pd.DataFrame) -> None:
    missing = [c for c in COLUMNS if c not in rows.columns]
    if missing:
        raise KvbenchError(f"incompatible result rows: missing columns {', '.join(missing)}")
    if "schema_version" not in rows.columns:
        raise KvbenchError(f"incompatible result rows: no schema_version column (this kvbench reads "
                           f"schema_version {SCHEMA_VERSION})")
    versions = set(rows["schema_version"].astype(object).where(rows["schema_version"].notna(), None))
    if versions != {SCHEMA_VERSION}:
        found = ", ".join(sorted(map(str, versions)))
        raise KvbenchError(f"incompatible result rows: schema_version {found}, this kvbench reads "
                           f"schema_version {SCHEMA_VERSION}")


# ------------------------------------------------------------------------------------------- statistics


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz, Numerical Recipes 6.4)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side; use symmetry on the other
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: float) -> float:
    """Student-t quantile by bisection on the exact CDF (scipy is not a dependency)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def mean_ci(scores, confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): mean ± t_{(1+c)/2, n-1}·s/√n; the point itself for n = 1; NaNs for n = 0."""
    x = np.asarray(scores, dtype=float)
    x = x[~np.isnan(x)]
    if len(x) == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if len(x) == 1:
        return mean, mean, mean
    half = t_quantile((1.0 + confidence) / 2.0, len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return mean, mean - half, mean + half


# ------------------------------------------------------------------------------------------- summaries


def with_full_scores(rows: pd.DataFrame) -> pd.DataFrame:
    """Adds `full_score`: the full cache's score on the same example in the same setting (NaN if none ran)."""
    # match on the keys' text: a merge on the columns fails when an all-missing column (e.g. no subsets) reads
    # back as object in one frame and float in another, and None/NaN keys must still match each other
    keys = pd.Series(["\x1f".join("" if pd.isna(v) else str(v) for v in key)
                      for key in rows[MATCH_KEYS].itertuples(index=False)], index=rows.index, dtype=object)
    full = rows["score"].where(rows["method"] == FULL).groupby(keys).mean()  # mean skips the non-full NaNs
    return rows.assign(full_score=keys.map(full).to_numpy())


def drop_vs_full(rows: pd.DataFrame) -> tuple[float, int]:
    """(mean full score − mean score, number of examples) over the rows' examples that the full cache also ran."""
    if "full_score" not in rows:
        raise ValueError("call with_full_scores first")
    matched = rows[rows["full_score"].notna() & rows["score"].notna()]
    if matched.empty:
        return math.nan, 0
    return float((matched["full_score"] - matched["score"]).mean()), len(matched)


def _aggregate(rows: pd.DataFrame, level: str, confidence: float) -> list[dict]:
    out = []
    for key, group in rows.groupby(GROUP_KEYS, dropna=False, sort=True):
        mean, low, high = mean_ci(group["score"], confidence)
        drop, n_matched = drop_vs_full(group)
        record = dict(level=level, **dict(zip(GROUP_KEYS, key)), n=int(group["score"].notna().sum()),
                      score=mean, ci_low=low, ci_high=high,
                      lower_is_better=bool(group["metric"].isin(LOWER_IS_BETTER).all()))
        if "score_partial" in group:
            record["score_partial"] = group["score_partial"].mean()
        record.update(
            drop_vs_full=drop, n_matched=n_matched, kv_ratio=group["kv_ratio"].mean(),
            kv_bytes=group["kv_bytes"].mean(), peak_mem_bytes=group["peak_mem_bytes"].max(),
            prefill_s=group["prefill_s"].mean(), decode_ms_per_token=group["decode_ms_per_token"].mean())
        out.append(record)
    return out


def summarize(rows: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Per subset, per task and overall; see the module docstring for the levels."""
    rows = with_full_scores(rows)
    per_task = rows.assign(subset=ALL)
    overall = per_task[~per_task["metric"].isin(LOWER_IS_BETTER)].assign(task=ALL)  # scores, not perplexities
    records = (_aggregate(rows, "subset", confidence) + _aggregate(per_task, "task", confidence)
               + _aggregate(overall, "overall", confidence))
    return pd.DataFrame.from_records(records)


def knees(summary: pd.DataFrame, tolerance: float = 0.02) -> pd.DataFrame:
    """Per scope and method: the smallest budget whose mean score is within `tolerance` (absolute) of the full
    cache on the same examples; NaN where no budget is. The full cache itself is left out."""
    records = []
    for key, curve in summary[summary["method"] != FULL].groupby(SCOPE_KEYS + ["method"], dropna=False, sort=True):
        curve = curve.sort_values("budget")
        sign = -1.0 if curve["lower_is_better"].all() else 1.0  # perplexity: a loss is a *rise* over full
        good = curve[sign * curve["drop_vs_full"] <= tolerance + 1e-12]
        knee = good.iloc[0] if len(good) else None
        records.append(dict(
            zip(SCOPE_KEYS + ["method"], key), budgets=", ".join(f"{b:g}" for b in curve["budget"]),
            knee_budget=knee["budget"] if knee is not None else math.nan,
            kv_ratio=knee["kv_ratio"] if knee is not None else math.nan,
            score=knee["score"] if knee is not None else math.nan,
            drop_vs_full=knee["drop_vs_full"] if knee is not None else math.nan))
    return pd.DataFrame.from_records(records, columns=SCOPE_KEYS + [
        "method", "budgets", "knee_budget", "kv_ratio", "score", "drop_vs_full"])


def pareto(summary: pd.DataFrame) -> pd.DataFrame:
    """The (method, budget) points of each scope that no other point beats on both smaller kv_ratio and higher
    score (at least as good on both and better on one); sorted by kv_ratio."""
    frontier = []
    for _, points in summary.groupby(SCOPE_KEYS, dropna=False, sort=True):
        points = points.dropna(subset=["kv_ratio", "score"])
        sign = -1.0 if points["lower_is_better"].all() else 1.0
        x, y = points["kv_ratio"].to_numpy(), sign * points["score"].to_numpy()
        dominated = [bool(np.any((x <= xi) & (y >= yi) & ((x < xi) | (y > yi)))) for xi, yi in zip(x, y)]
        frontier.append(points[~np.array(dominated, dtype=bool)].sort_values(["kv_ratio", "score"]))
    if not frontier:
        return summary.iloc[0:0]
    return pd.concat(frontier, ignore_index=True)
