"""The report's opening lines per task, in plain text with the numbers: how the full cache scores, each method's
knee, the best method at each budget, and what ran on only part of the examples (never ranked)."""

from __future__ import annotations

import math

import pandas as pd

from kvbench.store.aggregate import FULL
from kvbench.store.intervals import MIN_N, interval_text


def _score(row) -> str:
    text = interval_text(row["ci_low"], row["ci_high"], short=False)
    return f"{row['score']:.3f} " + (f"({text})" if math.isnan(row["ci_low"]) else f"[{text}]")


def _overlap(a, b) -> bool:
    if any(math.isnan(v) for v in (a["ci_low"], b["ci_low"])):
        return True  # no interval: a difference cannot be told from noise
    return a["ci_low"] <= b["ci_high"] and b["ci_low"] <= a["ci_high"]


def _loss(row) -> str:
    """How much worse than the full cache, in words that fit the metric's direction."""
    if row["lower_is_better"]:
        return f"{-row['drop_vs_full']:+.3f} over full"
    return f"drop {row['drop_vs_full']:+.3f}"


def _ranked(points: pd.DataFrame) -> pd.DataFrame:
    """Best first: score (direction-aware), then the smaller measured cache."""
    lower = bool(points["lower_is_better"].all())
    return points.assign(_key=points["score"] * (1 if lower else -1)).sort_values(["_key", "kv_ratio", "method"])


def knee_line(knee: pd.DataFrame, points: pd.DataFrame, tolerance: float) -> str:
    found, missing = [], []
    for _, k in knee.iterrows():
        if math.isnan(k["knee_budget"]):
            best = _ranked(points[points["method"] == k["method"]]).iloc[0]
            missing.append((best["score"], f"{k['method']} (best {best['score']:.3f}, {_loss(best)})"))
        else:
            where = f"budget {k['knee_budget']:g}, " if k["budgets"] != "1" else ""
            found.append((k["kv_ratio"], f"{k['method']} ({where}kv_ratio {k['kv_ratio']:.2f})"))
    text = f"Knees (smallest budget within {tolerance:g} of full), smallest cache first: "
    text += "; ".join(t for _, t in sorted(found)) + "." if found else "none at any budget tested."
    lower = bool(points["lower_is_better"].all())
    if missing:
        text += (
            f" Never within {tolerance:g}: "
            + "; ".join(t for _, t in sorted(missing, key=lambda m: m[0], reverse=not lower))
            + "."
        )
    return text


def budget_lines(points: pd.DataFrame) -> list[str]:
    lines = []
    only_one = points["budget"].nunique() == 1
    for budget, group in points[points["method"] != FULL].groupby("budget", sort=True):
        ranked = _ranked(group)
        best = ranked.iloc[0]
        ties = ranked[ranked["score"] == best["score"]]
        names = ", ".join(f"{r['method']} (kv_ratio {r['kv_ratio']:.2f})" for _, r in ties.iterrows())
        label = "Without eviction (budget 1)" if budget == 1 and not only_one else f"Budget {budget:g}"
        text = f"{label}: best {_score(best)} — {names}"
        rest = ranked.iloc[len(ties) :]
        if len(rest):
            runner_up = rest.iloc[0]
            text += f"; next {runner_up['method']} {_score(runner_up)}"
            if _overlap(best, runner_up):
                text += ", intervals overlap"
        lines.append(text + ".")
    return lines


def takeaways(
    summary: pd.DataFrame, knee: pd.DataFrame, tolerance: float, level: str, model, task, length, query_aware
) -> list[str]:
    """Plain-text lines for one scope of the summary (level task or overall; one context length)."""

    def scope(table):
        return table[
            (table["level"] == level)
            & (table["model"] == model)
            & (table["task"] == task)
            & (table["length"] == length)
            & (table["query_aware"] == query_aware)
        ]

    part = scope(summary)
    points, apart = part[part["compared"]], part[~part["compared"]]
    if points.empty:
        return []
    n = int(points["n"].max())
    direction = "lower is better" if points["lower_is_better"].all() else "higher is better"
    tasks = points["tasks"].iloc[0]
    lines = [f"{len(points)} configurations compared on the same {n} examples ({tasks}; {direction})."]
    full = points[points["method"] == FULL]
    if len(full):
        lines[0] = lines[0][:-1] + f"; the full cache scores {_score(full.iloc[0])}."
        lines.append(knee_line(scope(knee), points, tolerance))
    else:
        lines.append("No full-cache rows on these examples: no drop vs full and no knees.")
    lines += budget_lines(points)
    if len(apart) > 4:
        covered = " / ".join(sorted(apart["tasks"].unique()))
        lines.append(
            f"Not ranked: {len(apart)} configurations ran on only part of the examples ({covered}; "
            f"{apart['n'].min()}–{apart['n'].max()} examples each); they are listed apart in the tables."
        )
    elif len(apart):
        lines.append(
            "Not ranked (ran on only part of the examples): "
            + "; ".join(
                f"{r['method']} budget {r['budget']:g}: {r['score']:.3f} on {r['n']} examples of {r['tasks']}"
                for _, r in apart.iterrows()
            )
            + "."
        )
    if (points["n"] < MIN_N).any():
        lines.append(f"Fewer than {MIN_N} examples: no interval, greyed in plots and tables.")
    return lines
