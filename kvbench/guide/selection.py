"""Which method to pick: per scenario and budget, the configurations ranked by quality with intervals, what they
cost and change, which meet your constraints, and where the evidence is too thin to tell.

    python -m kvbench.guide RESULTS_DIR [--scenario S] [--max-drop D] [--max-kv-ratio R] [--min-n N] [--out DIR]

Reads result rows only (no torch). Per configuration: score with its interval (kvbench.store.aggregate's interval
function), the drop vs the full cache on the same examples with the interval of the paired differences, measured
kv_ratio, prefill time and decode ms/token relative to the full cache on the same examples, whether the method
changes the model (head merging) and whether it needs attention statistics. `fit`: `meets` when the drop's
interval lies within --max-drop and kv_ratio ≤ --max-kv-ratio, `fails` when it lies beyond, `not enough evidence`
when the interval straddles the limit or n < --min-n. `ties` names the configurations whose score intervals overlap
this one's (the ranking between them is not established). Composition candidates: an eviction
configuration and a precision method that each meet --max-drop, whose kv_ratios multiply to within
--max-kv-ratio while neither does alone (untested: run the printed compose command). Exit 0, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

from kvbench import KvbenchError
from kvbench.config.rules import Rule, check_args
from kvbench.store.aggregate import (
    MATCH_KEYS,
    add_results_argument,
    averaged,
    bandwidth_share,
    load_rows,
    lower_is_better,
    state_share,
    variant_label,
    with_experiment_keys,
    with_lengths,
)
from kvbench.store.intervals import NO_INTERVAL_SHORT, interval_text, mean_interval
from kvbench.tasks.facts import task_facts

# what each method does, kept torch-free here (tests/guide/test_guide.py checks them against the method registry)
NEEDS_STATISTICS = {"snapkv", "pyramidkv", "h2o", "adakv", "tova", "expected_attention", "rkv", "kvcrush", "chunkkv"}
CHANGES_MODEL = {"headmerge"}
PRECISION = {"kivi", "hf-quant", "turboquant"}
NO_BUDGET = "none"  # the budget label of methods that keep every token (quantization, head merging)


def _parts(method: str, params: str) -> list[str]:
    """The methods a configuration consists of (a compose stack's parts, else the method itself)."""
    if method == "compose":
        try:
            return list(json.loads(params).get("stack", []))
        except (TypeError, ValueError):
            return []
    return [method]


def guide_table(
    rows: pd.DataFrame, max_drop: float = 0.05, max_kv_ratio: float = 1.0, min_n: int = 5, scenario: str | None = None
) -> pd.DataFrame:
    """One line per (scenario, length, budget, configuration), ranked by score within (scenario, task, length,
    budget): a configuration's rows at 16K and at 32K are two lines (`with_lengths`)."""
    rows = with_lengths(with_experiment_keys(rows))  # ranked on one model, dtype, code version and length's rows
    rows = rows.assign(scenario=rows["scenario"].fillna("(none)") if "scenario" in rows else "(none)")
    if scenario is not None:
        present = sorted(rows["scenario"].unique())
        if scenario not in present:
            raise KvbenchError(f"--scenario {scenario!r} is not in these rows; present: {', '.join(present)}")
        rows = rows[rows["scenario"] == scenario]
    key = rows[MATCH_KEYS].astype(str).agg("\x1f".join, axis=1)
    full = rows[rows["method"] == "full"].assign(key=key).drop_duplicates("key").set_index("key")
    records = []
    experiment = ["model", "dtype", "code_fingerprint"]
    for (scen, task, length, model, dtype, code, method, params, budget), group in rows[
        rows["method"] != "full"
    ].groupby(["scenario", "task", "length", *experiment, "method", "method_params", "budget"], sort=True):
        group_keys = key[group.index]
        matched = group_keys.isin(full.index)
        base = full.loc[group_keys[matched]]
        lower = lower_is_better(task)
        sign = -1.0 if lower else 1.0
        drops = sign * (base["score"].to_numpy() - group.loc[matched, "score"].to_numpy())  # (n_matched,)
        lo, hi = task_facts(task).score_range
        score, low, high, _ = mean_interval(group["score"], (lo, hi))  # kvbench.store.aggregate's intervals
        drop, drop_low, drop_high, _ = mean_interval(drops, (lo - hi, hi - lo))  # paired: Wilson when all 0/1
        parts = _parts(method, params)
        no_budget = all(p in PRECISION | CHANGES_MODEL for p in parts)
        kv_ratio = float(group["kv_ratio"].mean())
        records.append(
            {
                "scenario": scen,
                "task": task,
                "length": length,
                "model": model,
                "dtype": dtype,
                "code_fingerprint": code,
                "budget": NO_BUDGET if no_budget else f"{budget:g}",
                "config": _label(method, params),
                "method": method,
                "method_params": params,
                "n": len(group),
                "metric": group["metric"].iloc[0],
                "score": score,
                "ci_low": low,
                "ci_high": high,
                "drop": drop,
                "drop_low": drop_low,
                "drop_high": drop_high,
                "n_matched": int(matched.sum()),
                "kv_ratio": kv_ratio,
                "state_share": state_share(group),  # a hybrid's constant state: the part of kv_ratio no method moves
                "prefill_vs_full": _ratio(group.loc[matched, "prefill_s"], base["prefill_s"]),
                "decode_vs_full": _ratio(*_timed_alone(group.loc[matched], base)),
                # near 1: its decode streams its bytes at the memory's rate, so decode_vs_full is the bytes it holds
                "bandwidth_share": bandwidth_share(group),
                "changes_model": any(p in CHANGES_MODEL for p in parts),
                "needs_statistics": any(p in NEEDS_STATISTICS for p in parts),
                "fit": _fit(drop_low, drop_high, kv_ratio, int(matched.sum()), max_drop, max_kv_ratio, min_n),
                "lower_is_better": lower,
            }
        )
    table = pd.DataFrame.from_records(records)
    if table.empty:
        raise KvbenchError(
            "no compressed configuration with a full-cache baseline in these rows "
            "(run `python -m kvbench` with a method first)"
        )
    ranked = []
    for _, group in table.groupby(["scenario", "task", "length", "model", "dtype", "budget"], sort=True):
        higher_first = not group["lower_is_better"].all()  # equal scores: the smaller cache first
        group = group.sort_values(["score", "kv_ratio"], ascending=[not higher_first, True]).reset_index(drop=True)
        group["rank"] = range(1, len(group) + 1)
        group["ties"] = [
            ", ".join(o.config for o in group.itertuples() if o.Index != i and _overlap(r, o))
            for i, r in enumerate(group.itertuples())
        ]
        ranked.append(group)
    return pd.concat(ranked, ignore_index=True)


def _label(method: str, params: str) -> str:
    try:
        return variant_label(method, json.loads(params))
    except (TypeError, ValueError):
        return method


def _timed_alone(rows: pd.DataFrame, base: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """decode ms/token of the matched pairs whose decode was timed alone: a row decoded in a batch (grid_batch,
    batch_size; `batch_size` > 1) carries the batch's step time, which says nothing about its own method's speed."""
    if "batch_size" not in rows or "batch_size" not in base:
        return rows["decode_ms_per_token"], base["decode_ms_per_token"]
    alone = (rows["batch_size"].fillna(1).to_numpy() == 1) & (base["batch_size"].fillna(1).to_numpy() == 1)
    return rows["decode_ms_per_token"][alone], base["decode_ms_per_token"][alone]


def _ratio(values: pd.Series, full: pd.Series) -> float:
    return float(values.mean() / full.mean()) if len(values) and full.mean() > 0 else math.nan


def _overlap(a, b) -> bool:
    return not (math.isnan(a.ci_low) or math.isnan(b.ci_low)) and a.ci_low <= b.ci_high and b.ci_low <= a.ci_high


def _fit(drop_low, drop_high, kv_ratio, n, max_drop, max_kv_ratio, min_n) -> str:
    if kv_ratio > max_kv_ratio:
        return "fails (kv_ratio)"
    if n < min_n or math.isnan(drop_low):
        return f"not enough evidence (n={n})"
    if drop_high <= max_drop:
        return "meets"
    if drop_low > max_drop:
        return "fails (drop)"
    return "not enough evidence (interval straddles --max-drop)"


def compositions(table: pd.DataFrame, max_drop: float, max_kv_ratio: float) -> pd.DataFrame:
    """Eviction × precision pairs that each keep quality (drop ≤ max_drop) and together fit the kv budget."""
    records = []
    for (scen, task, length, _, _), group in table.groupby(["scenario", "task", "length", "model", "dtype"], sort=True):
        good = group[(group["drop"] <= max_drop) & (group["method"] != "compose")]
        precision = good[good["method"].isin(PRECISION)]
        eviction = good[~good["method"].isin(PRECISION | CHANGES_MODEL)]
        for e in eviction.itertuples():
            for p in precision.itertuples():
                product = e.kv_ratio * p.kv_ratio
                if product <= max_kv_ratio < min(e.kv_ratio, p.kv_ratio):
                    records.append(
                        {
                            "scenario": scen,
                            "task": task,
                            "length": length,
                            "eviction": f"{e.config}@{e.budget}",
                            "precision": p.config,
                            "kv_ratio_product": product,
                            "drops": f"{e.drop:.3f} + {p.drop:.3f}",
                            "try": f"python -m kvbench method=compose 'method.stack=[{e.method},{p.method}]' "
                            f"budget={e.budget}",
                        }
                    )
    return pd.DataFrame.from_records(records)


def markdown(table: pd.DataFrame) -> str:
    """A Markdown table (floats to 3 decimals) without the optional `tabulate` dependency."""

    def cell(v) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(str, table.columns)) + " |", "|" + "---|" * len(table.columns)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in table.itertuples(index=False)])


COLUMNS = [
    "rank",
    "config",
    "n",
    "score",
    "score_ci95",
    "drop",
    "drop_ci95",
    "kv_ratio",
    "prefill_vs_full",
    "decode_vs_full",
    "bandwidth_share",
    "changes_model",
    "needs_statistics",
    "fit",
    "ties",
]


def with_interval_texts(table: pd.DataFrame) -> pd.DataFrame:
    """The guide's printed intervals, score_ci95 and drop_ci95, as text (`0.354–0.879`, or that n is too small
    for one): the bounds' own columns stay numbers (guide.csv)."""

    def texts(low: str, high: str) -> list[str]:
        return [interval_text(lo, hi, digits=3, short=False) for lo, hi in zip(table[low], table[high])]

    return table.assign(score_ci95=texts("ci_low", "ci_high"), drop_ci95=texts("drop_low", "drop_high"))


def render(table: pd.DataFrame, combos: pd.DataFrame, as_markdown: bool = False) -> str:
    """The guide as text (or Markdown): one block per (scenario, task, length, budget), then composition
    candidates."""
    out = []
    several = table["model"].nunique() > 1 or table["dtype"].nunique() > 1
    for (scen, task, length, model, dtype, budget), group in table.groupby(
        ["scenario", "task", "length", "model", "dtype", "budget"], sort=True
    ):
        on = f" — {model} ({dtype})" if several else ""  # each block ranks one model's rows in one dtype
        at = f" at {length:,} tokens" if length else ""
        metric = group["metric"].iloc[0]
        head = f"{scen} — {task}{at}{on} — budget {budget} ({metric}; drop = loss vs full, same examples)"
        body = with_interval_texts(group)[with_state_share(COLUMNS, group)]
        out.append(
            f"### {head}\n\n{markdown(body)}"
            if as_markdown
            else f"== {head}\n{body.to_string(index=False, float_format=lambda v: f'{v:.3f}')}"
        )
    out.append(("### " if as_markdown else "== ") + "composition candidates (untested)")
    if combos.empty:
        out.append("none: no eviction × precision pair that keeps quality fits --max-kv-ratio where neither part does")
    else:
        out.append(markdown(combos) if as_markdown else combos.to_string(index=False))
    return "\n\n".join(out)


def report_summary(rows: pd.DataFrame, max_drop: float = 0.05, max_kv_ratio: float = 1.0) -> pd.DataFrame:
    """The guide in one line per (scenario, task, length, budget): the best-ranked configuration, its interval, and
    whether it is established (empty when the rows hold no compressed configuration with a baseline). For the report."""
    try:
        table = guide_table(rows, max_drop, max_kv_ratio)
    except KvbenchError:
        return pd.DataFrame()
    best = table[table["rank"] == 1].copy()
    best["score [95% CI]"] = [score_with_interval(r.score, r.ci_low, r.ci_high) for r in best.itertuples()]
    best["ties"] = best["ties"].replace("", "none")
    columns = ["scenario", "task", "budget", "config", "n", "score [95% CI]", "drop", "kv_ratio", "fit", "ties"]
    if best["model"].nunique() > 1 or best["dtype"].nunique() > 1:
        columns[2:2] = ["model", "dtype"]
    if best["length"].any():
        columns.insert(2, "length")
    return best[with_state_share(columns, best)]


def with_state_share(columns: list[str], table: pd.DataFrame) -> list[str]:
    """`columns` with `state_share` after kv_ratio where a hybrid model's rows hold a state (its share of the bytes
    held: the part of kv_ratio no method can move); `bandwidth_share` only where some row measured it."""
    if table["bandwidth_share"].isna().all():
        columns = [c for c in columns if c != "bandwidth_share"]
    if not (table["state_share"].fillna(0) > 0).any():
        return columns
    at = columns.index("kv_ratio") + 1
    return columns[:at] + ["state_share"] + columns[at:]


ARGS = {  # every argument, checked before any row is read (kvbench.config.rules)
    "results": Rule("path", "a result store, run directory or rows .parquet file"),
    "--scenario": Rule("str", "--scenario NAME (a value of the rows' scenario column)", nullable=True),
    "--max-drop": Rule("float", "--max-drop 0.05 (the largest acceptable loss vs full, ≥ 0)", min=0),
    "--max-kv-ratio": Rule("float", "--max-kv-ratio 0.5 (the largest acceptable measured kv_ratio, > 0)", above=0),
    "--min-n": Rule("int", "--min-n 5 (fewer matched examples: not enough evidence)", min=1),
    "--out": Rule("out_dir", "--out DIR (a directory guide.md and guide.csv can be written to)", nullable=True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.guide", description=__doc__.split("\n\n")[0])
    add_results_argument(parser)
    parser.add_argument("--scenario", help="only this scenario tag (rows' `scenario` column)")
    parser.add_argument("--max-drop", type=float, default=0.05, help="largest acceptable loss vs full (metric units)")
    parser.add_argument("--max-kv-ratio", type=float, default=1.0, help="largest acceptable measured kv_ratio")
    parser.add_argument("--min-n", type=int, default=5, help="fewer matched examples: not enough evidence")
    parser.add_argument("--out", type=Path, help="also write guide.md and guide.csv here")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        check_args(args, ARGS)
        table = guide_table(
            averaged(load_rows(args.results)), args.max_drop, args.max_kv_ratio, args.min_n, args.scenario
        )
        combos = compositions(table, args.max_drop, args.max_kv_ratio)
        if args.out:
            from kvbench.store.results import check_writable, write_atomic, write_csv

            check_writable(args.out)
            text = render(table, combos, as_markdown=True)
            write_atomic(args.out / "guide.md", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
            write_csv(table, args.out / "guide.csv")
    except KvbenchError as error:
        print(f"kvbench.guide: error: {error}", file=sys.stderr)
        return 2
    print(render(table, combos))
    return 0


def score_with_interval(score: float, low: float, high: float) -> str:
    """`0.444 [0.189, 0.733]`, or `0.444 (n<5: no interval)` where there is none."""
    return f"{score:.3f} ({NO_INTERVAL_SHORT})" if math.isnan(low) else f"{score:.3f} [{low:.3f}, {high:.3f}]"
