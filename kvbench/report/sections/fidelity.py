"""Report section: task score against fidelity (KL divergence from the full cache along its answer).

Per model and task, each configuration's mean score against the mean of its rows' `kl_mean` (kvbench.native.fidelity:
KL(full ‖ compressed) per answer token, nats, teacher-forced along the full cache's answer), with a bar out to the
95th percentile over examples (the tail a mean hides, what the gate's `max_kl_p95` bounds), and a table with top-1
agreement, the mean of each answer's worst step and the generated length relative to the full cache's. Two
configurations with the same score can sit far apart here: the score saw one answer, the KL every step of it. Rows
whose values are impossible (KL < 0, top-1 agreement outside [0, 1]; kvbench.store.aggregate.fidelity_invalid) are
listed apart, never averaged.
"""

from __future__ import annotations

import html

import matplotlib

matplotlib.use("Agg")  # no display on servers/CI; must precede pyplot
import matplotlib.pyplot as plt
import pandas as pd

from kvbench.guide.selection import markdown
from kvbench.report.plots import _save, method_colours, slug
from kvbench.report.section import Context, Section, report_section
from kvbench.store.aggregate import fidelity_invalid

CONFIG = ["method", "budget", "query_aware"]


def fidelity_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per configuration of one (model, task): rows with KL only, less those whose fidelity values are
    impossible (`fidelity_invalid`: shown apart by `impossible_table`); sorted by mean KL."""
    rows = rows[rows["kl_mean"].notna() & (fidelity_invalid(rows) == "")]
    rows = rows.assign(budget=rows["budget"].astype(float).round(4))
    rows = rows.assign(query_aware=rows["query_aware"].fillna(True).astype(bool))
    length = rows["length_vs_full"] if "length_vs_full" in rows else pd.Series(float("nan"), index=rows.index)
    grouped = rows.assign(length_vs_full=length).groupby(CONFIG, sort=True)
    table = grouped.agg(
        n=("kl_mean", "size"),
        score=("score", "mean"),
        kl_mean=("kl_mean", "mean"),
        kl_p95=("kl_mean", lambda x: x.quantile(0.95)),
        kl_max=("kl_max", "mean"),
        top1_agreement=("top1_agreement", "mean"),
        length_vs_full=("length_vs_full", "mean"),
    ).reset_index()
    return table.sort_values(["kl_mean", "method", "budget"]).reset_index(drop=True)


def impossible_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows whose fidelity values lie outside their domain (KL < 0, top-1 agreement outside [0, 1]): a broken
    measurement, listed with the reason and never averaged."""
    reason = fidelity_invalid(rows)
    bad = rows[reason != ""].assign(problem=reason[reason != ""])
    return bad[["method", "budget", "example_id", "problem"]].sort_values(["method", "budget", "example_id"])


def plot_score_vs_kl(table: pd.DataFrame, path, title: str):
    """Mean score vs mean KL (symlog: the full cache sits at 0), a bar out to each configuration's p95 KL."""
    colours = method_colours(table["method"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, points in table.groupby("method", sort=True):
        colour = colours[method]
        ax.errorbar(
            points["kl_mean"],
            points["score"],
            xerr=[[0] * len(points), (points["kl_p95"] - points["kl_mean"]).clip(lower=0)],
            fmt="o",
            color=colour,
            label=method,
            capsize=3,
        )
        for _, p in points.iterrows():
            if p["budget"] < 1:  # the budget beside an eviction point (precision methods keep every token)
                ax.annotate(f"{p['budget']:g}", (p["kl_mean"], p["score"]), fontsize=7, xytext=(4, 3),
                            textcoords="offset points")  # fmt: skip
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlabel("KL(full ‖ compressed) per answer token, nats (mean; bar: to the 95th percentile)")
    ax.set_ylabel("mean score")
    if table["score"].between(0, 1).all():
        ax.set_ylim(-0.03, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


@report_section("Score vs fidelity (KL from the full cache)", needs=["kl_mean", "top1_agreement"], where="plots")
def score_vs_kl(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    parts_html, parts_md, files = [], [], []
    for (model, task), scope in rows.groupby(["model", "task"], sort=True):
        table, impossible = fidelity_table(scope), impossible_table(scope)
        if len(impossible):
            note = (
                f"{html.escape(str(task))} on {html.escape(str(model))}: {len(impossible)} rows with impossible "
                "fidelity values (a broken measurement), not averaged below:"
            )
            parts_html += [f"<p>{note}</p>", impossible.to_html(index=False)]
            parts_md += [html.unescape(note), markdown(impossible)]
        if table.empty or (table["method"] != "full").sum() == 0:
            continue
        note = (
            f"{html.escape(str(task))} on {html.escape(str(model))}: per configuration the mean score, the mean and "
            "95th percentile over examples of each answer's mean KL(full ‖ compressed) per token (nats), the mean "
            "worst step, top-1 agreement with the full cache, and the generated length relative to the full cache's."
        )
        shown = table.round({"score": 3, "kl_mean": 4, "kl_p95": 4, "kl_max": 4, "top1_agreement": 3})
        shown = shown.round({"length_vs_full": 2})
        parts_html += [f"<p>{note}</p>", shown.to_html(index=False)]
        parts_md += [note, markdown(shown)]
        if context.out_dir is not None:
            path = context.out_dir / f"{slug('fidelity', model, task)}.png"
            files.append(plot_score_vs_kl(table, path, f"task {task} — {model}"))
    if not parts_html:
        return None
    return Section(html="\n".join(parts_html), markdown="\n\n".join(parts_md), files=files)
