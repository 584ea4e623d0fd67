"""The report's PNGs (matplotlib, Agg): quality vs measured kv_ratio, length × depth heatmaps, memory and
latency vs kv_ratio, Pareto frontiers with knees, streamed perplexity. Every function writes one file and returns
its path. Only configurations compared on the same examples are drawn (summary column `compared`); points from
fewer than MIN_N examples are grey and hollow, without an interval. Which extra plots a task gets comes from its
declared facts (kvbench/tasks/facts.py)."""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers/CI; must precede pyplot
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from kvbench.store.aggregate import ALL, FULL
from kvbench.store.intervals import MIN_N
from kvbench.tasks.facts import task_facts

# Fixed colours for the known methods, so a method looks the same in every plot and every report; other names
# get the remaining colours in sorted order.
KNOWN_COLOURS = {
    "full": "#000000",
    "streamingllm": "#1f77b4",
    "snapkv": "#ff7f0e",
    "h2o": "#2ca02c",
    "pyramidkv": "#d62728",
    "random": "#7f7f7f",
    "kivi": "#9467bd",
    "headmerge": "#8c564b",
}
SPARE_COLOURS = [
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
]
MiB = 2**20


def method_colours(methods) -> dict[str, str]:
    colours = dict(KNOWN_COLOURS)
    others = sorted(m for m in set(methods) if m not in colours)
    for i, name in enumerate(others):
        colours[name] = SPARE_COLOURS[i % len(SPARE_COLOURS)]
    return colours


SLUG_MAX = 120  # characters: a file name stays well under the file system's 255 bytes once prefixed and suffixed


def slug(*parts) -> str:
    """A file-name part from labels; a long one (a kvpress press with every nested field) is cut and given a hash of
    the whole, so two long labels never share a file."""
    name = "_".join(re.sub(r"[^A-Za-z0-9.-]+", "-", str(p)).strip("-") for p in parts if p not in (None, ""))
    if len(name) <= SLUG_MAX:
        return name
    return f"{name[: SLUG_MAX - 13]}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def _curves(points: pd.DataFrame):
    """(label, method, linestyle, curve sorted by kv_ratio) per method and query_aware setting of a scope."""
    both_settings = points["query_aware"].nunique() > 1
    for (method, query_aware), curve in points.groupby(["method", "query_aware"], sort=True):
        label = f"{method} ({'query-aware' if query_aware else 'context-only'})" if both_settings else method
        yield label, method, "-" if query_aware else "--", curve.sort_values("kv_ratio")


@dataclass
class Plot:
    model: str
    task: str  # ALL: the overall plots
    kind: str  # quality | pareto | costs | heatmap | stream
    path: Path
    length: int | None = None  # the context length it shows; None: every length (heatmaps, streams)


def _save(fig, path: Path) -> Path:
    """PNG with a 256-colour palette: a third of the bytes of RGBA, the same look (the HTML embeds every plot)."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=100, bbox_inches="tight", format="png")
    plt.close(fig)
    buffer.seek(0)
    Image.open(buffer).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path


def _title(model: str, task: str, several_models: bool, length: int = 0) -> str:
    scope = ("all tasks" if task == ALL else f"task {task}") + (f" at {length:,} tokens" if length else "")
    return f"{scope} — {model}" if several_models else scope


def _kv_ratio_axes(ax, points: pd.DataFrame, ylabel: str, title: str) -> None:
    """Score against measured kv_ratio (quality and Pareto plots): labels, axes, grid, legend outside the plot."""
    ax.set_xlabel("KV cache held, fraction of the full cache (measured kv_ratio)")
    ax.set_ylabel(ylabel)
    _score_axis(ax, points)
    ax.set_xlim(0, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))


def _score_axis(ax, points: pd.DataFrame) -> None:
    """Scores in [0, 1] on the whole [0, 1] axis: a zoomed axis makes a 0.67 look like a collapse."""
    if not points["lower_is_better"].any() and points["score"].between(0, 1).all():
        ax.set_ylim(-0.03, 1.05)


def plot_quality(points: pd.DataFrame, path: Path, title: str, metric: str, colours: dict) -> Path:
    """Mean score (95 % CI bars) vs measured kv_ratio, one line per method, the full cache as a reference line."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    few_any = False
    for label, method, style, curve in _curves(points):
        if method == FULL:
            for _, row in curve.iterrows():
                ax.axhline(
                    row["score"],
                    color=colours[FULL],
                    linestyle=":" if style == "-" else "-.",
                    lw=1,
                    label=f"{label} (score {row['score']:.3f})",
                )
                if row["n"] >= MIN_N:
                    ax.axhspan(row["ci_low"], row["ci_high"], color=colours[FULL], alpha=0.06, lw=0)
            continue
        ax.plot(curve["kv_ratio"], curve["score"], color=colours[method], linestyle=style, label=label)
        enough = curve[curve["n"] >= MIN_N]
        err = np.vstack([enough["score"] - enough["ci_low"], enough["ci_high"] - enough["score"]])
        ax.errorbar(
            enough["kv_ratio"],
            enough["score"],
            yerr=np.nan_to_num(err),
            color=colours[method],
            linestyle="none",
            marker="o",
            capsize=3,
        )
        few = curve[curve["n"] < MIN_N]
        ax.scatter(few["kv_ratio"], few["score"], facecolor="none", edgecolor="0.6", zorder=3)
        few_any = few_any or len(few) > 0
    if few_any:
        ax.scatter([], [], facecolor="none", edgecolor="0.6", label=f"n < {MIN_N}: no interval")
    _kv_ratio_axes(ax, points, f"mean score ({metric}), 95 % interval", f"Quality vs KV cache size: {title}")
    return _save(fig, path)


def plot_costs(points: pd.DataFrame, path: Path, title: str, colours: dict) -> Path:
    """2×2: cache bytes, peak memory, prefill time, decode time per token, each vs measured kv_ratio."""
    panels = [
        ("kv_bytes", MiB, "KV cache held (MiB)"),
        ("peak_mem_bytes", MiB, "peak memory (MiB)"),
        ("prefill_s", 1, "prefill incl. compression (s)"),
        ("decode_ms_per_token", 1, "decode (ms / token)"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(7.5, 5.6))
    for ax, (column, scale, ylabel) in zip(axes.flat, panels):
        for label, method, style, curve in _curves(points):
            ax.plot(
                curve["kv_ratio"],
                curve[column] / scale,
                color=colours[method],
                linestyle=style,
                marker="o",
                label=label,
            )
        ax.set_xlabel("measured kv_ratio (fraction of full cache)")
        ax.set_ylabel(ylabel)
        ax.set_xlim(0, 1.05)
        top = max((points[column] / scale).max(), 0)
        ax.set_ylim(0, top * 1.12 if top > 0 else 1)  # from zero: the eye reads ratios between methods
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.suptitle(f"Memory and latency vs KV cache size: {title}")
    fig.tight_layout()
    fig.legend(handles, labels, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))  # off the data
    return _save(fig, path)


def plot_pareto(
    points: pd.DataFrame,
    frontier: pd.DataFrame,
    knee_points: pd.DataFrame,
    path: Path,
    title: str,
    metric: str,
    tolerance: float,
    colours: dict,
) -> Path:
    """Every (method, budget) point; the frontier (smaller kv_ratio, higher score) as a step line; knees starred."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, method, _, curve in _curves(points):
        ax.scatter(curve["kv_ratio"], curve["score"], color=colours[method], label=label, zorder=3)
        for _, row in curve.iterrows():
            ax.annotate(
                f"{row['budget']:g}",
                (row["kv_ratio"], row["score"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color=colours[method],
            )
    if len(frontier):
        ax.step(
            frontier["kv_ratio"],
            frontier["score"],
            where="post",
            color="0.3",
            lw=1.2,
            zorder=2,
            label="Pareto frontier",
        )
    if len(knee_points):
        ax.scatter(
            knee_points["kv_ratio"],
            knee_points["score"],
            marker="*",
            s=260,
            facecolor="none",
            edgecolor="black",
            lw=1.2,
            zorder=4,
            label=f"knee (within {tolerance:g} of full)",
        )
    _kv_ratio_axes(ax, points, f"mean score ({metric})", f"Pareto frontier: {title}  (labels: budget)")
    return _save(fig, path)


def plot_niah_heatmaps(rows: pd.DataFrame, path: Path, title: str) -> Path:
    """One panel per budget: mean score per (context length, depth), red (0) → yellow → green (1), as in the
    original needle test; a second row shows the partial-match score when the rows carry it."""
    budgets = sorted(rows["budget"].unique())
    metrics = ["score"] + (["score_partial"] if "score_partial" in rows and rows["score_partial"].notna().any() else [])
    fig, axes = plt.subplots(
        len(metrics),
        len(budgets),
        figsize=(1.2 + 3.6 * len(budgets), 3.2 * len(metrics)),
        squeeze=False,
        layout="constrained",
    )
    for r, metric in enumerate(metrics):
        for c, budget in enumerate(budgets):
            ax = axes[r][c]
            ax.set_facecolor("0.85")  # grey: a (length, depth) cell this budget did not run
            grid = rows[rows["budget"] == budget].pivot_table(
                index="depth", columns="length_target", values=metric, aggfunc="mean"
            )
            image = ax.imshow(grid.to_numpy(dtype=float), cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            for (i, j), value in np.ndenumerate(grid.to_numpy(dtype=float)):
                if not np.isnan(value):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(grid.columns)), [f"{int(v)}" for v in grid.columns])
            ax.set_yticks(range(len(grid.index)), [f"{100 * v:.0f}" for v in grid.index])
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("needle depth (% of context)")
            ax.set_title(f"budget {budget:g}: {'partial match' if metric == 'score_partial' else 'score'}", fontsize=9)
    fig.colorbar(image, ax=axes.ravel().tolist(), label="mean score (0 = miss, 1 = exact)", shrink=0.8)
    fig.suptitle(f"Needle in a haystack: {title}")
    return _save(fig, path)


def plot_all(
    rows: pd.DataFrame,
    summary: pd.DataFrame,
    knee_table: pd.DataFrame,
    frontier: pd.DataFrame,
    out_dir: Path,
    tolerance: float,
) -> list[Plot]:
    """Every plot of the report: per task (pooled over subsets) and, with several tasks, overall."""
    colours = method_colours(rows["method"])
    several_models = rows["model"].nunique() > 1
    compared = summary[summary["compared"]]
    written = []
    scopes = compared[compared["level"].isin(["task", "overall"])]
    lengths = scopes.groupby(["level", "model", "task"])["length"].nunique()
    for (level, model, task, length), points in scopes.groupby(["level", "model", "task", "length"], sort=True):
        title = _title(model, task, several_models, length)
        several_lengths = lengths[(level, model, task)] > 1  # a file per length; one length keeps the plain name
        name = slug(
            model if several_models else "", "overall" if task == ALL else task, f"{length}" if several_lengths else ""
        )
        in_scope = rows if task == ALL else rows[rows["task"] == task]
        metric = ", ".join(sorted(in_scope[in_scope["model"] == model]["metric"].astype(str).unique()))
        metric += "; lower is better" if points["lower_is_better"].all() else ""

        def scope(table, level=level, model=model, task=task, length=length):
            return table[
                (table["level"] == level)
                & (table["model"] == model)
                & (table["task"] == task)
                & (table["length"] == length)
            ]

        knee_points = scope(knee_table).dropna(subset=["knee_budget"])
        quality = plot_quality(points, out_dir / f"quality_{name}.png", title, metric, colours)
        written.append(Plot(model, task, "quality", quality, length))
        pareto = plot_pareto(
            points, scope(frontier), knee_points, out_dir / f"pareto_{name}.png", title, metric, tolerance, colours
        )
        written.append(Plot(model, task, "pareto", pareto, length))
        if level == "task":
            costs = plot_costs(points, out_dir / f"costs_{name}.png", title, colours)
            written.append(Plot(model, task, "costs", costs, length))
    plots = {task: task_facts(task).plots for task in rows["task"].unique()}
    written += _niah_plots(rows[rows["task"].map(lambda t: "heatmap" in plots[t])], out_dir, several_models)
    written += _stream_plots(rows[rows["task"].map(lambda t: "stream" in plots[t])], out_dir, several_models, colours)
    return written


def _stream_plots(rows: pd.DataFrame, out_dir: Path, several_models: bool, colours: dict) -> list[Plot]:
    """Streamed perplexity (task ppl): the curve over tokens seen, per configuration (window and cumulative)."""
    if rows.empty or "perplexity_so_far" not in rows:
        return []
    written = []
    streams = rows.dropna(subset=["perplexity_so_far"])
    for (model, task, subset), group in streams.groupby(["model", "task", "subset"], sort=True):
        fig, (ax_window, ax_total) = plt.subplots(1, 2, figsize=(11, 4))
        for (method, budget), curve in group.groupby(["method", "budget"], sort=True):
            curve = curve.sort_values("context_tokens")
            label = method if method == FULL else f"{method} (budget {budget:g})"
            style = ":" if method == FULL else "-"
            ax_window.plot(curve["context_tokens"], curve["score"], style, color=colours[method], label=label)
            ax_total.plot(
                curve["context_tokens"], curve["perplexity_so_far"], style, color=colours[method], label=label
            )
        for ax, ylabel in ((ax_window, "perplexity of the window"), (ax_total, "perplexity of the text so far")):
            ax.set_xlabel("tokens streamed")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        ax_total.legend(fontsize=8)
        fig.suptitle(f"Streamed perplexity with a bounded cache: {_title(model, f'{task} ({subset})', several_models)}")
        fig.tight_layout()
        path = out_dir / f"stream_{slug(model if several_models else '', task, subset)}.png"
        written.append(Plot(model, task, "stream", _save(fig, path)))
    return written


def _niah_plots(rows: pd.DataFrame, out_dir: Path, several_models: bool) -> list[Plot]:
    if rows.empty or "depth" not in rows or "length_target" not in rows:
        return []
    grid_rows = rows.dropna(subset=["depth", "length_target"])
    written = []
    several_settings = grid_rows["query_aware"].nunique() > 1
    for (model, task, method, query_aware), group in grid_rows.groupby(
        ["model", "task", "method", "query_aware"], sort=True
    ):
        setting = ("query-aware" if query_aware else "context-only") if several_settings else ""
        title = ", ".join(p for p in [f"{task} · {method}", model if several_models else "", setting] if p)
        name = slug(model if several_models else "", task, method, setting)
        written.append(Plot(model, task, "heatmap", plot_niah_heatmaps(group, out_dir / f"heatmap_{name}.png", title)))
    return written
