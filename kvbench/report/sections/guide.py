"""The selection guide's summary at the top of the report (kvbench.guide.selection; kvbench.report.section)."""

from __future__ import annotations

import html

import pandas as pd

from kvbench.guide.selection import markdown, report_summary
from kvbench.report.section import Context, Section, report_section


@report_section("Which method (selection guide)", needs=["method_params"], where="summary")
def guide(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    raw = rows.assign(method=rows["method"].str.split("(").str[0])  # the report labels methods as variants
    best = report_summary(raw)
    if best.empty:
        return None
    note = (
        "Best-ranked configuration per scenario and budget (drop ≤ 0.05 vs the full cache, same examples). "
        "'ties': configurations whose score intervals overlap it — the ranking between them is not "
        "established. Full guide, constraints and composition candidates: python -m kvbench.guide RESULTS_DIR."
    )
    table = best.to_html(index=False, float_format=lambda v: f"{v:.3f}")
    return Section(html=f"<p>{html.escape(note)}</p>{table}", markdown=f"{note}\n\n{markdown(best)}")
