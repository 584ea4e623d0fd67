"""Report section: peak memory by prefill mode (`prefill=shared|inline`, `prefill_chunk`), from the rows alone.

Shown when the rows hold more than the default shared prefill: per model, context length, method and budget, the
median peak memory over the loaded model (`peak_mem_delta_bytes`) and the absolute peak, one column per mode.
"""

from __future__ import annotations

import html

import pandas as pd

from kvbench.guide import markdown
from kvbench.report_sections import Section, report_section

MIB = 2**20


def prefill_mode(rows: pd.DataFrame) -> pd.Series:
    """'shared', 'inline' or 'inline + chunk N' per row (rows from before these columns: shared)."""
    mode = rows["prefill"].fillna("shared").astype(str)
    chunk = rows["prefill_chunk"] if "prefill_chunk" in rows else pd.Series(float("nan"), index=rows.index)
    return mode.where(chunk.isna(), mode + " + chunk " + chunk.fillna(0).astype(int).astype(str))


def peak_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, context_tokens, method, budget), columns = mode → 'delta (absolute)' MiB medians."""
    frame = rows.assign(mode=prefill_mode(rows))
    if "peak_mem_delta_bytes" not in frame:
        frame = frame.assign(peak_mem_delta_bytes=float("nan"))
    keys = ["model", "context_tokens", "method", "budget"]
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
def peak_by_prefill(rows: pd.DataFrame, summary: pd.DataFrame, out_dir) -> Section | None:
    modes = set(prefill_mode(rows))
    if modes <= {"shared"}:
        return None  # the default alone: the per-task tables already show its peak
    table = peak_table(rows)
    note = (
        "Median peak memory per configuration, MiB: over the loaded model (peak_mem_delta_bytes), the absolute peak "
        "in brackets. shared = compress after the whole prefill; inline = each layer compressed inside the forward "
        "pass; + chunk N = the prompt fed N tokens at a time (kvbench/inline.py)."
    )
    return Section(
        html=f"<p>{html.escape(note)}</p>" + table.to_html(index=False, escape=True),
        markdown=note + "\n\n" + markdown(table),
    )
