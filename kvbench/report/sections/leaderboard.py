"""The report's RULER leaderboard (kvpress's protocol, conf/experiment/leaderboard.yaml): per model, setting and
method, the RULER score at each compression ratio (1 − budget) with its 95 % interval, beside what kvpress's
leaderboard does not show: the cache bytes held (measured kv_ratio), the peak memory, prefill and decode time. A
sortable table and kvpress's plot (score vs compression ratio, a line per method, the intervals as bands).
Rows of task=ruler only (the official RULER; task=ruler_synthetic's scores do not compare). Torch-free."""

from __future__ import annotations

import html
import json
import math

import pandas as pd

from kvbench.report.page import Page
from kvbench.report.section import Context, Section, report_section, save_figure
from kvbench.report.tables import MEASURED, Column, fixed, html_table, markdown_table
from kvbench.store.aggregate import method_yaml, press_label, with_lengths
from kvbench.store.intervals import mean_interval

TASK = "ruler"
FULL = "full"
KEYS = ["model", "length", "engine", "query_aware", "method", "budget"]  # length: RULER's, never pooled across


def labels(rows: pd.DataFrame) -> pd.Series:
    """Each row's method as the leaderboard names it: a kvpress press by its class; a method by the knobs that tell
    its lines apart (kivi's bits) or that differ from its conf/method yaml (`rkv(evict_every=128)`); engine options as
    the engine names them."""
    params = rows.get("method_params", pd.Series("{}", index=rows.index)).fillna("{}").map(json.loads)
    out = rows["method"].astype(str).copy()
    press = out.str.split(r"[( ]").str[0] == "kvpress"  # as stored, labelled (kvpress(LagKVPress)) or versioned
    versions = out[press].map(lambda m: m[m.find(" @") :] if " @" in m else "")  # a code version: " @1a2b3c4d"
    out[press] = params[press].map(lambda p: press_label(p.get("press"), p.get("press_kwargs"))) + versions
    for method in set(rows.loc[~press, "method"]):
        mine = params[(rows["method"] == method) & ~press]
        defaults = method_yaml(method.split(" @")[0])  # a label may carry a code version: `kivi @1a2b3c4d`
        differ = sorted(
            k
            for k in set().union(*mine)
            if len({json.dumps(p.get(k)) for p in mine}) > 1
            or any(k in defaults and k in p and p[k] != defaults[k] for p in mine)
        )  # knobs that tell this method's lines apart, or that a line changed from conf/method/<name>.yaml
        if differ:
            out[mine.index] = [f"{method}({','.join(f'{k}={p.get(k)}' for k in differ)})" for p in mine]
    return out


def leaderboard(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per model × engine × setting × method × budget (fractions only): RULER's score (100 × the mean over
    every example of every task, as kvpress averages equal-sized tasks) with its 95 % interval, and the
    measurements. A method without a budget (a quantized cache) stands at the ratio it measured, 1 − kv_ratio."""
    rows = rows[(rows["task"] == TASK) & (rows["budget"] <= 1)]
    if rows.empty:
        return pd.DataFrame()
    engine = rows["engine"] if "engine" in rows else pd.Series("kvbench", index=rows.index)
    rows = with_lengths(rows).assign(engine=engine.fillna("kvbench"), method=labels(rows))
    out = []
    for key, group in rows.groupby(KEYS, dropna=False, sort=True):
        mean, low, high, _ = mean_interval(group["score"], (0.0, 1.0))
        peak = group["peak_mem_bytes"] if "peak_mem_bytes" in group else pd.Series(dtype=float)
        nominal = key[4] == FULL or float(key[5]) < 1
        out.append(
            dict(
                zip(KEYS, key),
                ratio=round(1.0 - float(key[5]), 6) if nominal else round(1.0 - group["kv_ratio"].mean(), 3),
                nominal=nominal,
                n=int(group["score"].notna().sum()),
                tasks=group["subset"].nunique(),
                score=100 * mean,
                ci_low=100 * low,
                ci_high=100 * high,
                kv_ratio=group["kv_ratio"].mean(),
                peak_mem_bytes=peak.max(),
                prefill_s=group["prefill_s"].mean(),
                decode_ms_per_token=group["decode_ms_per_token"].mean(),
                decode_batch=int(group["batch_size"].fillna(1).max()) if "batch_size" in group else 1,
            )
        )
    table = pd.DataFrame(out)
    if table.empty:
        return table
    return table.sort_values(
        ["model", "length", "query_aware", "ratio", "score"], ascending=[True, True, True, True, False]
    )


LENGTH = Column("length", lambda r: r["length"], lambda v: f"{v:,}" if v else "–", title="RULER's length (tokens)")
COLUMNS = [
    Column("model", lambda r: r["model"], left=True),
    LENGTH,
    Column("engine", lambda r: r["engine"], left=True),
    Column("query_aware", lambda r: str(bool(r["query_aware"])).lower(), left=True),
    Column("method", lambda r: r["method"], left=True),
    Column(
        "compression ratio",
        lambda r: r["ratio"],
        lambda v: f"{v:g}",
        title="kvpress's ratio: 1 − budget; a quantized cache (no budget): 1 − its measured kv_ratio",
    ),
    Column("ratio from", lambda r: "budget" if r["nominal"] else "measured", left=True),
    Column("n", lambda r: r["n"], title="examples (every task's samples)"),
    Column("score", lambda r: r["score"], fixed(1), title="RULER's score: 100 × the mean over the n examples"),
    Column(  # its text is tables.interval's (cells() fills this heading from ci_low, ci_high and n)
        "95 % interval",
        lambda r: r["ci_low"],
        title="Wilson for 0/1 scores, bootstrap otherwise; none below 5 examples",
    ),
    *MEASURED,
    Column(
        "decode ms/token",
        lambda r: r["decode_ms_per_token"],
        fixed(1),
        title="one decode step; where decoded with others (batch > 1), the step of the whole batch",
    ),
    Column("batch", lambda r: r["decode_batch"], title="configurations decoded together (grid_batch); 1: alone"),
]


def plot(table: pd.DataFrame, out_dir) -> list:
    """kvpress's leaderboard plot per model × setting: score vs compression ratio, a line per method starting at
    the full cache's score (ratio 0), its 95 % interval as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(table.groupby(["model", "length", "query_aware"], sort=True))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.6), squeeze=False)
    for ax, ((model, length, aware), part) in zip(axes[0], panels):
        fulls = {engine: rows for engine, rows in part[part["method"] == FULL].groupby("engine")}
        full = fulls.get("kvbench", next(iter(fulls.values()), part.iloc[:0]))
        for (engine, method), line in part[part["method"] != FULL].groupby(["engine", "method"], sort=True):
            start = fulls.get(engine, full)
            line = pd.concat([start, line]).sort_values("ratio")  # every line starts at its engine's full cache
            named = engine == "kvbench" or str(method).endswith(f" @{engine}")  # engine_labels named the engine
            label = str(method) if named else f"{method} ({engine})"
            (drawn,) = ax.plot(line["ratio"], line["score"], marker="o", ms=3, label=label)
            band = line.dropna(subset=["ci_low"])
            ax.fill_between(band["ratio"], band["ci_low"], band["ci_high"], color=drawn.get_color(), alpha=0.12)
        if not full.empty:
            ax.axhline(full["score"].iloc[0], color="black", ls="--", lw=0.8, label="full cache")
        ax.set(xlabel="compression ratio (1 − budget)", ylabel="RULER score", ylim=(0, 100))
        at = f" · {length:,} tokens" if length else ""
        ax.set_title(f"{model}{at} · query_aware={str(bool(aware)).lower()}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out_dir / "leaderboard_ruler.png"
    save_figure(fig, path)
    return [path]


@report_section("RULER leaderboard (kvpress's protocol)", needs=["score", "kv_ratio"], where="plots")
def ruler_leaderboard(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    table = leaderboard(rows)
    if table.empty or table["method"].nunique() < 2:
        return None
    few = table["n"] < 5  # greyed: no interval
    note = (
        "RULER (task=ruler) as kvpress's leaderboard ranks methods: score = 100 × the mean over every example of "
        "every task (equal samples per task), at compression ratio = 1 − budget. kv_ratio is the cache the method "
        "really held (kvpress reports the ratio it asked for); a quantized cache, which has no budget, stands at "
        "1 − its measured kv_ratio. Click a header to sort."
    )
    nominal = table.loc[table["nominal"], "ratio"]
    ratios = ", ".join(f"{r:g}" for r in sorted(nominal.unique()) if not math.isclose(r, 0.0))
    files = plot(table, context.out_dir)
    standalone(table, few, note, files, context.out_dir)
    return Section(
        html=f"<p>{html.escape(note)}</p><p>compression ratios: {html.escape(ratios)}; the page alone: "
        "leaderboard.html, leaderboard.md</p>" + html_table(table, COLUMNS, few),
        markdown=note + "\n\n" + markdown_table(table, COLUMNS),
        files=files,
    )


def ratio_column(ratio: float) -> Column:
    return Column(f"{ratio:g}", lambda row: row[ratio], fixed(1), title=f"score at compression ratio {ratio:g}")


def by_ratio(table: pd.DataFrame) -> tuple[pd.DataFrame, list[Column]]:
    """kvpress's board as it reads: a line per model × setting × engine × method, its score at each compression
    ratio in a column (budgets only: a quantized cache's measured ratio is its own), ordered by the mean over the
    ratios it ran; the full cache's line at ratio 0."""
    keys = ["model", "length", "query_aware", "engine", "method"]
    nominal = table[table["nominal"]]
    wide = nominal.pivot_table(index=keys, columns="ratio", values="score", aggfunc="first")  # (lines, ratios)
    ratios = list(wide.columns)
    wide = wide.assign(mean=wide[[r for r in ratios if r > 0]].mean(axis=1)).reset_index()
    wide = wide.assign(compressed=wide["method"] != FULL)  # the full cache's line first
    wide = wide.sort_values(
        ["model", "length", "query_aware", "compressed", "mean"], ascending=[True, True, True, True, False]
    )
    columns = [
        Column("model", lambda r: r["model"], left=True),
        LENGTH,
        Column("query_aware", lambda r: str(bool(r["query_aware"])).lower(), left=True),
        Column("engine", lambda r: r["engine"], left=True),
        Column("method", lambda r: r["method"], left=True),
        *(ratio_column(r) for r in ratios),
        Column("mean", lambda r: r["mean"], fixed(1), title="mean score over the ratios > 0 this line ran"),
    ]
    return wide, columns


def standalone(table: pd.DataFrame, few: pd.Series, note: str, plots: list, out_dir) -> None:
    """The leaderboard as a page of its own (self-contained HTML with the plot inline, and Markdown), to publish:
    the score by compression ratio first, then every line with its interval and measurements."""
    page = Page("RULER leaderboard")
    page.note(note)
    page.images(plots)
    wide, columns = by_ratio(table)
    page.heading(2, "Score by compression ratio")
    page.table(wide, columns)
    page.heading(2, "Every line, with its 95 % interval and measurements")
    page.table(table, COLUMNS, few)
    (out_dir / "leaderboard.html").write_text(page.html([]))
    (out_dir / "leaderboard.md").write_text(page.markdown())
    table.to_csv(out_dir / "leaderboard.csv", index=False, float_format="%.4g")  # the numbers, to compare or plot


# kvbench's leaderboard names → kvpress's press_name (its evaluation/evaluate_registry.py), per setting
KVPRESS_NAMES = {
    (False, "random"): "random",
    (False, "knorm"): "knorm",
    (False, "snapkv"): "snapkv",
    (True, "snapkv"): "snapkv",
    (False, "expected_attention"): "expected_attention",
    (False, "streamingllm"): "streaming_llm",
    (False, "tova"): "tova",
    (False, "h2o"): "observed_attention",
    (False, "pyramidkv"): "pyramidkv",
    (False, "keydiff"): "keydiff",
    (False, "kvzip"): "kvzip",
    (True, "adakv"): "adakv_snapkv",
    (True, "chunkkv"): "chunkkv",
    (False, "LagKVPress"): "lagkv",
    (False, "CURPress"): "cur",
    (False, "AdaKVPress(CompactorPress)"): "adakv_compactor",
    (True, "FinchPress"): "finch",
}


def pair_agreement(ours: pd.DataFrame, theirs: pd.DataFrame) -> pd.DataFrame:
    """Per compression ratio, every pair of methods both leaderboards scored: does the order agree? `ours` is
    leaderboard()'s table (one model, kvbench's engine), `theirs` kvpress's (press_name, query_aware,
    compression_ratio, score). A pair is "same" when both order it alike, "opposite" when not, "tie" when either
    scores the two equal; `apart` when our two 95 % intervals do not overlap (else our order may be noise). Rows:
    ratio, a, b, ours_a, ours_b, theirs_a, theirs_b, verdict, apart."""
    ours = ours[ours["nominal"] & (ours["method"] != FULL)].copy()
    ours["press_name"] = [KVPRESS_NAMES.get((bool(q), m)) for q, m in zip(ours["query_aware"], ours["method"])]
    ours = ours.dropna(subset=["press_name"])
    ours["key"] = ours["press_name"] + ours["query_aware"].map(lambda q: " (query-aware)" if q else "")
    theirs = theirs.assign(
        key=theirs["press_name"] + theirs["query_aware"].map(lambda q: " (query-aware)" if q else "")
    )
    out = []
    for ratio, mine in ours.groupby("ratio"):
        board = theirs[(theirs["compression_ratio"] - ratio).abs() < 1e-6].set_index("key")["score"]
        mine = mine.set_index("key")
        low, high, mine = mine["ci_low"], mine["ci_high"], mine["score"]
        keys = sorted(set(mine.index) & set(board.index))
        for i, a in enumerate(keys):
            for b in keys[i + 1 :]:
                d_ours, d_theirs = mine[a] - mine[b], board[a] - board[b]
                verdict = (
                    "tie" if d_ours == 0 or d_theirs == 0 else "same" if (d_ours > 0) == (d_theirs > 0) else "opposite"
                )
                apart = bool(low[a] > high[b] or low[b] > high[a])  # our 95 % intervals do not overlap
                out.append(dict(ratio=ratio, a=a, b=b, ours_a=mine[a], ours_b=mine[b], theirs_a=board[a],
                                theirs_b=board[b], verdict=verdict, apart=apart))  # fmt: skip
    return pd.DataFrame(out)
