"""The report's "claimed vs held" section (kvbench.report.section): per kvpress press (method=kvpress,
methods/kvpress.py) and budget, the ratio the press claims (`kv_ratio_nominal`) beside the bytes the cache held
(`kv_ratio`), the peak over the loaded model and the prefill time. A press that holds the full cache while
claiming compression is named so, with kvpress's own reason. Torch-free."""

from __future__ import annotations

import html
import json

import pandas as pd

from kvbench.guide.selection import markdown
from kvbench.report.section import Context, Section, report_section

# kvpress 0.5.5, kvpress/attention_patch.py (attention_patch's docstring), on its head-wise presses' fake keys
KVPRESS_REASON = (
    "The keys are updated with a fake key k whose scaled attention weight underflows to zero. This solution is not "
    "optimal as it does not reduce peak memory and slightly increases runtime"
)
MIB = 2**20


def press_label(spec) -> str:
    """{name: AdaKVPress, press: {name: SnapKVPress}, alpha_safeguard: 0.2}
    → AdaKVPress(SnapKVPress, alpha_safeguard=0.2)."""
    if not isinstance(spec, dict):
        return str(spec)
    inner = [press_label(v) if isinstance(v, dict) else f"{k}={v}" for k, v in spec.items() if k != "name"]
    return f"{spec['name']}({', '.join(inner)})" if inner else spec["name"]


def held(row) -> str:
    if row.kv_ratio_nominal >= 0.99:
        return "no compression claimed"
    if row.kv_ratio >= 0.99:
        return "held in full ¹"
    return "held as claimed" if row.kv_ratio <= row.kv_ratio_nominal * 1.02 else "held more than claimed"


@report_section("kvpress: claimed vs held", needs=["kv_ratio_nominal"], where="tables")
def claimed_vs_held(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    rows = rows[rows["kv_ratio_nominal"].notna()]
    if rows.empty:
        return None
    rows = rows.assign(press=[press_label(json.loads(p).get("press")) for p in rows["method_params"]])
    delta = rows["peak_mem_delta_bytes"] if "peak_mem_delta_bytes" in rows else pd.Series(float("nan"), rows.index)
    table = (
        rows.assign(peak_delta_MiB=delta / MIB)
        .groupby(["press", "budget"], sort=True)
        .agg(
            n=("score", "size"),
            score=("score", "mean"),
            kv_ratio_nominal=("kv_ratio_nominal", "mean"),
            kv_ratio=("kv_ratio", "mean"),
            peak_delta_MiB=("peak_delta_MiB", "median"),
            prefill_s=("prefill_s", "mean"),
        )
        .reset_index()
    )
    table["held"] = [held(r) for r in table.itertuples()]
    note = (
        "kv_ratio_nominal: the cache the press claims (kvpress's compression_ratio applied to the prompt, later "
        "tokens whole); kv_ratio: the bytes the cache physically held, over the full cache at the same tokens."
    )
    reason = (
        f"¹ kvpress: “{KVPRESS_REASON}” (kvpress/attention_patch.py)." if table["held"].str.contains("¹").any() else ""
    )
    body = table.to_html(index=False, float_format=lambda v: f"{v:.3g}")
    return Section(
        html=f"<p>{html.escape(note)}</p>{body}" + (f"<p>{html.escape(reason)}</p>" if reason else ""),
        markdown=note + "\n\n" + markdown(table) + (f"\n\n{reason}" if reason else ""),
    )
