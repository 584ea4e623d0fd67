"""`python -m kvbench.report RESULTS_DIR [RESULTS_DIR ...] [--out DIR] [--tolerance 0.02]`

Writes the plots (PNG), `summary.csv` (every aggregate, all levels), `report.html` (self-contained: the PNGs are
embedded as data URIs) and `report.md` (the same tables; images by relative file name) into --out (default:
the first RESULTS_DIR/report), and prints the files written. Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import base64
import html
import math
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench import KvbenchError
from kvbench.aggregate import ALL, knees, load_rows, pareto, summarize
from kvbench.report_sections import PLACES, Section, build_sections
from kvbench.runner import with_variants
from kvbench.results import check_writable, write_atomic, write_csv

PROVENANCE = ["git_sha", "kvbench_version", "torch_version", "transformers_version", "device_name", "dtype"]
MiB = 2**20


# ------------------------------------------------------------------------------------------ the tables


def _num(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, (bool, np.bool_)):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _keys(rows: pd.DataFrame, with_subset: bool) -> list[tuple[str, str]]:
    """(column, heading) of the identifying columns worth showing: model only when several ran."""
    keys = [("model", "model")] if rows["model"].nunique() > 1 else []
    keys += [("task", "task")] + ([("subset", "subset")] if with_subset else [])
    return keys


def summary_table(summary: pd.DataFrame, rows: pd.DataFrame, level: str) -> pd.DataFrame:
    part = summary[summary["level"] == level]
    columns = _keys(rows, level == "subset") + [
        ("method", "method"), ("budget", "budget"), ("query_aware", "query_aware"), ("n", "n"),
        ("score", "score"), ("ci_low", "ci95_low"), ("ci_high", "ci95_high")]
    if "score_partial" in part and part["score_partial"].notna().any():
        columns.append(("score_partial", "score_partial"))
    columns += [("drop_vs_full", "drop_vs_full"), ("kv_ratio", "kv_ratio"), ("kv_MiB", "kv_MiB"),
                ("peak_MiB", "peak_mem_MiB"), ("prefill_s", "prefill_s"),
                ("decode_ms_per_token", "decode_ms_per_token")]
    part = part.assign(kv_MiB=part["kv_bytes"] / MiB, peak_MiB=part["peak_mem_bytes"] / MiB)
    if level != "overall":
        part = part.assign(task=part["task"].replace(ALL, "all"))
    return _format(part, columns)


def knee_table(table: pd.DataFrame, rows: pd.DataFrame, levels: list[str]) -> pd.DataFrame:
    part = table[table["level"].isin(levels)].assign(knee_budget=lambda t: t["knee_budget"].map(
        lambda b: "none" if math.isnan(b) else f"{b:g}"))
    columns = _keys(rows, False) + [
        ("method", "method"), ("query_aware", "query_aware"), ("budgets", "budgets tested"),
        ("knee_budget", "knee budget"), ("kv_ratio", "kv_ratio"), ("score", "score"),
        ("drop_vs_full", "drop_vs_full")]
    return _format(part.assign(task=part["task"].replace(ALL, "all tasks")), columns)


def pareto_table(frontier: pd.DataFrame, rows: pd.DataFrame, levels: list[str]) -> pd.DataFrame:
    part = frontier[frontier["level"].isin(levels)]
    columns = _keys(rows, False) + [
        ("query_aware", "query_aware"), ("kv_ratio", "kv_ratio"), ("score", "score"), ("method", "method"),
        ("budget", "budget"), ("n", "n"), ("drop_vs_full", "drop_vs_full")]
    return _format(part.assign(task=part["task"].replace(ALL, "all tasks")), columns)


def provenance_table(rows: pd.DataFrame, paths: list[Path]) -> pd.DataFrame:
    items = [(c, ", ".join(sorted(map(str, rows[c].dropna().unique())))) for c in PROVENANCE if c in rows]
    items += [("runs", str(rows["run_id"].nunique())), ("rows", str(len(rows))),
              ("timestamps", f"{rows['timestamp'].min()} … {rows['timestamp'].max()}"),
              ("inputs", ", ".join(map(str, paths))),
              ("report written", datetime.now(timezone.utc).isoformat(timespec="seconds"))]
    return pd.DataFrame(items, columns=["field", "value"])


def _format(part: pd.DataFrame, columns: list[tuple[str, str]]) -> pd.DataFrame:
    out = pd.DataFrame({heading: [_num(v) if column != "budget" else f"{v:g}" for v in part[column]]
                        for column, heading in columns})
    return out.reset_index(drop=True)


# ------------------------------------------------------------------------------------------ rendering


def markdown_table(table: pd.DataFrame) -> str:
    def cell(v):
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(cell, table.columns)) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def html_table(table: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
                   for row in table.itertuples(index=False))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.5em;font-size:0.85em}th,td{border:1px solid #ccc;padding:3px 7px;
text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;
display:block;margin:0.5em 0 1.5em}.note{color:#555;font-size:0.9em}"""


def _image(image: Path) -> str:
    data = base64.b64encode(image.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(image.stem)}" src="data:image/png;base64,{data}">'


def _extra(sections: list[Section], md: list[str], body: list[str]) -> None:
    """Sections registered by other modules (kvbench.report_sections)."""
    for section in sections:
        md += [f"## {section.title}", "", section.markdown, ""] + [f"![{f.stem}]({f.name})" for f in section.files]
        body += [f"<h2>{html.escape(section.title)}</h2>", section.html] + [_image(f) for f in section.files]


def render(sections: list[tuple[str, str, pd.DataFrame]], images: list[Path], title: str,
           extra: dict[str, list[Section]] | None = None) -> tuple[str, str]:
    """(HTML, Markdown) of the same sections; HTML embeds the images, Markdown links them by file name."""
    extra = extra or {}
    md = [f"# {title}", ""]
    body = [f"<h1>{html.escape(title)}</h1>"]
    _extra(extra.get("summary", []), md, body)
    for heading, note, table in sections:
        md += [f"## {heading}", "", note, "", markdown_table(table), ""]
        body += [f"<h2>{html.escape(heading)}</h2>", f'<p class="note">{html.escape(note)}</p>', html_table(table)]
    _extra(extra.get("tables", []), md, body)
    md += ["## Plots", ""]
    body.append("<h2>Plots</h2>")
    for image in images:
        md += [f"![{image.stem}]({image.name})", ""]
        body.append(_image(image))
    _extra(extra.get("plots", []), md, body)
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    return page, "\n".join(md)


# ------------------------------------------------------------------------------------------ the report


def build_report(paths: list[Path], out_dir: Path, tolerance: float) -> list[Path]:
    from kvbench.report_plots import plot_all  # matplotlib import only once the input is known to be good

    rows = load_rows(paths)
    # one line per configuration variant: kivi bits=2 and bits=4 are different curves, each with its own colour
    rows = rows.assign(method=with_variants(rows)["variant"])
    summary = summarize(rows)
    knee = knees(summary, tolerance)
    frontier = pareto(summary)
    check_writable(out_dir)
    images = plot_all(rows, summary, knee, frontier, out_dir, tolerance)

    several_tasks = rows["task"].nunique() > 1
    several_subsets = len(rows[["task", "subset"]].drop_duplicates()) > rows["task"].nunique()
    levels = ["task"] + (["overall"] if several_tasks else [])
    sections = [("Quality and cost per task",
                 "Means over examples, pooled over subsets; 95 % Student-t interval on the per-example scores. "
                 "drop_vs_full = full-cache mean minus the method's mean on the examples both ran. kv_ratio is "
                 "the measured cache size relative to the full cache.", summary_table(summary, rows, "task"))]
    if several_subsets:
        sections.append(("Per subset", "As above, per subset.", summary_table(summary, rows, "subset")))
    if several_tasks:
        sections.append(("Overall (all tasks pooled)", "Means over every example of every task.",
                         summary_table(summary, rows, "overall")))
    sections += [
        ("Knees", f"Smallest budget whose mean score is within {tolerance:g} (absolute) of the full cache on the "
                  "same examples; 'none': no budget tested is.", knee_table(knee, rows, levels)),
        ("Pareto frontier", "The (method, budget) points no other point beats on both smaller kv_ratio and "
                            "higher score.", pareto_table(frontier, rows, levels)),
        ("Provenance", "Distinct values over the rows shown.", provenance_table(rows, paths)),
    ]
    extra = {place: build_sections(rows, summary, out_dir, place) for place in PLACES}
    page, md = render(sections, images, "kvbench report", extra)
    written = list(images) + [f for sections_ in extra.values() for s in sections_ for f in s.files]
    for name, text in [("report.html", page), ("report.md", md)]:
        write_atomic(out_dir / name, lambda tmp, text=text: Path(tmp).write_text(text, encoding="utf-8"))
        written.append(out_dir / name)
    write_csv(summary, out_dir / "summary.csv")
    written.append(out_dir / "summary.csv")
    _readable(written)
    return written


def _readable(paths: list[Path]) -> None:
    """write_atomic's temporary files are created 0600; a report is meant to be shared or served, so give the
    files the mode a plain open() would (0666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.report", description=__doc__.split("\n\n")[1])
    parser.add_argument("results", nargs="+", type=Path, metavar="RESULTS_DIR",
                        help="result store, run directory or Parquet file (several are merged)")
    parser.add_argument("--out", type=Path, help="output directory (default: RESULTS_DIR/report)")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="knee: largest absolute score drop vs the full cache that counts as lossless")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on bad usage: return it instead, as main() promises an int
        return int(exit_.code or 0)
    try:
        if not args.tolerance >= 0:
            raise KvbenchError(f"--tolerance must be >= 0, got {args.tolerance}")
        for path in args.results:
            if not path.exists():
                raise KvbenchError(f"{path}: no such file or directory")
        out_dir = args.out or (args.results[0] if args.results[0].is_dir() else args.results[0].parent) / "report"
        written = build_report(args.results, out_dir, args.tolerance)
    except KvbenchError as error:
        print(f"kvbench.report: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
