"""The report's tables: which columns (a default set people read, the rest behind the page's "all columns"
toggle), to what precision, and their HTML (sortable, greyed rows below 5 examples) and Markdown forms."""

from __future__ import annotations

import html
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from kvbench.store.intervals import MIN_N, interval_text

MiB = 2**20


def _nan(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def fixed(digits: int, signed: bool = False) -> Callable:
    def text(v):
        return "—" if _nan(v) else f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}"

    return text


def mib(v) -> str:
    return "—" if _nan(v) else f"{v / MiB:,.1f}" if v < 100 * MiB else f"{v / MiB:,.0f}"


def seconds(v) -> str:
    return "—" if _nan(v) else f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def interval(row) -> str:
    if _nan(row["ci_low"]) and row["n"] >= MIN_N:
        return "—"  # no interval for another reason than n (no scores)
    return interval_text(row["ci_low"], row["ci_high"])


@dataclass
class Column:
    heading: str
    value: Callable[[pd.Series], Any]  # the sort key (numbers sort numerically)
    text: Callable[[Any], str] = str
    default: bool = True  # False: behind the "all columns" toggle
    title: str = ""  # the header's tooltip
    left: bool = False  # text, aligned left (numbers align right)

    def cls(self) -> str:
        names = ([] if self.default else ["more"]) + (["l"] if self.left else [])
        return f' class="{" ".join(names)}"' if names else ""


MEASURED = [  # what a row measured beside its score: every summary shows these
    Column("kv_ratio", lambda r: r["kv_ratio"], fixed(3), title="measured cache bytes / full cache bytes"),
    Column("peak MiB", lambda r: r["peak_mem_bytes"], mib, title="peak device memory during an example"),
    Column("prefill s", lambda r: r["prefill_s"], seconds, title="prefill including compression"),
]


def summary_columns(
    part: pd.DataFrame, *, subset: bool = False, model: bool = False, tasks: bool = False, setting: bool = False
) -> list[Column]:
    cols = [Column("model", lambda r: r["model"])] if model else []
    cols += [Column("subset", lambda r: r["subset"])] if subset else []
    cols += [
        Column("method", lambda r: r["method"]),
        Column(
            "budget",
            lambda r: r["budget"],
            lambda v: f"{v:g}",
            title="fraction of the prompt's tokens kept (an integer: tokens); 1 for methods without eviction",
        ),
        Column("n", lambda r: r["n"], title="examples pooled"),
        Column("score", lambda r: r["score"], fixed(3), title="mean score over the n examples"),
        Column(
            "95 % interval",
            lambda r: r["ci_low"],
            str,
            title="Wilson for 0/1 scores, bootstrap otherwise; none below 5 examples",
        ),
        Column(
            "drop vs full",
            lambda r: math.nan if r["method"] == "full" else r["drop_vs_full"],
            fixed(3, signed=True),
            title="full-cache mean minus this mean on the same examples (perplexity: negative = worse)",
        ),
        *MEASURED,
        Column(
            "decode ms/token",
            lambda r: r["decode_ms_per_token"],
            fixed(1),
            title="rows decoded in a batch (batch_size > 1: by default a grid of several configurations, "
            "grid_batch; or batch_size) carry the batch's step time; compare methods' decode speed with "
            "grid_batch=false",
        ),
    ]
    if tasks:
        cols.append(Column("tasks", lambda r: r["tasks"], left=True, title="tasks the examples come from"))
    if setting:
        cols.append(Column("query_aware", lambda r: str(bool(r["query_aware"])).lower(), left=True))
    if "state_share" in part and (part["state_share"].fillna(0) > 0).any():  # a hybrid model's rows
        cols.append(
            Column(
                "state share",
                lambda r: r["state_share"],
                fixed(3),
                title="share of the bytes held that is the model's linear-attention/Mamba/conv state, which no KV "
                "method shrinks (kv_ratio cannot go below it)",
            )
        )
    if "score_partial" in part and part["score_partial"].notna().any():
        cols.append(Column("partial score", lambda r: r["score_partial"], fixed(3), default=False))
    cols += [
        Column("kv MiB", lambda r: r["kv_bytes"], mib, default=False),
        Column("n matched", lambda r: r["n_matched"], default=False, title="examples the full cache also ran"),
        Column("interval method", lambda r: r["ci_method"] or "—", default=False),
    ]
    return cols


def cells(part: pd.DataFrame, columns: list[Column]) -> list[list[tuple[object, str]]]:
    """(sort key, text) per cell."""
    out = []
    for _, row in part.iterrows():
        line = []
        for column in columns:
            if column.heading == "95 % interval":
                line.append((row["ci_low"], interval(row)))
            else:
                value = column.value(row)
                line.append((value, column.text(value)))
        out.append(line)
    return out


def html_table(part: pd.DataFrame, columns: list[Column], few: pd.Series | None = None, cls: str = "") -> str:
    """A sortable table (click a header); `few` marks rows to grey out (fewer than MIN_N examples)."""
    head = "".join(f"<th{c.cls()}{_title(c)}>{html.escape(c.heading)}</th>" for c in columns)
    rows = []
    grey = list(few) if few is not None else [False] * len(part)
    for line, is_few in zip(cells(part, columns), grey):
        tds = "".join(f"<td{c.cls()}{_sort_key(key)}>{html.escape(text)}</td>" for c, (key, text) in zip(columns, line))
        rows.append(f"<tr{' class=few' if is_few else ''}>{tds}</tr>")
    return (
        f'<div class=wrap><table class="sortable {cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}'
        f"</tbody></table></div>"
    )


def _title(c: Column) -> str:
    return f' title="{html.escape(c.title)}"' if c.title else ""


def _sort_key(key) -> str:
    if isinstance(key, bool) or _nan(key) or not isinstance(key, (int, float)):
        return ""
    return f' data-v="{key:.12g}"'


def markdown_table(part: pd.DataFrame, columns: list[Column]) -> str:
    shown = [c for c in columns if c.default]
    lines = ["| " + " | ".join(c.heading for c in shown) + " |", "|" + "---|" * len(shown)]
    for line in cells(part, columns):
        texts = [text for c, (_, text) in zip(columns, line) if c.default]
        lines.append("| " + " | ".join(t.replace("|", "\\|").replace("\n", " ") for t in texts) + " |")
    return "\n".join(lines)


def plain_columns(frame: pd.DataFrame) -> list[Column]:
    """Columns for an already formatted frame (provenance): each cell as it is."""
    return [Column(str(c), operator.itemgetter(c), left=True) for c in frame.columns]


def small_table(frame: pd.DataFrame) -> tuple[str, str]:
    """(html, markdown) of a small table, numbers to 3 significant digits."""
    cells = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row] for row in frame.itertuples(index=False)]
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in cells)
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(v.replace("|", "\\|") for v in row) + " |" for row in cells]
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>", "\n".join(lines)
