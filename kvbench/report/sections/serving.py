"""The report's serving section: a request trace served under fixed KV memory budgets (kvbench.serving) — per
method, throughput and p99 TTFT/TPOT against the KV budget, the concurrency each reached (beside the planner's
prediction) and the goodput curve (requests per second meeting the SLO, against the budget).

`python -m kvbench.serving` writes `serving_runs.parquet` (one row per configuration × KV budget); the section
shows the first such file found beside the report's inputs: `<input>/`, `<input>/serving/`, `<input>/../` or
`<input>/../serving/`. `render` draws it for any frame of run rows (the serving entry writes its own page with
it); engines' rows (`engine` a serving engine, `method` <engine>:<option>) are lines of their own. A
`prefix_serving.parquet` beside it (python -m kvbench.serving.prefix) adds the prefix-caching table. Torch-free."""

from __future__ import annotations

import html
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from kvbench.guide.selection import markdown
from kvbench.report.section import Context, Section, report_section, save_figure

FILE = "serving_runs.parquet"
PREFIX_FILE = "prefix_serving.parquet"  # python -m kvbench.serving.prefix --out <the same directory>
NEEDED = [
    "method",
    "budget",
    "kv_budget_bytes",
    "throughput_tokens_s",
    "ttft_p99_s",
    "tpot_p99_s",
    "max_concurrency",
    "goodput_requests_s",
]


def find_runs(inputs: list[Path]) -> Path | None:
    for path in map(Path, inputs):
        bases = [path, path.parent] if path.is_dir() else [path.parent, path.parent.parent]
        for base in bases:
            for candidate in (base / FILE, base / "serving" / FILE):
                if candidate.is_file():
                    return candidate
    return None


def shown_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One line per configuration × KV budget, measured beside predicted where the planner predicts."""
    out = pd.DataFrame(
        {
            "method": runs["method"],
            "budget": runs["budget"].map(lambda v: f"{v:.2f}"),
            "KV budget MB": (runs["kv_budget_bytes"] / 1e6).map(lambda v: f"{v:,.1f}"),
            "concurrency": runs["max_concurrency"].astype(int),
        }
    )
    if "predicted_max_concurrency" in runs:
        out["planner concurrency"] = runs["predicted_max_concurrency"].map(lambda v: "" if pd.isna(v) else str(int(v)))
    out["tokens/s"] = runs["throughput_tokens_s"].map(lambda v: f"{v:.3g}")
    if "predicted_tokens_s" in runs:
        out["planner tokens/s"] = runs["predicted_tokens_s"].map(lambda v: "" if pd.isna(v) else f"{v:,.0f}")
    for name in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
        if name in runs:
            out[name.removesuffix("_s").replace("_", " ") + " s"] = runs[name].map(lambda v: f"{v:.3g}")
    out["goodput req/s"] = runs["goodput_requests_s"].map(lambda v: f"{v:.3g}")
    for name, label in (("preemptions", "preemptions"), ("score", "score")):
        if name in runs:
            out[label] = runs[name].map(lambda v: f"{v:.3g}" if isinstance(v, float) else str(v))
    return out


def plot(runs: pd.DataFrame, path: Path) -> Path:
    """Four panels against the KV budget, one line per configuration: throughput, p99 TTFT, p99 TPOT, concurrency
    (the planner's dashed), and the goodput curve."""
    panels = [
        ("throughput_tokens_s", "tokens/s"),
        ("ttft_p99_s", "p99 TTFT (s)"),
        ("tpot_p99_s", "p99 TPOT (s)"),
        ("max_concurrency", "largest concurrency"),
        ("goodput_requests_s", "goodput (req/s within SLO)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    runs = runs.assign(config=runs["method"] + " " + runs["budget"].map(lambda v: f"{v:g}"))
    for ax, (column, label) in zip(axes, panels):
        for i, (config, group) in enumerate(runs.sort_values("kv_budget_bytes").groupby("config", sort=True)):
            color = f"C{i}"
            ax.plot(group["kv_budget_bytes"] / 1e6, group[column], marker="o", color=color, label=config)
            if column == "max_concurrency" and "predicted_max_concurrency" in group:
                ax.plot(
                    group["kv_budget_bytes"] / 1e6, group["predicted_max_concurrency"], ls="--", color=color, alpha=0.6
                )
        ax.set_xlabel("KV budget (MB)")
        ax.set_title(label, fontsize=10)
        ax.set_xscale("log")
    axes[0].legend(fontsize=8)
    slo = ""
    if "slo_ttft_s" in runs:
        slo = f" — SLO: TTFT ≤ {runs['slo_ttft_s'].iloc[0]:g} s, TPOT ≤ {runs['slo_tpot_s'].iloc[0]:g} s"
    fig.suptitle(f"Serving under a KV budget{slo} (dashed: the planner's concurrency)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def prefix_table(prefix: pd.DataFrame) -> pd.DataFrame:
    """kvbench.serving.prefix's rows: per workload and system, hit rate, TTFT with / without the cache, identical
    answers (and compress-once against per-question for kvbench's compressing method)."""
    return pd.DataFrame(
        {
            "workload": prefix["workload"],
            "system": prefix["system"],
            "option": prefix["option"],
            "requests": prefix["requests"],
            "hit rate": prefix["hit_rate"].map(lambda v: "n/a" if pd.isna(v) else f"{v:.2f}"),
            "TTFT with / without": (prefix["ttft_with_s"] / prefix["ttft_without_s"]).map(lambda v: f"{v:.2f}"),
            "identical answers": prefix["identical"].map(lambda v: "yes" if v else "no"),
            "score": prefix["score"].map(lambda v: f"{v:.2f}"),
        }
    )


def render(runs: pd.DataFrame, out_dir: Path, source: str = FILE, prefix: pd.DataFrame | None = None) -> Section:
    missing = [c for c in NEEDED if c not in runs]
    if missing:
        raise ValueError(f"{source} lacks columns {missing}")
    first = runs.iloc[0]
    intro = (
        f"{first.get('model', '')}: {int(first.get('requests', 0))} requests ({first.get('arrival', '')} arrivals) "
        f"served by continuous batching within each KV budget (from {source}, written by python -m kvbench.serving; "
        f"measured on {first.get('device_name', 'this machine')}). Concurrency: the most requests holding a cache at "
        "once; planner: kvbench.plan's largest batch within the budget and its decode roofline. Goodput: requests "
        "meeting both SLOs per second."
    )
    order = [c for c in ("engine", "method", "budget", "kv_budget_bytes") if c in runs]
    table = shown_table(runs.sort_values(order, kind="stable"))
    png = plot(runs, Path(out_dir) / "serving.png")
    page_html, page_md = f"<p>{html.escape(intro)}</p>" + table.to_html(index=False), intro + "\n\n" + markdown(table)
    if prefix is not None and len(prefix):
        words = (
            "Prefix caching side by side (python -m kvbench.serving.prefix): each shared-prefix workload's requests in "
            "order through each system without, then with, its prefix cache; TTFT summed over the requests."
        )
        shown = prefix_table(prefix)
        page_html += f"<p>{html.escape(words)}</p>" + shown.to_html(index=False)
        page_md += "\n\n" + words + "\n\n" + markdown(shown)
    return Section(html=page_html, markdown=page_md, files=[png])


@report_section("Serving under a KV memory budget", where="tables")
def serving(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    path = find_runs(list(context.inputs))
    if path is None:
        return None
    beside = path.parent / PREFIX_FILE
    prefix = pd.read_parquet(beside) if beside.is_file() else None
    return render(pd.read_parquet(path), context.out_dir, path.name, prefix)
