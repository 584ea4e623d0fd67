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
from kvbench.store.aggregate import press_label

# kvpress 0.5.5, kvpress/attention_patch.py (attention_patch's docstring), on its head-wise presses' fake keys
KVPRESS_REASON = (
    "The keys are updated with a fake key k whose scaled attention weight underflows to zero. This solution is not "
    "optimal as it does not reduce peak memory and slightly increases runtime"
)
MIB = 2**20


def held(row) -> str:
    if row.kv_ratio_nominal >= 0.99:
        return "no compression claimed"
    if row.kv_ratio >= 0.99:
        return "held in full ¹"
    return "held as claimed" if row.kv_ratio <= row.kv_ratio_nominal * 1.02 else "held more than claimed"


# kvpress's press → kvbench's method implementing the same selection (docs/methods.md "Fidelity")
COUNTERPART = {
    "SnapKVPress": "snapkv",
    "PyramidKVPress": "pyramidkv",
    "StreamingLLMPress": "streamingllm",
    "TOVAPress": "tova",
    "KnormPress": "knorm",
    "KeyDiffPress": "keydiff",
    "ExpectedAttentionPress": "expected_attention",
    "AdaKVPress": "adakv",
    "KVzipPress": "kvzip",
    "DecodingPress": "decoding",
    "ObservedAttentionPress": "h2o",
    "RandomPress": "random",
}


def native_scores(rows: pd.DataFrame, press: str, budget) -> str:
    """'snapkv 0.94 · snapkv(window_size=64) 0.10': kvbench's counterpart variants at `budget` with their mean
    scores; "" when none ran beside the press."""
    native = COUNTERPART.get(press.split("(")[0])
    if native is None:
        return ""
    base = rows["method"].astype(str).str.split("(").str[0]
    same = rows[(base == native) & (rows["budget"] == budget)]
    return " · ".join(f"{label} {score:.3g}" for label, score in same.groupby("method")["score"].mean().items())


@report_section("kvpress: claimed vs held", needs=["kv_ratio_nominal"], where="tables")
def claimed_vs_held(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    all_rows, rows = rows, rows[rows["kv_ratio_nominal"].notna()]
    if rows.empty:
        return None
    params = [json.loads(p) for p in rows["method_params"]]
    rows = rows.assign(press=[p.get("resolved") or press_label(p.get("press")) for p in params])
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
    table["kvbench's own"] = [native_scores(all_rows, r.press, r.budget) for r in table.itertuples()]
    note = (
        "kv_ratio_nominal: the cache the press claims (kvpress's compression_ratio applied to the prompt, later "
        "tokens whole); kv_ratio: the bytes the cache physically held, over the full cache at the same tokens; "
        "kvbench's own: the mean score of kvbench's counterpart method at the same budget in these rows, each "
        "variant with its knobs — the press's defaults are in its name (kvpress's SnapKV window is 64, kvbench's 32)."
    )
    reason = (
        f"¹ kvpress: “{KVPRESS_REASON}” (kvpress/attention_patch.py)." if table["held"].str.contains("¹").any() else ""
    )
    body = table.to_html(index=False, float_format=lambda v: f"{v:.3g}")
    return Section(
        html=f"<p>{html.escape(note)}</p>{body}" + (f"<p>{html.escape(reason)}</p>" if reason else ""),
        markdown=note + "\n\n" + markdown(table) + (f"\n\n{reason}" if reason else ""),
    )
