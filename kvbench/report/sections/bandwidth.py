"""The report's bandwidth-bound section (kvbench.report.section): each decoding configuration's step against the
machine's memory bandwidth, from rows' `step_bytes`, `decode_ms_per_token` and `bandwidth_share`
(kvbench.native.bandwidth). A share near 1: the step streams its bytes as fast as the memory allows, and two methods'
latencies differ by the bytes they hold; well below 1: compute or overhead bounds the step, and a latency difference
may be neither method's cache. Torch-free."""

from __future__ import annotations

import html

import pandas as pd

from kvbench.guide.selection import markdown
from kvbench.report.section import Context, Section, report_section, save_figure
from kvbench.store.aggregate import with_lengths

KEYS = ["model", "dtype", "device_name", "length", "method", "budget"]


@report_section("Decode against the bandwidth bound", needs=["bandwidth_share", "step_bytes"], where="tables")
def bandwidth_bound(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    decoding = with_lengths(rows[rows["bandwidth_share"].notna()])
    if not len(decoding):
        return None
    keys = [k for k in KEYS if k in decoding]
    size = decoding["batch_size"].fillna(1).astype(int) if "batch_size" in decoding else 1
    table = (
        decoding.assign(batch_size=size)
        .groupby(keys, dropna=False, sort=True)
        .agg(
            batch_size=("batch_size", "max"),
            ms_per_step=("decode_ms_per_token", "mean"),
            step_MB=("step_bytes", lambda b: b.mean() / 1e6),
            bandwidth_share=("bandwidth_share", "mean"),
            n=("bandwidth_share", "size"),
        )
        .reset_index()
    )
    note = (
        "One decode step reads the weights and the K/V it attends over (a grid step of batch_size rows: the weights "
        "once and every row's K/V): step_MB. bandwidth_share = those bytes over the step time over the machine's "
        "memory bandwidth (probed once per machine, the rows' memory_bandwidth). Near 1 the step is at the "
        "physical floor; well below 1 compute or overhead bounds it."
    )
    files = [share_plot(table, context)]
    return Section(
        html=f"<p>{html.escape(note)}</p>" + table.to_html(index=False, float_format=lambda v: f"{v:.3g}"),
        markdown=note + "\n\n" + markdown(table),
        files=files,
    )


def share_plot(table: pd.DataFrame, context: Context):
    """bandwidth_share against step_MB, one point per configuration and length, one marker per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for method, part in table.groupby("method", sort=True):
        ax.scatter(part["step_MB"], part["bandwidth_share"], label=str(method), s=24)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("bytes one decode step reads (MB)")
    ax.set_ylabel("share of the bandwidth bound")
    ax.set_ylim(0, max(1.05, float(table["bandwidth_share"].max()) * 1.1))
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, context.out_dir / "bandwidth_share.png", tight=True)
