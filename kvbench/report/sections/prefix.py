"""Report section for prefix caching (rows of kvbench.run.requests): time to first token and bytes held vs the number
of requests, with and without the prefix cache; hit rate; compress-once vs per-question quality per method and
budget. Torch-free (the report must not import torch)."""

from __future__ import annotations

import html

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from kvbench.guide.selection import CHANGES_MODEL, PRECISION
from kvbench.report.section import Context, Section, report_section, save_figure
from kvbench.report.tables import small_table
from kvbench.store.aggregate import FULL
from kvbench.store.intervals import interval_text, mean_interval
from kvbench.tasks.facts import task_facts

MiB = 2**20


def _mode(rows: pd.DataFrame) -> pd.Series:
    """'no prefix cache' | 'prefix cache' | 'compress once' per row."""
    cached = rows["prefix_cache"].fillna(False).astype(bool) if "prefix_cache" in rows else False
    once = rows["reuse"].eq("compress_once") if "reuse" in rows else False
    return pd.Series("no prefix cache", index=rows.index).mask(cached, "prefix cache").mask(once, "compress once")


@report_section("Prefix caching: time to first token and memory vs requests", needs=["reused_tokens", "held_bytes"])
def prefix_reuse(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
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
        path = context.out_dir / f"prefix_{task}.png"
        save_figure(fig, path)
        files.append(path)
    note = (
        "<p>held = the prefix cache's pages (each once) + every request's own cache so far, as if all stayed "
        "resident; TTFT = prefill_s (lookup, prefill of the uncached rest, compression). Timings compare "
        "runs of one machine; ratios within one run are the reliable figures.</p>"
    )
    table_html, table_md = small_table(table)
    return Section(
        html=note + table_html,
        markdown=html.unescape(note.replace("<p>", "").replace("</p>", "\n\n")) + table_md,
        files=files,
    )


def _keeps_every_token(label: str) -> bool:
    """Whether a configuration (its variant label, kvbench.store.aggregate.variant_label: `kivi(bits=2)`,
    `compose(snapkv+kivi)`) has no token budget: the full cache, quantization, head merging (kvbench.guide.selection's
    sets)."""
    name, _, knobs = label.partition("(")
    parts = knobs.rstrip(")").split("+") if name == "compose" else [name]
    return all(p in PRECISION | CHANGES_MODEL | {FULL} for p in parts)


def _held_MB(pair: pd.DataFrame, side: str) -> float:
    """Bytes held after the last paired request, each run's last value averaged over runs (as prefix_reuse)."""
    last = pair.sort_values(f"request_index_{side}").groupby(f"run_id_{side}", sort=False)[f"held_bytes_{side}"]
    return last.last().mean() / 1e6


def compare(per_question: pd.DataFrame, once: pd.DataFrame) -> pd.DataFrame:
    """Compress once vs per question, paired per request (example_id) within (task, method, budget), `method` the
    variant label: n, mean score with its 95 % interval in the task's score range, how many requests compress-once
    answered better / worse, the partial score where the task has one ("" otherwise) and the bytes held after the
    last paired request. Cells are text, as `python -m kvbench.bench compare_reuse` prints them (the README's
    tables)."""
    keys = ["task", "method", "budget"]
    pairs = per_question.merge(once, on=[*keys, "example_id"], suffixes=("_pq", "_once"))
    out = []
    for (task, method, budget), pair in pairs.groupby(keys, sort=False, dropna=False):
        score_range = task_facts(task).score_range
        m1, lo1, hi1, _ = mean_interval(pair.score_pq.to_numpy(), score_range)
        m2, lo2, hi2, _ = mean_interval(pair.score_once.to_numpy(), score_range)
        row = {
            "task": task,
            "method": method,
            "budget": "–" if _keeps_every_token(method) else f"{budget:g}",
            "n": len(pair),
            "score per q.": f"{m1:.3f} ({interval_text(lo1, hi1)})",
            "score once": f"{m2:.3f} ({interval_text(lo2, hi2)})",
            "once better/worse": f"{(pair.score_once > pair.score_pq).sum()}/{(pair.score_once < pair.score_pq).sum()}",
            "partial per q. / once": (
                f"{pair.score_partial_pq.mean():.3f} / {pair.score_partial_once.mean():.3f}"
                if "score_partial_pq" in pair and pair.score_partial_pq.notna().any()
                else ""
            ),
            "held MB per q. / once": f"{_held_MB(pair, 'pq'):.1f} / {_held_MB(pair, 'once'):.1f}",
        }
        out.append(row)
    return pd.DataFrame(out)


def prefix_cached(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows run with the prefix cache (both reuse modes): a run without it also writes reuse=per_question."""
    return rows[_mode(rows) != "no prefix cache"]


@report_section("Compress once vs per question", needs=["reuse"])
def compress_once(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    rows = prefix_cached(rows).sort_values("request_index")  # `method` carries the variant (kivi bits=2 and 4 apart)
    table = compare(rows[rows["reuse"] == "per_question"], rows[rows["reuse"] == "compress_once"])
    if table.empty:
        return None
    table = table.loc[:, (table != "").any()]  # no partial score in any task: no column
    note = (
        "<p>Both with the prefix cache, paired per request (example_id). per q. (reuse=per_question): each "
        "prompt compressed with its question (query-aware); once (reuse=compress_once): the shared context "
        "compressed once without the question, every question answered from it. score: mean with its 95 % "
        "interval; once better/worse: requests compress-once answered better / worse; held: bytes held after the "
        "last paired request (the prefix cache once + every request's own cache), each run's last value averaged "
        "over runs.</p>"
    )
    table_html, table_md = small_table(table)
    return Section(html=note + table_html, markdown=html.unescape(note[3:-4]) + "\n\n" + table_md)
