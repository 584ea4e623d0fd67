"""The report's throughput section (kvbench.report.section): decode tokens/s and per-request latency by
configuration × batch size, from rows' `batch_size` / `decode_tokens_per_s` / `latency_s` (kvbench.native.batched).
Shown when a run decoded in batches (some row with batch_size > 1). Torch-free."""

from __future__ import annotations

import pandas as pd

from kvbench.guide.selection import markdown
from kvbench.report.section import Context, Section, report_section


@report_section("Throughput (batched decoding)", needs=["batch_size", "decode_tokens_per_s"], where="tables")
def throughput(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    if not (rows["batch_size"].fillna(1) > 1).any():
        return None
    columns = {
        "decode_tokens_per_s": ("decode_tokens_per_s", "mean"),
        "kv_ratio": ("kv_ratio", "mean"),
        "peak_mem_GB": ("peak_mem_bytes", lambda b: b.max() / 1e9),
        "n": ("score", "size"),
    }
    if "latency_s" in rows:
        columns["latency_s"] = ("latency_s", "mean")
    table = (
        rows.assign(batch_size=rows["batch_size"].fillna(1).astype(int))
        .groupby(["method", "budget", "batch_size"], sort=True)
        .agg(**columns)
        .reset_index()
    )
    note = (
        "Decode tokens/s of a batch: every row's generated tokens per second of the batch's decode "
        "(measured on the machine named in the rows' device_name, under its load at the time)."
    )
    return Section(
        html=f"<p>{note}</p>" + table.to_html(index=False, float_format=lambda v: f"{v:.3g}"),
        markdown=note + "\n\n" + markdown(table),
    )
