"""`python -m kvbench.report RESULTS_DIR [RESULTS_DIR ...] [--out DIR] [--tolerance 0.02]`

Writes the plots (PNG), `summary.csv` (every aggregate, all levels, with `compared`), `report.html`
(self-contained: PNGs embedded as data URIs, no network) and `report.md` (the same content; images by relative
file name) into --out (default: the first RESULTS_DIR/report), and prints the files written. Exit 2 with one line
on bad input. Torch-free.

The page reads top-down: takeaways per task (the headline plot first — quality vs measured kv_ratio — beside the
knees and best method per budget, in words with the numbers; then sections registered for "summary" such as the
selection guide), then plots, then tables (default columns, the rest behind a toggle; per task, collapsible), then
registered sections and provenance. Every pooled number compares configurations on the same examples; the others
are listed apart (see kvbench.store.aggregate).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from kvbench import KvbenchError
from kvbench.config.rules import Rule, check_args, check_value
from kvbench.report import sections as _registered  # noqa: F401  (importing it registers the sections)
from kvbench.report.page import Page
from kvbench.report.section import PLACES, Context, build_sections
from kvbench.report.sections.engines import engine_labels
from kvbench.report.tables import Column, fixed, plain_columns, summary_columns
from kvbench.report.takeaways import takeaways
from kvbench.store.aggregate import (
    ALL,
    add_results_argument,
    averaged,
    knees,
    load_rows,
    pareto,
    summarize,
    with_experiment_labels,
    with_variants,
)
from kvbench.store.intervals import MIN_N
from kvbench.store.results import check_writable, write_atomic, write_csv

PROVENANCE = ["git_sha", "kvbench_version", "torch_version", "transformers_version", "device_name", "dtype"]
OPEN_ROWS = 14  # a per-task table longer than this starts collapsed


SCOPE = ["model", "task", "length", "query_aware"]  # one block of takeaways, plots and tables


def _scopes(summary: pd.DataFrame, level: str) -> list[tuple]:
    part = summary[summary["level"] == level]
    return sorted(
        part[SCOPE].drop_duplicates().itertuples(index=False, name=None),
        key=lambda k: (str(k[0]), str(k[1]), int(k[2]), str(k[3])),
    )


def _name(model, task, length, query_aware, several_models: bool, several_settings: bool) -> str:
    name = "all tasks pooled" if task == ALL else f"task {task}"
    if length:
        name += f" at {length:,} tokens"
    if several_models:
        name += f" — {model}"
    if several_settings:
        name += " (query-aware)" if query_aware else " (context-only)"
    return name


def _part(table: pd.DataFrame, level: str, model, task, length, query_aware) -> pd.DataFrame:
    return table[
        (table["level"] == level)
        & (table["model"] == model)
        & (table["task"] == task)
        & (table["length"] == length)
        & (table["query_aware"] == query_aware)
    ]


def _summary_tables(page: Page, part: pd.DataFrame, **columns) -> None:
    """The compared configurations, then those that ran on only part of the examples (never ranked with them)."""
    compared, apart = part[part["compared"]], part[~part["compared"]]
    cols = summary_columns(part, **columns)
    page.table(compared, cols, compared["n"] < MIN_N)
    if len(apart):
        page.note("Ran on only part of the examples: not comparable with the table above (own n, tasks covered).")
        page.table(
            apart,
            summary_columns(part, tasks=True, **{k: v for k, v in columns.items() if k != "tasks"}),
            apart["n"] < MIN_N,
        )


def knee_columns() -> list[Column]:
    return [
        Column("method", lambda r: r["method"]),
        Column("budgets tested", lambda r: r["budgets"]),
        Column("knee budget", lambda r: r["knee_budget"], lambda v: "none" if math.isnan(float(v)) else f"{v:g}"),
        Column("kv_ratio", lambda r: r["kv_ratio"], fixed(3)),
        Column("score", lambda r: r["score"], fixed(3)),
        Column("drop vs full", lambda r: r["drop_vs_full"], fixed(3, signed=True)),
    ]


def pareto_columns() -> list[Column]:
    return [
        Column("kv_ratio", lambda r: r["kv_ratio"], fixed(3)),
        Column("score", lambda r: r["score"], fixed(3)),
        Column("method", lambda r: r["method"]),
        Column("budget", lambda r: r["budget"], lambda v: f"{v:g}"),
        Column("n", lambda r: r["n"]),
        Column("drop vs full", lambda r: r["drop_vs_full"], fixed(3, signed=True)),
    ]


def provenance_table(rows: pd.DataFrame, paths: list[Path]) -> pd.DataFrame:
    items = [(c, ", ".join(sorted(map(str, rows[c].dropna().unique())))) for c in PROVENANCE if c in rows]
    items += [
        ("runs", str(rows["run_id"].nunique())),
        ("rows", str(len(rows))),
        ("timestamps", f"{rows['timestamp'].min()} … {rows['timestamp'].max()}"),
        ("inputs", ", ".join(map(str, paths))),
        ("report written", datetime.now(timezone.utc).isoformat(timespec="seconds")),
    ]
    return pd.DataFrame(items, columns=["field", "value"])


def build_report(paths: list[Path], out_dir: Path, tolerance: float) -> list[Path]:
    from kvbench.report.plots import plot_all  # matplotlib import only once the input is known to be good

    # different experiments (dtypes, code versions) apart: kvbench.store.aggregate.with_experiment_labels
    loaded = with_experiment_labels(load_rows(paths))
    # one line per configuration variant: kivi bits=2 and bits=4 are different curves, each with its own colour
    loaded = loaded.assign(method=with_variants(loaded)["variant"])
    loaded = loaded.assign(method=engine_labels(loaded))  # several engines: `<option> @<engine>`, each its own curve
    rows = averaged(loaded)  # a serving engine's garbage rows are shown apart (sections/engines.py), never averaged
    summary = summarize(rows)
    knee = knees(summary, tolerance)
    frontier = pareto(summary)
    check_writable(out_dir)
    plots = plot_all(rows, summary, knee, frontier, out_dir, tolerance)
    context = Context(out_dir, tuple(Path(p) for p in paths), loaded.loc[loaded.index.difference(rows.index)])
    extra = {place: build_sections(rows, summary, context, place) for place in PLACES}
    page = render(rows, summary, knee, frontier, plots, extra, paths, tolerance)

    written = [p.path for p in plots] + [f for sections in extra.values() for s in sections for f in s.files]
    for name, text in [("report.html", page[0]), ("report.md", page[1])]:
        write_atomic(out_dir / name, lambda tmp, text=text: Path(tmp).write_text(text, encoding="utf-8"))
        written.append(out_dir / name)
    write_csv(summary, out_dir / "summary.csv")
    written.append(out_dir / "summary.csv")
    _readable(written)
    return written


def render(rows, summary, knee, frontier, plots, extra, paths, tolerance) -> tuple[str, str]:
    several_models = rows["model"].nunique() > 1
    several_settings = rows["query_aware"].nunique() > 1
    scopes = _scopes(summary, "task") + _scopes(summary, "overall")

    def name(scope):
        return _name(*scope, several_models, several_settings)

    def images(scope, kinds):  # a scope's plots, and those of its task that span every length
        model, task, length = scope[:3]
        return [
            p.path
            for kind in kinds
            for p in plots
            if (p.model, p.task, p.kind) == (model, task, kind) and p.length in (length, None)
        ]

    page = Page("kvbench report")
    page.note(
        f"{rows['model'].nunique()} model(s): {', '.join(sorted(map(str, rows['model'].unique())))} · "
        f"{len(rows)} result rows · tasks {', '.join(sorted(map(str, rows['task'].unique())))} · written "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        cls="meta",
    )
    page.heading(2, "Takeaways", "takeaways")
    for scope in scopes:  # first the headline plot (quality vs measured kv_ratio) beside its lines, per task
        lines = takeaways(summary, knee, tolerance, "task" if scope[1] != ALL else "overall", *scope)
        if lines:
            page.heading(3, name(scope).capitalize())
            quality = images(scope, ["quality"])
            page.card(quality[0] if quality else None, lines)
    page.note(
        f"Per task, on the examples every compared configuration ran. Knee: the smallest budget whose mean "
        f"score is within {tolerance:g} (absolute) of the full cache on the same examples. Intervals: 95 %, "
        f"Wilson for 0/1 scores, bootstrap otherwise; none below {MIN_N} examples."
    )
    for section in extra["summary"]:  # then the selection guide's verdict
        _extra(page, section, level=3)

    page.heading(2, "Plots", "plots")
    shown: set = set()  # a heatmap or stream plot spans every length of its task: shown with its first length
    for scope in scopes:
        more = [p for p in images(scope, ["pareto", "costs", "stream"]) if p not in shown]
        heatmaps = [p for p in images(scope, ["heatmap"]) if p not in shown]
        shown.update(more + heatmaps)
        if more or heatmaps:
            page.open(f"{name(scope).capitalize()}: Pareto frontier, memory and latency", is_open=True)
            page.images(more)
            if heatmaps:
                page.open(f"length × depth heatmaps, one per method ({len(heatmaps)})")
                page.images(heatmaps)
                page.close()
            page.close()
    for section in extra["plots"]:
        _extra(page, section)

    page.heading(2, "Tables", "tables")
    page.raw(
        '<label class="toggle"><input type="checkbox" id="allcols"> show all columns (partial score, cache '
        'MiB, matched examples, interval method)</label><p class="note">Click a column heading to sort. Grey '
        f"rows: fewer than {MIN_N} examples. drop vs full = full-cache mean minus the mean, on the same "
        "examples.</p>"
    )
    for scope in scopes:
        level = "task" if scope[1] != ALL else "overall"
        part = _part(summary, level, *scope)
        if scope[1] == ALL and scope == next(s for s in scopes if s[1] == ALL):  # the first pooled scope
            page.raw('<div id="overall"></div>')
        n_compared = int(part["compared"].sum())
        apart = f", {len(part) - n_compared} on only part of the examples" if len(part) > n_compared else ""
        page.open(
            f"{name(scope).capitalize()}: {n_compared} configurations compared{apart}", is_open=n_compared <= OPEN_ROWS
        )
        _summary_tables(page, part, model=False, tasks=scope[1] == ALL, setting=False)
        for sub in ("scenario", "subset"):
            subpart = _part(summary, sub, *scope)
            if subpart["subset"].nunique() > 1:
                page.open(f"per {sub} ({subpart['subset'].nunique()})")
                _summary_tables(page, subpart.sort_values(["subset", "method", "budget"]), subset=True)
                page.close()
        page.close()
    for title, table, columns in (
        ("Knees per task", knee, knee_columns()),
        (
            "Pareto frontiers per task (the points no other beats on both smaller kv_ratio and better score)",
            frontier,
            pareto_columns(),
        ),
    ):
        page.open(title)
        for scope in scopes:
            part = _part(table, "task" if scope[1] != ALL else "overall", *scope)
            if len(part):
                page.heading(3, name(scope).capitalize())
                page.table(part, columns)
        page.close()
    for section in extra["tables"]:
        _extra(page, section)

    page.heading(2, "Provenance", "provenance")
    prov = provenance_table(rows, paths)
    page.table(prov, plain_columns(prov), cls="left")
    nav = (
        [("takeaways", "Takeaways"), ("plots", "Plots"), ("tables", "Tables")]
        + ([("overall", "All tasks pooled")] if any(s[1] == ALL for s in scopes) else [])
        + [("provenance", "Provenance")]
    )
    return page.html(nav), page.markdown()


def _extra(page: Page, section, level: int = 2) -> None:
    """A section registered by another module (kvbench.report.section): inside the page's width, its tables in
    the page's style (cells wrap instead of running off the right edge)."""
    page.heading(level, section.title)
    page.raw(f'<div class="section">{section.html}</div>', section.markdown)
    page.images(section.files)


def _readable(paths: list[Path]) -> None:
    """write_atomic's temporary files are created 0600; a report is meant to be shared or served, so give the
    files the mode a plain open() would (0666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)


RESULTS = Rule("path", "a result store, run directory or rows .parquet file")
ARGS = {  # every argument, checked before any row is read (kvbench.config.rules)
    "results": RESULTS,
    "--out": Rule("out_dir", "--out DIR (a directory the report can be written to)", nullable=True),
    "--tolerance": Rule("float", "--tolerance 0.02 (the largest score drop that counts as lossless, ≥ 0)", min=0),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.report", description=__doc__.split("\n\n")[1])
    add_results_argument(parser)
    parser.add_argument("--out", type=Path, help="output directory (default: RESULTS_DIR/report)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="knee: largest absolute score drop vs the full cache that counts as lossless",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on bad usage: return it instead, as main() promises an int
        return int(exit_.code or 0)
    try:
        check_args(args, ARGS)
        out_dir = args.out or (args.results[0] if args.results[0].is_dir() else args.results[0].parent) / "report"
        check_value("--out", str(out_dir), ARGS["--out"])  # the default too: RESULTS_DIR/report
        written = build_report(args.results, out_dir, args.tolerance)
    except KvbenchError as error:
        print(f"kvbench.report: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
