"""Report section for prefix caching (rows of kvbench.workload): time to first token and bytes held vs the number
of requests, with and without the prefix cache; hit rate; compress-once vs per-question quality per method and
budget. Torch-free (the report must not import torch)."""

from __future__ import annotations

import html
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from kvbench.report_sections import Section, report_section

MiB = 2**20


def _mode(rows: pd.DataFrame) -> pd.Series:
    """'no prefix cache' | 'prefix cache' | 'compress once' per row."""
    cached = rows["prefix_cache"].fillna(False).astype(bool) if "prefix_cache" in rows else False
    once = rows["reuse"].eq("compress_once") if "reuse" in rows else False
    return pd.Series("no prefix cache", index=rows.index).mask(cached, "prefix cache").mask(once, "compress once")


def _table(frame: pd.DataFrame) -> tuple[str, str]:
    """(html, markdown) of a small table, numbers to 3 significant digits."""
    cells = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row] for row in frame.itertuples(index=False)]
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in cells)
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(v.replace("|", "\\|") for v in row) + " |" for row in cells]
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>", "\n".join(lines)


@report_section("Prefix caching: time to first token and memory vs requests", needs=["reused_tokens", "held_bytes"])
def prefix_reuse(rows: pd.DataFrame, summary: pd.DataFrame, out_dir: Path) -> Section | None:
    rows = rows.assign(mode=_mode(rows)).sort_values(["run_id", "request_index"])
    table = (
        rows.groupby(["task", "method", "budget", "mode"], sort=False)
        .apply(
            lambda g: pd.Series(
                {
                    "requests": len(g),
                    "hit_rate": g.reused_tokens.sum() / (g.reused_tokens + g.prefill_tokens).sum(),
                    "prefill_tokens": g.prefill_tokens.sum(),
                    "ttft_s_total": g.prefill_s.sum(),
                    "held_MiB_last": g.groupby("run_id").held_bytes.last().mean() / MiB,
                    "score": g.score.mean(),
                }
            ),
            include_groups=False,
        )
        .reset_index()
    )
    files = []
    for task, part in rows.groupby("task", sort=False):
        fig, (ttft, held) = plt.subplots(1, 2, figsize=(10, 3.6))
        for (method, budget, mode, _run), g in part.groupby(["method", "budget", "mode", "run_id"], sort=False):
            label = f"{method} b={budget:g}, {mode}"
            style = "-" if mode == "no prefix cache" else "--"
            ttft.plot(g.request_index, g.prefill_s.cumsum(), style, marker=".", label=label)
            held.plot(g.request_index, g.held_bytes / MiB, style, marker=".", label=label)
        ttft.set(xlabel="request", ylabel="Σ time to first token (s)", title=f"{task}: TTFT")
        held.set(xlabel="request", ylabel="bytes held (MiB)", title=f"{task}: caches held, shared pages once")
        held.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"prefix_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    note = (
        "<p>held = the prefix cache's pages (each once) + every request's own cache so far, as if all stayed "
        "resident; TTFT = prefill_s (lookup, prefill of the uncached rest, compression). Timings compare "
        "runs of one machine; ratios within one run are the reliable figures.</p>"
    )
    table_html, table_md = _table(table)
    return Section(
        html=note + table_html,
        markdown=html.unescape(note.replace("<p>", "").replace("</p>", "\n\n")) + table_md,
        files=files,
    )


@report_section("Compress once vs per question", needs=["reuse"])
def compress_once(rows: pd.DataFrame, summary: pd.DataFrame, out_dir: Path) -> Section | None:
    if rows["reuse"].nunique() < 2:
        return None
    rows = rows[_mode(rows) != "no prefix cache"]  # both modes with the prefix cache (compress once needs it)
    rows = rows.sort_values("request_index")  # `method` carries the variant (kivi bits=2 and bits=4 apart)
    keys = ["task", "method", "budget"]
    values = ["score"] + (["score_partial"] if "score_partial" in rows and rows["score_partial"].notna().any() else [])
    per_mode = rows.groupby([*keys, "reuse"], sort=False, dropna=False).agg(
        n=("score", "size"),
        **{v: (v, "mean") for v in values},
        held_MiB=("held_bytes", lambda h: h.iloc[-1] / MiB),  # after the last request: what the workload holds
    )
    wide = per_mode.unstack("reuse")
    if "compress_once" not in wide["n"] or "per_question" not in wide["n"]:
        return None
    wide = wide.dropna(subset=[("n", "compress_once"), ("n", "per_question")])
    table = pd.DataFrame({"task": [k[0] for k in wide.index], "method": [k[1] for k in wide.index]})
    table["budget"] = [k[2] for k in wide.index]
    table["n"] = wide[("n", "per_question")].astype(int).to_numpy()
    for v in [*values, "held_MiB"]:
        table[f"{v} per_question"] = wide[(v, "per_question")].to_numpy()
        table[f"{v} compress_once"] = wide[(v, "compress_once")].to_numpy()
    note = (
        "<p>per_question: each prompt compressed with its question (query-aware); compress_once: the shared "
        "context compressed once without the question, every question answered from it. held_MiB: bytes held "
        "after the last request (the prefix cache once + every request's own cache).</p>"
    )
    table_html, table_md = _table(table)
    return Section(html=note + table_html, markdown=html.unescape(note[3:-4]) + "\n\n" + table_md)
