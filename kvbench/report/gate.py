"""`python -m kvbench.check RESULTS_DIR [RESULTS_DIR ...] --thresholds FILE`: the CI gate.

Exit 0 when every threshold holds (one `ok` line per entry), 1 when any is violated (one `FAIL` line per
violation, `ok` lines for the entries that hold), 2 on bad input (one `kvbench.check: error:` line on stderr).
The thresholds format is documented in conf/thresholds/example.yaml.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from kvbench import KvbenchError
from kvbench.config.rules import Rule, check_args
from kvbench.store.aggregate import (
    add_results_argument,
    averaged,
    common_examples,
    drop_vs_full,
    fidelity_invalid,
    load_rows,
    with_full_scores,
)
from kvbench.tasks.facts import task_facts

TOP_KEYS = ["description", "thresholds"]
ENTRY_KEYS = [
    "select",
    "min_score",
    "max_drop_vs_full",
    "max_kl_mean",
    "max_kl_p95",
    "min_top1_agreement",
    "min_examples",
]
BOUNDS = ["min_score", "max_drop_vs_full", "max_kl_mean", "max_kl_p95", "min_top1_agreement"]
# fidelity bounds (kvbench.native.fidelity's row columns): the statistic over the selected rows and its comparison
FIDELITY = {
    "max_kl_mean": ("kl_mean", "mean", "<="),  # mean over rows of each answer's mean KL(full ‖ compressed), nats
    "max_kl_p95": ("kl_mean", "p95", "<="),  # the tail: 95th percentile over rows (examples) of the same
    "min_top1_agreement": ("top1_agreement", "mean", ">="),
}
ATOL = 1e-9  # numeric selector values (budget, depth, ...) and bounds are compared with this slack
# a fidelity bound outside its metric's domain holds always or never: refused (the score bounds: `check_score_bounds`)
DOMAIN = {
    "max_kl_mean": (0.0, math.inf, "≥ 0 (KL divergence, nats)"),
    "max_kl_p95": (0.0, math.inf, "≥ 0 (KL divergence, nats)"),
    "min_top1_agreement": (0.0, 1.0, "in [0, 1] (a share of answer tokens)"),
}


@dataclass
class Threshold:
    select: dict
    min_score: float | None = None
    max_drop_vs_full: float | None = None
    max_kl_mean: float | None = None
    max_kl_p95: float | None = None
    min_top1_agreement: float | None = None
    min_examples: int | None = None

    @property
    def label(self) -> str:
        """The selector as YAML flow text, so a FAIL line can be found in the thresholds file."""

        def text(v):
            if isinstance(v, list):
                return "[" + ", ".join(map(text, v)) + "]"
            return str(v).lower() if isinstance(v, bool) else str(v)

        return "{" + ", ".join(f"{k}: {text(v)}" for k, v in self.select.items()) + "}"


def _unknown(keys, valid: list[str], where: str) -> None:
    unknown = sorted(str(k) for k in keys if k not in valid)
    if unknown:
        raise KvbenchError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(valid)}")


BOUND = Rule("float", "a number (finite: a score, or a drop in the metric's units)")
MIN_EXAMPLES = Rule("int", "a positive integer", min=1)


def _checked(value, name: str, where: str, rule: Rule):
    """`value` under `rule`, or one line naming the entry and the key (the shared rules, kvbench.config.rules)."""
    from kvbench.config.rules import _problem

    problem = _problem(value, rule)
    if problem is None and rule.kind == "int" and isinstance(value, float):  # 6.0: a count written as a float
        problem = "is a float, not an integer"
    if problem:
        raise KvbenchError(f"{where}: {name} must be {rule.fix}, got {value!r} ({name} {problem})")
    return value


def load_thresholds(path: Path) -> list[Threshold]:
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise KvbenchError(f"{path}: cannot read thresholds ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise KvbenchError(f"{path}: not UTF-8 text (byte {error.start}); save the thresholds file as UTF-8") from None
    except yaml.YAMLError as error:
        raise KvbenchError(f"{path}: invalid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(document, dict):
        raise KvbenchError(f"{path}: expected a mapping with a `thresholds` list")
    _unknown(document, TOP_KEYS, str(path))
    entries = document.get("thresholds")
    if not isinstance(entries, list) or not entries:
        raise KvbenchError(f"{path}: `thresholds` must be a non-empty list")
    out = []
    for i, entry in enumerate(entries, 1):
        where = f"{path}: thresholds entry {i}"
        if not isinstance(entry, dict):
            raise KvbenchError(f"{where}: expected a mapping with keys {', '.join(ENTRY_KEYS)}")
        _unknown(entry, ENTRY_KEYS, where)
        select = entry.get("select")
        if not isinstance(select, dict):
            raise KvbenchError(f"{where}: `select` must be a mapping column → value or list of values")
        for column, wanted in select.items():
            values = wanted if isinstance(wanted, list) else [wanted]
            if not values or not all(isinstance(v, (str, int, float, bool)) for v in values):
                raise KvbenchError(f"{where}: select.{column} must be a value or a non-empty list of values")
        if not any(b in entry for b in BOUNDS):
            raise KvbenchError(f"{where}: needs at least one of {', '.join(BOUNDS)}")
        threshold = Threshold(select=dict(select))
        for bound in BOUNDS:
            if bound in entry:
                setattr(threshold, bound, _in_domain(float(_checked(entry[bound], bound, where, BOUND)), bound, where))
        if "min_examples" in entry:
            threshold.min_examples = int(_checked(entry["min_examples"], "min_examples", where, MIN_EXAMPLES))
        out.append(threshold)
    return out


def _in_domain(value: float, bound: str, where: str) -> float:
    low, high, text = DOMAIN.get(bound, (-math.inf, math.inf, ""))
    if not low <= value <= high:
        raise KvbenchError(f"{where}: {bound} must be {text}, got {value:g}")
    return value


def check_score_bounds(rows: pd.DataFrame, threshold: Threshold) -> None:
    """min_score inside the selected tasks' score range, max_drop_vs_full inside ± its width (TaskFacts.score_range):
    a bound beyond them holds always or never — one line naming the range."""
    ranges = [task_facts(str(t)).score_range for t in rows["task"].unique()]
    low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
    tasks = ", ".join(sorted(map(str, rows["task"].unique())))
    score, drop = threshold.min_score, threshold.max_drop_vs_full
    if score is not None and not low <= score <= high:
        raise KvbenchError(
            f"selector {threshold.label}: min_score must lie in the score range of {tasks}, [{low:g}, {high:g}], "
            f"got {score:g}"
        )
    if drop is not None and not abs(drop) <= high - low:
        raise KvbenchError(
            f"selector {threshold.label}: max_drop_vs_full must lie in [{low - high:g}, {high - low:g}] (the score "
            f"range of {tasks} is [{low:g}, {high:g}]), got {drop:g}"
        )


def _matches(column: pd.Series, wanted) -> pd.Series:
    """Rows whose value equals `wanted` (or one of a list): numbers within ATOL, booleans as booleans, the
    rest as text."""
    mask = pd.Series(False, index=column.index)
    for value in wanted if isinstance(wanted, list) else [wanted]:
        if pd.api.types.is_bool_dtype(column):
            mask |= column == value if isinstance(value, bool) else False
        elif pd.api.types.is_numeric_dtype(column):
            try:
                number = float(value) if not isinstance(value, bool) else math.nan
            except ValueError:
                continue
            mask |= (column.astype(float) - number).abs() <= ATOL
        else:
            mask |= column.astype(str) == str(value)
    return mask


def select_rows(rows: pd.DataFrame, threshold: Threshold) -> pd.DataFrame:
    _unknown(threshold.select, sorted(rows.columns), f"selector {threshold.label}: columns")
    mask = pd.Series(True, index=rows.index)
    for column, wanted in threshold.select.items():
        mask &= _matches(rows[column], wanted)
    if not mask.any():
        present = "; ".join(
            f"{c} ∈ {{{', '.join(map(str, sorted(rows[c].dropna().unique(), key=str)[:12]))}}}"
            for c in threshold.select
        )
        raise KvbenchError(f"selector {threshold.label} matches no rows (present: {present})")
    return rows[mask]


def one_experiment(rows: pd.DataFrame, threshold: Threshold) -> None:
    """A bound holds for one experiment: rows of several models or dtypes (different config hashes), or one
    configuration's rows from several versions of the code, are not pooled — one line naming what to select."""
    for column in ("model", "dtype"):
        values = sorted(rows[column].astype(str).unique()) if column in rows else []
        if len(values) > 1:
            raise KvbenchError(
                f"selector {threshold.label} pools rows of {len(values)} {column}s ({', '.join(values)}): different "
                f"experiments; add {column}: <one of them> to its select"
            )
    config = rows[["method", "method_params", "budget", "query_aware"]].astype(str).agg("\x1f".join, axis=1)
    codes = rows.groupby(config)["code_fingerprint"].nunique()
    if (codes > 1).any():
        raise KvbenchError(
            f"selector {threshold.label} pools one configuration's rows computed by {int(codes.max())} versions of "
            "the code (code_fingerprint): rerun it with rerun=true, or add code_fingerprint: <one> to its select"
        )


def evaluate(rows: pd.DataFrame, threshold: Threshold) -> tuple[str, list[str]]:
    """(the ok line's measurements, one FAIL line per violated bound). `rows` carry `full_score`.

    A selector spanning several configurations is measured on the examples every one of them ran (the report's
    rule: never pool unlike example sets); the line says how many rows that left out."""
    matched = select_rows(rows, threshold)
    one_experiment(matched, threshold)
    check_score_bounds(matched, threshold)
    selected = common_examples(matched)
    left_out = len(matched) - len(selected)
    n = int(selected["score"].notna().sum())
    note = f"; {left_out} rows left out: not run by every selected configuration" if left_out else ""
    measured, failures = [], []

    def record(what: str, op: str, bound, value, count: int) -> None:
        holds = value >= bound - ATOL if op == ">=" else value <= bound + ATOL
        if holds:
            measured.append(f"{what} {value:.4g} {op} {bound:g}")
        else:
            failures.append(
                f"FAIL {threshold.label}: {what} expected {op} {bound:g}, measured {value:.4g} (n={count}{note})"
            )

    if threshold.min_examples is not None:
        record("examples", ">=", threshold.min_examples, n, n)
    if threshold.min_score is not None:
        record("score", ">=", threshold.min_score, float(selected["score"].mean()), n)
    if threshold.max_drop_vs_full is not None:
        drop, matched = drop_vs_full(selected)
        if matched == 0:
            raise KvbenchError(
                f"selector {threshold.label}: no full-cache rows on the same examples, so "
                "max_drop_vs_full cannot be measured (run the full method too)"
            )
        record("drop_vs_full", "<=", threshold.max_drop_vs_full, drop, matched)
    impossible = fidelity_invalid(selected) != ""  # KL < 0, top-1 agreement > 1: a broken measurement, not gated on
    if impossible.any() and any(getattr(threshold, bound) is not None for bound in FIDELITY):
        note += f"; {int(impossible.sum())} rows with impossible fidelity values left out"
    for bound, (column, statistic, op) in FIDELITY.items():
        if getattr(threshold, bound) is None:
            continue
        values = selected.loc[~impossible, column].dropna() if column in selected else pd.Series(dtype=float)
        if values.empty:
            raise KvbenchError(
                f"selector {threshold.label}: no row has {column} (rows of kvpress presses, prefill=inline or engine "
                f"runs carry none, and rows from before the fidelity columns: rerun them with rerun=true), so "
                f"{bound} cannot be measured"
            )
        value = float(values.quantile(0.95)) if statistic == "p95" else float(values.mean())
        record(
            f"{column} {statistic}" if statistic != "mean" else column,
            op,
            getattr(threshold, bound),
            value,
            len(values),
        )
    return f"ok {threshold.label}: {', '.join(measured)} (n={n}{note})", failures


ARGS = {  # every argument, checked before any row is read (kvbench.config.rules)
    "results": Rule("path", "a result store, run directory or rows .parquet file"),
    "--thresholds": Rule("file", "--thresholds FILE (a YAML file: conf/thresholds/example.yaml)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.check", description=__doc__.split("\n\n")[1])
    add_results_argument(parser)
    parser.add_argument("--thresholds", type=Path, required=True, metavar="FILE", help="thresholds YAML")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on bad usage: return it, as main() promises an int
        return int(exit_.code or 0)
    try:
        check_args(args, ARGS)
        thresholds = load_thresholds(args.thresholds)
        rows = with_full_scores(averaged(load_rows(args.results)))  # an engine's garbage rows: not gated on
        # evaluate every entry before printing any line: bad input anywhere gives exit 2 and no verdicts
        results = [evaluate(rows, t) for t in thresholds]
    except KvbenchError as error:
        print(f"kvbench.check: error: {error}", file=sys.stderr)
        return 2
    for ok_line, failures in results:
        print("\n".join(failures) if failures else ok_line)
    return 1 if any(failures for _, failures in results) else 0
