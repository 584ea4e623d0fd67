"""The report's diagnostics section (rows of a `diagnose=true` run; kvbench.report.section): verdict counts per
configuration, layer × KV-head heatmaps of attention-mass recall and evidence retention, KL per decode step, and a
short "why" per configuration that lost quality. Torch-free: it reads the rows' diagnostic columns only."""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.guide.selection import markdown
from kvbench.guide.verdict import NOT_LOST, VERDICTS
from kvbench.report.section import Context, Section, report_section, save_figure
from kvbench.store.aggregate import fidelity_invalid  # impossible KL values: never averaged

CONFIG = ["method", "budget"]  # `method` is already the variant label (kivi(bits=2)) in the report's rows


def _grid(cells: pd.Series) -> np.ndarray:
    """Mean over examples of JSON [layer][head] grids (null = unknown) → (L, H) float array."""
    grids = [np.array(json.loads(c), dtype=float) for c in cells if isinstance(c, str)]
    return np.nanmean(np.stack(grids), axis=0) if grids else np.empty((0, 0))


def _heatmaps(rows: pd.DataFrame, column: str, title: str, out_dir: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [(key, g) for key, g in rows.groupby(CONFIG, sort=True) if key[0] != "full"]
    grids = [(key, _grid(g[column])) for key, g in configs]
    grids = [(key, grid) for key, grid in grids if grid.size and not np.isnan(grid).all()]
    if not grids:
        return None
    fig, axes = plt.subplots(1, len(grids), figsize=(1.1 + 1.3 * len(grids), 4.5), squeeze=False, sharey=True)
    for ax, ((method, budget), grid) in zip(axes[0], grids):
        image = ax.imshow(grid, aspect="auto", vmin=0, vmax=1, cmap="viridis", interpolation="nearest")
        ax.set_title(f"{method}\n@{budget:g}", fontsize=7)
        ax.set_xticks(range(grid.shape[1]))
        ax.set_xlabel("KV head", fontsize=7)
        ax.tick_params(labelsize=6)
    axes[0][0].set_ylabel("layer")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fig.suptitle(title, fontsize=9)
    path = out_dir / f"diagnose_{column}.png"
    save_figure(fig, path, tight=True)
    return path


def _kl_curves(rows: pd.DataFrame, out_dir: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    drawn = 0
    for (method, budget), group in rows[rows["method"] != "full"].groupby(CONFIG, sort=True):
        curves = [json.loads(c) for c in group["kl_per_step"] if isinstance(c, str)]
        if not curves:
            continue
        steps = max(map(len, curves))
        padded = np.full((len(curves), steps), np.nan)  # (examples, steps): answers end at different steps
        for i, c in enumerate(curves):
            padded[i, : len(c)] = c
        ax.plot(range(steps), np.nanmean(padded, axis=0), marker=".", label=f"{method} @{budget:g}")
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("decode step (teacher-forced full-cache answer)")
    ax.set_ylabel("mean KL(full ‖ compressed), nats")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.legend(fontsize=6, ncol=2)
    path = out_dir / "diagnose_kl_per_step.png"
    save_figure(fig, path, tight=True)
    return path


def verdict_counts(rows: pd.DataFrame) -> pd.DataFrame:
    counts = pd.crosstab([rows["method"], rows["budget"]], rows["verdict"])
    return counts.reindex(columns=[v for v in VERDICTS if v in counts.columns]).reset_index()


def why(rows: pd.DataFrame) -> list[str]:
    """One short paragraph per configuration with at least one lost example (a verdict outside NOT_LOST: no loss,
    answer intact, model fails anyway)."""
    out = []
    for (method, budget), g in rows[rows["method"] != "full"].groupby(CONFIG, sort=True):
        lost = g[~g["verdict"].isin(NOT_LOST)]
        if lost.empty:
            continue
        verdicts = ", ".join(f"{v} ×{n}" for v, n in lost["verdict"].value_counts().items())
        recall = _grid(lost["mass_recall_by_layer_head"]) if "mass_recall_by_layer_head" in g else np.empty(0)
        weakest = ""
        if recall.size:
            order = np.argsort(np.nanmean(recall, axis=1))[:3]
            weakest = f" (weakest layers {', '.join(map(str, order))}: {np.nanmean(recall, axis=1)[order].round(2)})"
        text = (
            f"{method} @{budget:g}: {len(lost)} of {len(g)} examples lost quality — {verdicts}. Attention-mass "
            f"recall {lost['mass_recall'].mean():.2f}{weakest}; evicted share {lost['evicted_share'].mean():.2f}; "
            f"mean KL {lost['kl_mean'][fidelity_invalid(lost) == ''].mean():.3f} nats, first top-1 divergence at step "
            f"{lost['first_divergence_step'].median():.0f} (median)"
        )
        if lost["evidence_retention"].notna().any():
            text += (
                f"; evidence kept {100 * lost['evidence_retention'].mean():.0f} % of its tokens (mean over layers "
                f"× heads), its attention mass {lost['evidence_mass_full'].mean():.3f} → "
                f"{lost['evidence_mass_compressed'].mean():.3f}"
            )
        else:
            text += "; the task does not know its evidence"
        out.append(text + ".")
    return out


@report_section("Why quality dropped (diagnostics)", needs=["verdict"], where="tables")
def diagnostics(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section:
    out_dir = context.out_dir
    counts = verdict_counts(rows)
    paragraphs = why(rows)
    files = [
        p
        for p in (
            _heatmaps(rows, "mass_recall_by_layer_head", "attention-mass recall (layer × KV head)", out_dir),
            _heatmaps(
                rows,
                "evidence_retention_by_layer_head",
                "evidence retention (layer × KV head; tasks that know their evidence)",
                out_dir,
            ),
            _kl_curves(rows, out_dir),
        )
        if p is not None
    ]
    note = (
        "Teacher-forced full-cache answer through each configuration (diagnose=true). Verdict rule and "
        "thresholds: kvbench/guide/verdict.py, `verdict:` in conf/config.yaml."
    )
    page = f"<p>{html.escape(note)}</p>{counts.to_html(index=False)}" + "".join(
        f"<p>{html.escape(p)}</p>" for p in paragraphs
    )
    text = "\n\n".join([note, markdown(counts), *paragraphs])
    return Section(html=page, markdown=text, files=files)
