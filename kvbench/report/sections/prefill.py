"""Report section: peak memory by prefill mode (`prefill=shared|inline`, `prefill_chunk`), from the rows alone.

Shown when the rows hold more than the default shared prefill: per model, task, context length, method and budget,
the median peak memory over the loaded model (`peak_mem_delta_bytes`) and the absolute peak, one column per mode.
A streamed text (task=ppl: one row per window) counts once, its peak over the model at the text's length;
its `inline` column is the text streamed with each layer bounded inside the forward (kvbench.native.streaming).
"""

from __future__ import annotations

import html

import pandas as pd

from kvbench.guide.selection import markdown
from kvbench.report.section import Context, Section, report_section

MIB = 2**20


def prefill_mode(rows: pd.DataFrame) -> pd.Series:
    """'shared', 'inline' or 'inline + chunk N' per row (rows from before these columns: shared)."""
    mode = rows["prefill"].fillna("shared").astype(str)
    chunk = rows["prefill_chunk"] if "prefill_chunk" in rows else pd.Series(float("nan"), index=rows.index)
    return mode.where(chunk.isna(), mode + " + chunk " + chunk.fillna(0).astype(int).astype(str))


def per_stream(rows: pd.DataFrame) -> pd.DataFrame:
    """Streamed rows (a `window` column: task=ppl) collapsed to one row per stream — a configuration's text, its
    windows' example ids `<text>/wNNN` — at the text's length: its largest window peak, and as delta that peak over
    the memory in use when the stream started (window 0's baseline: the loaded model), so the bounded cache counts
    (each window's own delta is over that window's start)."""
    if "window" not in rows or not rows["window"].notna().any():
        return rows
    streamed = rows["window"].notna()
    windows = rows[streamed].sort_values("window")
    windows = windows.assign(
        example_id=windows["example_id"].astype(str).str.replace(r"/w\d+$", "", regex=True),
        baseline=windows["peak_mem_bytes"] - windows["peak_mem_delta_bytes"],
    )
    group = [c for c in ("run_id", "config_hash", "example_id") if c in windows]
    peaks = {c: "max" for c in ("context_tokens", "peak_mem_bytes")}
    streams = windows.groupby(group, dropna=False).agg({c: peaks.get(c, "first") for c in windows if c not in group})
    streams["peak_mem_delta_bytes"] = streams["peak_mem_bytes"] - streams["baseline"]  # first: window 0's
    return pd.concat([rows[~streamed], streams.reset_index()[list(rows.columns)]], ignore_index=True)


def peak_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, task, context_tokens, method, budget), columns = mode → 'delta (absolute)' MiB medians."""
    if "peak_mem_delta_bytes" not in rows:  # rows from before the column; per_stream reads it
        rows = rows.assign(peak_mem_delta_bytes=float("nan"))
    frame = per_stream(rows)
    frame = frame.assign(mode=prefill_mode(frame))
    keys = [k for k in ("model", "task", "context_tokens", "method", "budget") if k in frame]
    grouped = frame.groupby([*keys, "mode"], dropna=False)[["peak_mem_delta_bytes", "peak_mem_bytes"]].median()
    cells = grouped.apply(
        lambda r: (
            (f"{r.peak_mem_delta_bytes / MIB:.0f} " if pd.notna(r.peak_mem_delta_bytes) else "– ")
            + f"({r.peak_mem_bytes / MIB:.0f})"
        ),
        axis=1,
    )
    table = cells.unstack("mode").fillna("")
    order = sorted(table.columns, key=lambda m: (m != "shared", m != "inline", m))
    return table[order].reset_index()


@report_section("Peak memory by prefill mode", needs=["prefill", "peak_mem_bytes"])
def peak_by_prefill(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    modes = set(prefill_mode(rows))
    if modes <= {"shared"}:
        return None  # the default alone: the per-task tables already show its peak
    table = peak_table(rows)
    note = (
        "Median peak memory per configuration, MiB: over the loaded model (peak_mem_delta_bytes), the absolute peak "
        "in brackets. shared = compress after the whole prefill; inline = each layer compressed inside the forward "
        "pass; + chunk N = the prompt fed N tokens at a time (kvbench/native/inline.py). A streamed text (ppl) "
        "counts once: "
        "its largest window's peak, over the memory in use when it started (shared: every layer bounded after each "
        "chunk's forward; inline: each layer right after its attention)."
    )
    return Section(
        html=f"<p>{html.escape(note)}</p>" + table.to_html(index=False, escape=True),
        markdown=note + "\n\n" + markdown(table),
    )
