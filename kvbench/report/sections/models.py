"""Report section: does a method ranking transfer from one model to another?

Shown when the rows hold one task on two or more models with the same compression configurations (method, budget,
query_aware) on the same examples (`example_id`): per model, each configuration's mean score and its rank (1 = best;
ties share the average rank), and per pair of models Spearman's rank correlation of the configurations' means with a
95 % percentile-bootstrap interval — examples resampled with replacement, the same resample for every configuration
and model, so the interval carries how much the ranking itself depends on which examples were drawn. The full cache is
left out of the ranking (it tops every model's list and would make any two rankings look alike).
"""

from __future__ import annotations

import html
import itertools
import math

import numpy as np
import pandas as pd

from kvbench.guide.selection import markdown
from kvbench.report.section import Context, Section, report_section
from kvbench.store.intervals import BOOTSTRAP_RESAMPLES, MIN_N, interval_text

CONFIG = ["method", "budget", "query_aware"]


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks along axis 0 (1 = lowest), ties sharing their average rank: x (C, ...) -> (C, ...)."""
    below = (x[None, :] < x[:, None]).sum(axis=1)  # (C, ...): how many are lower
    equal = (x[None, :] == x[:, None]).sum(axis=1)  # (C, ...): how many tie, itself included
    return below + (equal + 1) / 2


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray | float:
    """Spearman's rho of score vectors along axis 0 (average ranks for ties): a, b (C, ...) -> (...); NaN where
    either side has a single value."""
    ra, rb = average_ranks(np.asarray(a, float)), average_ranks(np.asarray(b, float))
    ra, rb = ra - ra.mean(axis=0), rb - rb.mean(axis=0)
    norm = np.sqrt((ra**2).sum(axis=0) * (rb**2).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = np.where(norm > 0, (ra * rb).sum(axis=0) / np.where(norm > 0, norm, 1), np.nan)
    return float(rho) if rho.ndim == 0 else rho


def score_cube(rows: pd.DataFrame) -> tuple[np.ndarray, list[str], list[tuple], list[str]]:
    """scores (M models, C configurations, E examples): the configurations every model ran, on the examples every
    (model, configuration) has; the models, configurations and example ids along each axis."""
    frame = rows[rows["method"] != "full"].assign(budget=rows["budget"].astype(float).round(4))
    frame = frame.assign(query_aware=frame["query_aware"].fillna(True).astype(bool))
    cells = frame.groupby(["model", *CONFIG, "example_id"], dropna=False)["score"].mean()  # reruns counted once
    wide = cells.unstack("example_id")  # (model × configuration, example)
    models = sorted(wide.index.get_level_values("model").unique())
    by_model = [{key[1:] for key in wide.index if key[0] == m} for m in models]
    configs = sorted(set.intersection(*by_model), key=str)  # configurations every model ran
    full_grid = pd.MultiIndex.from_tuples([(m, *c) for m in models for c in configs], names=wide.index.names)
    wide = wide.reindex(full_grid).dropna(axis=1)  # only examples every model × configuration has
    cube = wide.to_numpy().reshape(len(models), len(configs), wide.shape[1])
    return cube, models, configs, list(wide.columns)


def rank_transfer(rows: pd.DataFrame, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """(ranking table, correlation table) for one task's rows, or None where fewer than two models share at least two
    configurations on at least MIN_N examples."""
    if rows["model"].nunique() < 2:
        return None
    cube, models, configs, examples = score_cube(rows)
    if len(models) < 2 or len(configs) < 2 or len(examples) < MIN_N:
        return None
    means = cube.mean(axis=2)  # (M, C)
    ranking = pd.DataFrame({"configuration": [f"{m} {b:g}" + ("" if q else " (agnostic)") for m, b, q in configs]})
    for i, model in enumerate(models):
        ranks = average_ranks(-means[i])  # 1 = best
        ranking[model] = [f"{s:.3f} (#{r:g})" for s, r in zip(means[i], ranks)]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(examples), size=(BOOTSTRAP_RESAMPLES, len(examples)))  # (R, E)
    resampled = cube[:, :, picks].mean(axis=3)  # (M, C, R)
    pairs = []
    for i, j in itertools.combinations(range(len(models)), 2):
        rho = spearman(means[i], means[j])
        draws = np.asarray(spearman(resampled[i], resampled[j]))  # (R,)
        draws = draws[~np.isnan(draws)]
        low, high = np.quantile(draws, [0.025, 0.975]) if len(draws) else (math.nan, math.nan)
        if not math.isnan(rho):  # ties make rho's resamples run low: the interval always holds the estimate
            low, high = min(low, rho), max(high, rho)
        pairs.append(
            {
                "models": f"{models[i]} vs {models[j]}",
                "configurations": len(configs),
                "examples": len(examples),
                "spearman": "undefined (one model scores all alike)" if math.isnan(rho) else f"{rho:.2f}",
                "ci95": interval_text(low, high),
            }
        )
    return ranking, pd.DataFrame(pairs)


@report_section("Does the ranking transfer across models?", needs=["model", "example_id", "score"])
def model_ranking(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    parts_html, parts_md = [], []
    for task, task_rows in rows.groupby("task"):
        found = rank_transfer(task_rows)
        if found is None:
            continue
        ranking, pairs = found
        note = (
            f"{html.escape(str(task))}: mean score (rank) per model on the {pairs['examples'].iloc[0]} examples every "
            "model and configuration has; Spearman's rank correlation with a 95 % bootstrap interval over examples."
        )
        parts_html += [f"<p>{note}</p>", ranking.to_html(index=False), pairs.to_html(index=False)]
        parts_md += [note, markdown(ranking), markdown(pairs)]
    if not parts_html:
        return None
    return Section(html="\n".join(parts_html), markdown="\n\n".join(parts_md))
