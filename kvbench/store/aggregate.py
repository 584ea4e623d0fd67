"""Pure aggregation of result rows, shared by `kvbench.report.build`, `kvbench.report.gate` and the runner's printout:
loading + schema check, configuration labels, means with intervals, drop vs the full cache on matched examples,
knees and Pareto frontiers. Torch-free.

Levels of the summary (column `level`):
- "subset":   one row per (model, task, length, subset, method, budget, query_aware);
- "scenario": pooled over the subsets of one scenario (rows carrying `scenario`: RULER, LongBench);
- "task":     pooled over the task's subsets (subset = ALL);
- "overall":  pooled over every task whose score is higher-is-better (task = subset = ALL), per length with
              several tasks at it.
`length` (`with_lengths`) is a key of every level: rows at 16K and at 32K are never pooled.
Pooling is over examples (a micro average). Fair comparisons only: inside each scope (model, task, subset,
query_aware of a level) the configurations are compared on the same examples (`compared` = True, see
`_comparison`); a configuration that ran on only part of them is kept apart (`compared` = False) with its own
n and the tasks it covers (`tasks`), and must never be ranked against the compared ones. Intervals: Wilson for
0/1 scores, bootstrap otherwise, inside the task's score range, none below 5 examples (kvbench.store.intervals).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench import KvbenchError
from kvbench.store.intervals import mean_interval
from kvbench.store.results import COLUMNS, SCHEMA_VERSION, read_rows
from kvbench.tasks.facts import task_facts

# Rows are one experiment only if they share the model, the resolved dtype (float32 and bfloat16 runs of one
# configuration have different config hashes) and the code that computed them (`code_fingerprint`): those are group
# keys everywhere, so two n=3 runs never pool to n=6. The machine (`device_name`) changes timings, not scores: a
# group computed on several machines reports no pooled latency (`machines` > 1).
EXPERIMENT_KEYS = ["engine", "dtype", "code_fingerprint"]  # engine: kvbench or a serving engine (its own baseline)
GROUP_KEYS = [
    "model",
    "engine",
    "dtype",
    "task",
    "length",
    "subset",
    "method",
    "budget",
    "query_aware",
    "code_fingerprint",
]
# an example of a method is compared with the full cache's result on the same example in the same setting
MATCH_KEYS = ["model", "engine", "dtype", "task", "subset", "query_aware", "example_id"]
CONFIG_KEYS = [
    "model",
    "engine",
    "dtype",
    "method",
    "budget",
    "query_aware",
    "code_fingerprint",
]  # one configuration's rows
EXAMPLE_KEYS = ["task", "subset", "example_id"]  # one example
# one configuration whatever code computed it: what `without_reproduced` compares across code versions
REPRODUCE_KEYS = ["model", "engine", "dtype", "task", "method", "method_params", "budget", "query_aware"]
SCOPE_KEYS = [
    "level",
    "model",
    "engine",
    "dtype",
    "task",
    "length",
    "subset",
    "query_aware",
]  # one curve per method inside a scope
TIMING = ["prefill_s", "decode_ms_per_token"]
ALL = "(all)"
FULL = "full"


# ----------------------------------------------------------------------------------------------- loading


def add_results_argument(parser: argparse.ArgumentParser) -> None:
    """The RESULTS_DIR... positional of every command that reads rows with `load_rows`."""
    parser.add_argument(
        "results",
        nargs="+",
        type=Path,
        metavar="RESULTS_DIR",
        help="result store, run directory or Parquet file (several are merged)",
    )


def load_rows(paths: Iterable[str | Path]) -> pd.DataFrame:
    """Rows from files, run directories or stores; one row per (config_hash, example_id), the newest wins."""
    frames = []
    for path in map(Path, paths):
        if not path.exists():
            raise KvbenchError(f"{path}: no such file or directory")
        try:
            frame = read_rows(path)
        except Exception as error:  # pyarrow/pandas raise many types for a non-Parquet or damaged file
            raise KvbenchError(f"{path}: cannot read result rows ({error})") from None
        if len(frame):
            frames.append(frame)
    if not frames:
        raise KvbenchError(f"no result rows under {', '.join(map(str, paths))} (run `python -m kvbench` first)")
    rows = pd.concat(frames, ignore_index=True)
    validate(rows)
    newest_first = (
        pd.to_datetime(rows["timestamp"], utc=True, errors="coerce").sort_values(ascending=False, kind="stable").index
    )
    rows = rows.loc[newest_first].drop_duplicates(["config_hash", "example_id"])
    return without_reproduced(with_experiment_keys(rows.reset_index(drop=True)))


def without_reproduced(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows (newest first) less those of an older code version that a newer one reproduced: the same configuration
    on every one of the older version's examples, each with the same score. A configuration re-run after an unrelated
    code change is then one experiment again; versions that disagree on an example, or ran different examples (a
    sweep resumed across a code change), stay apart (`code_fingerprint` is a group key)."""
    params = rows["method_params"] if "method_params" in rows else pd.Series("", index=rows.index)
    config = _text_keys(rows.assign(method_params=params), REPRODUCE_KEYS)
    example = _text_keys(rows, EXAMPLE_KEYS)
    score = rows["score"].round(9).astype(object).where(rows["score"].notna(), None)
    dropped = pd.Series(False, index=rows.index)
    for _, group in rows.groupby(config, sort=False):
        versions = list(dict.fromkeys(group["code_fingerprint"]))  # newest first, as the rows are ordered
        index = {v: group.index[group["code_fingerprint"] == v] for v in versions}
        results = {v: dict(zip(example[i], score[i])) for v, i in index.items()}  # example → score, per version
        for n, older in enumerate(versions[1:], start=1):
            if any(results[older].items() <= results[newer].items() for newer in versions[:n]):
                dropped[index[older]] = True
    return rows[~dropped].reset_index(drop=True)


def with_lengths(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows with `length`: the context length the task asked for (`length_target`: RULER's and NIAH's grid, ppl's
    window), 0 where a task has none. A key of every comparison: a configuration at 16K and at 32K is two lines.
    The requested length, not the token count, which differs per example."""
    length = rows["length_target"] if "length_target" in rows else pd.Series(0, index=rows.index)
    return rows.assign(length=pd.to_numeric(length, errors="coerce").fillna(0).astype(int))


def with_experiment_keys(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows with every `EXPERIMENT_KEYS` column and `device_name` present as text ("" where a row has none), so
    they group and match (rows written before a column existed form their own group)."""
    out = {}
    for column in EXPERIMENT_KEYS + ["device_name"]:
        missing = "kvbench" if column == "engine" else ""  # rows written before engines were kvbench's own
        values = rows[column] if column in rows else pd.Series(missing, index=rows.index)
        out[column] = values.astype(object).where(values.notna(), missing).astype(str)
    return rows.assign(**out)


def validate(rows: pd.DataFrame) -> None:
    missing = [c for c in COLUMNS if c not in rows.columns]
    if missing:
        raise KvbenchError(f"incompatible result rows: missing columns {', '.join(missing)}")
    if "schema_version" not in rows.columns:
        raise KvbenchError(
            f"incompatible result rows: no schema_version column (this kvbench reads schema_version {SCHEMA_VERSION})"
        )
    versions = set(rows["schema_version"].astype(object).where(rows["schema_version"].notna(), None))
    if versions != {SCHEMA_VERSION}:
        found = ", ".join(sorted(map(str, versions)))
        raise KvbenchError(
            f"incompatible result rows: schema_version {found}, this kvbench reads schema_version {SCHEMA_VERSION}"
        )


# ---------------------------------------------------------------------------------------------- labels


@functools.cache  # every row is labelled: read each yaml once
def method_yaml(name: str) -> dict:
    """The knobs of conf/method/<name>.yaml (without `name`); {} when there is no such file."""
    from omegaconf import OmegaConf

    from kvbench import conf_dir

    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):  # a label (`kivi(bits=4)`, `kvpress(LagKVPress)`), not a yaml's name
        return {}
    path = conf_dir() / "method" / f"{name}.yaml"
    if not path.exists():
        return {}
    knobs = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return {str(k): v for k, v in knobs.items() if k != "name"} if isinstance(knobs, dict) else {}


def press_label(spec, more: dict | None = None) -> str:
    """A kvpress press as given to method=kvpress (a class name, or a mapping naming it with its fields; `more`:
    press_kwargs) by its classes, the presses it wraps first, then the fields it was given: LagKVPress,
    AdaKVPress(CompactorPress), BlockPress(KeyDiffPress, block_size=128).
    Not the fields kvpress resolved (`resolved`)."""
    spec = {**(spec if isinstance(spec, dict) else {"name": spec}), **(more or {})}
    nested = [press_label(v) for k, v in spec.items() if k != "name" and (k == "press" or isinstance(v, dict))]
    fields = [f"{k}={v}" for k, v in sorted(spec.items()) if k != "name" and k != "press" and not isinstance(v, dict)]
    return f"{spec.get('name')}({', '.join(nested + fields)})" if nested or fields else str(spec.get("name"))


def variant_label(name: str, params: dict) -> str:
    """A configuration's short name for tables and plot legends: the method plus the knobs that differ from its
    conf/method/<name>.yaml, e.g. `kivi(bits=2)`, `compose(headmerge+h2o+kivi)`, `kvpress(AdaKVPress(CompactorPress))`
    (a press by its classes and given fields; the fields kvpress resolved stay in method_params)."""
    base, at, version = name.partition(" @")  # with_experiment_labels' code version stays last: `kivi(bits=2) @1a2b`
    if at:
        return f"{variant_label(base, params)} @{version}"
    if name == "compose":
        return f"compose({'+'.join(params.get('stack', []))})"
    if name == "kvpress":
        return f"kvpress({press_label(params.get('press'), params.get('press_kwargs'))})"
    defaults = method_yaml(name)
    changed = {k: v for k, v in params.items() if k not in defaults or defaults[k] != v}
    return f"{name}({','.join(f'{k}={v}' for k, v in sorted(changed.items()))})" if changed else name


def with_experiment_labels(rows: pd.DataFrame) -> pd.DataFrame:
    """Readers that draw one curve per (model, method) — plots, takeaways — see different experiments apart: where the
    rows hold several dtypes the model is labelled with its dtype (`SmolLM2 (float32)`), and a configuration whose
    rows come from several versions of the code is labelled with each one's fingerprint (`snapkv @` + 8 characters)."""
    rows = with_experiment_keys(rows)
    if rows["dtype"].nunique() > 1:
        rows = rows.assign(model=rows["model"].astype(str) + " (" + rows["dtype"] + ")")
    # a length is its own experiment (RULER at 16K and at 32K are two lines, whatever code each ran)
    lengths = ["task", "length_target"] if "length_target" in rows else []
    keys = ["model", "engine", "dtype", "method", "method_params", "budget", "query_aware", *lengths]
    config = _text_keys(rows, keys)
    mixed = config.map(rows.groupby(config)["code_fingerprint"].nunique()) > 1
    if mixed.any():
        suffix = " @" + rows["code_fingerprint"].str[:8]
        rows = rows.assign(method=rows["method"].where(~mixed, rows["method"].astype(str) + suffix))
    return rows


def with_variants(rows: pd.DataFrame) -> pd.DataFrame:
    """Add `variant`: the method with its non-default knobs (kivi bits=2 and bits=4 are different lines)."""
    labels = [variant_label(m, json.loads(p)) for m, p in zip(rows["method"], rows["method_params"])]
    return rows.assign(variant=labels)


def lower_is_better(task: str) -> bool:
    return task_facts(task).lower_is_better


# ------------------------------------------------------------------------------------------- summaries


def with_full_scores(rows: pd.DataFrame) -> pd.DataFrame:
    """Adds `full_score`: the full cache's score on the same example in the same setting (NaN if none ran)."""
    # match on the keys' text: a merge on the columns fails when an all-missing column (e.g. no subsets) reads
    # back as object in one frame and float in another, and None/NaN keys must still match each other
    rows = with_experiment_keys(rows)
    keys = _text_keys(rows, MATCH_KEYS)
    full = rows["score"].where(rows["method"] == FULL).groupby(keys).mean()  # mean skips the non-full NaNs
    return rows.assign(full_score=keys.map(full).to_numpy())


def _text_keys(rows: pd.DataFrame, columns: list[str]) -> pd.Series:
    return pd.Series(
        ["\x1f".join("" if pd.isna(v) else str(v) for v in key) for key in rows[columns].itertuples(index=False)],
        index=rows.index,
        dtype=object,
    )


def drop_vs_full(rows: pd.DataFrame) -> tuple[float, int]:
    """(mean full score − mean score, number of examples) over the rows' examples that the full cache also ran."""
    if "full_score" not in rows:
        raise ValueError("call with_full_scores first")
    matched = rows[rows["full_score"].notna() & rows["score"].notna()]
    if matched.empty:
        return math.nan, 0
    return float((matched["full_score"] - matched["score"]).mean()), len(matched)


def common_examples(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows restricted to the examples every configuration among them ran (configuration = model, method,
    budget, query_aware; example = task, subset, example_id): the fair basis for pooling several of them."""
    config, example = _text_keys(rows, CONFIG_KEYS), _text_keys(rows, EXAMPLE_KEYS)
    sets = [set(example[config == c]) for c in config.unique()]
    shared = set.intersection(*sets) if sets else set()
    return rows[example.isin(shared)]


def _comparison(scope: pd.DataFrame) -> pd.Series:
    """Per row of one scope: True when its configuration is compared on the scope's common examples, False when
    it ran only part of them; rows of compared configurations outside the common examples are dropped (NaN).

    The common examples are one configuration's example set: the one covering the most tasks, then ranking
    the most (configurations that ran all of it × its size), then the full cache's. Configurations that ran
    all of it are compared on exactly it; the others are shown apart, on their own examples."""
    config = _text_keys(scope, ["method", "budget", "code_fingerprint"])
    example = _text_keys(scope, ["task_of_example", "subset_of_example", "example_id"])
    sets = {c: frozenset(example[config == c]) for c in config.unique()}
    tasks = {c: scope.loc[config == c, "task_of_example"].nunique() for c in sets}

    def rank(c):
        covering = sum(s >= sets[c] for s in sets.values())
        return tasks[c], covering * len(sets[c]), c.startswith(FULL + "\x1f"), len(sets[c])

    core = sets[max(sorted(sets), key=rank)]
    compared = {c for c, s in sets.items() if s >= core}
    in_core = example.isin(core)
    out = pd.Series(False, index=scope.index, dtype=object)
    out[config.isin(compared) & in_core] = True
    out[config.isin(compared) & ~in_core] = None  # extra examples of a compared configuration: left out
    return out


def _pool(rows: pd.DataFrame, level: str, confidence: float) -> list[dict]:
    rows = rows.assign(compared=None)
    for _, scope in rows.groupby(
        ["model", "engine", "dtype", "task", "length", "subset", "query_aware"], dropna=False, sort=False
    ):
        rows.loc[scope.index, "compared"] = _comparison(scope)
    rows = rows[rows["compared"].notna()]
    out = []
    for key, group in rows.groupby(GROUP_KEYS, dropna=False, sort=True):
        tasks = sorted(group["task_of_example"].unique())
        facts = task_facts(tasks[0]) if len(tasks) == 1 else task_facts("")
        mean, low, high, how = mean_interval(group["score"], facts.score_range, confidence)
        drop, n_matched = drop_vs_full(group)
        record = dict(
            level=level,
            **dict(zip(GROUP_KEYS, key)),
            compared=bool(group["compared"].iloc[0]),
            tasks=", ".join(tasks),
            n=int(group["score"].notna().sum()),
            score=mean,
            ci_low=low,
            ci_high=high,
            ci_method=how,
            lower_is_better=all(map(lower_is_better, tasks)),
        )
        if "score_partial" in group:
            record["score_partial"] = group["score_partial"].mean()
        record.update(
            drop_vs_full=drop,
            n_matched=n_matched,
            kv_ratio=group["kv_ratio"].mean(),
            kv_bytes=group["kv_bytes"].mean(),
            state_share=state_share(group),
            peak_mem_bytes=group["peak_mem_bytes"].max(),
            machines=int(group["device_name"].nunique()),
            # latency measured on several machines is not one experiment's: not pooled
            **{t: group[t].mean() if group["device_name"].nunique() <= 1 else math.nan for t in TIMING},
            bandwidth_share=bandwidth_share(group),
        )
        out.append(record)
    return out


def bandwidth_share(group: pd.DataFrame) -> float:
    """The mean share of the bandwidth bound the decode steps reached (kvbench.native.bandwidth: the bytes a step
    reads over its time over the machine's bandwidth); NaN across machines, without decoding rows, or for rows
    written before the column existed."""
    if "bandwidth_share" not in group or group["device_name"].nunique() > 1:
        return math.nan
    return float(group["bandwidth_share"].mean())


def state_share(group: pd.DataFrame) -> float:
    """The share of the bytes held that is a hybrid model's linear/Mamba/conv state (`state_bytes`, out of every KV
    method's reach); 0 on attention-only models, NaN for rows written before the column existed."""
    if "state_bytes" not in group:
        return math.nan
    return float((group["state_bytes"] / group["kv_bytes"]).mean())


def averaged(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows that count in averages: a serving engine's rows flagged `engine_invalid` (an option known to
    compute garbage there, e.g. vLLM's int8_per_token_head on CPU) are left out, and shown apart by the report."""
    if "engine_invalid" not in rows:
        return rows
    return rows[rows["engine_invalid"].fillna("").astype(str) == ""]


# the domain of each fidelity column (kvbench.native.fidelity): KL(full ‖ compressed) ≥ 0, top-1 agreement a share
FIDELITY_DOMAIN = {"kl_mean": (0.0, math.inf), "kl_max": (0.0, math.inf), "top1_agreement": (0.0, 1.0)}
FIDELITY_SLACK = 1e-6  # float rounding: a KL of −1e-9 is a KL of 0, not a broken measurement


def fidelity_invalid(rows: pd.DataFrame) -> pd.Series:
    """Per row, why its fidelity values are impossible ("" when they lie in their domain or are absent): a KL below 0
    or a top-1 agreement outside [0, 1] is a broken measurement, never averaged (readers show such rows apart)."""
    reason = pd.Series("", index=rows.index, dtype=object)
    for column, (low, high) in FIDELITY_DOMAIN.items():
        if column not in rows:
            continue
        values = pd.to_numeric(rows[column], errors="coerce")
        bad = ((values < low - FIDELITY_SLACK) | (values > high + FIDELITY_SLACK)) & (reason == "")
        reason[bad] = [f"{column} {v:.4g} outside [{low:g}, {high:g}]" for v in values[bad]]
    return reason


def summarize(rows: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Per subset, per scenario (rows with a `scenario`), per task and overall; see the module docstring. Rows
    flagged `engine_invalid` are not averaged (`averaged`)."""
    rows = with_lengths(averaged(rows))
    rows = with_full_scores(with_experiment_keys(rows)).assign(
        task_of_example=rows["task"], subset_of_example=rows["subset"]
    )
    levels = [("subset", rows)]
    if "scenario" in rows and rows["scenario"].notna().any():
        levels.append(("scenario", rows[rows["scenario"].notna()].assign(subset=lambda r: r["scenario"])))
    per_task = rows.assign(subset=ALL)
    levels.append(("task", per_task))
    pooled = per_task[~per_task["task"].map(lower_is_better)]  # scores, not perplexities
    tasks = pooled.groupby("length")["task"].nunique()
    pooled = pooled[pooled["length"].map(tasks) > 1]  # per length, where several tasks ran at it
    if len(pooled):
        levels.append(("overall", pooled.assign(task=ALL)))
    records = [r for level, frame in levels for r in _pool(frame, level, confidence)]
    return pd.DataFrame.from_records(records)


def knees(summary: pd.DataFrame, tolerance: float = 0.02) -> pd.DataFrame:
    """Per scope and method: the smallest budget whose mean score is within `tolerance` (absolute) of the full
    cache on the same examples; NaN where no budget is. The full cache itself is left out."""
    records = []
    compared = summary[summary["compared"] & (summary["method"] != FULL)]
    for key, curve in compared.groupby(SCOPE_KEYS + ["method"], dropna=False, sort=True):
        curve = curve.sort_values("budget")
        sign = -1.0 if curve["lower_is_better"].all() else 1.0  # perplexity: a loss is a *rise* over full
        good = curve[sign * curve["drop_vs_full"] <= tolerance + 1e-12]
        knee = good.iloc[0] if len(good) else None
        records.append(
            dict(
                zip(SCOPE_KEYS + ["method"], key),
                budgets=", ".join(f"{b:g}" for b in curve["budget"]),
                knee_budget=knee["budget"] if knee is not None else math.nan,
                kv_ratio=knee["kv_ratio"] if knee is not None else math.nan,
                score=knee["score"] if knee is not None else math.nan,
                drop_vs_full=knee["drop_vs_full"] if knee is not None else math.nan,
            )
        )
    return pd.DataFrame.from_records(
        records, columns=SCOPE_KEYS + ["method", "budgets", "knee_budget", "kv_ratio", "score", "drop_vs_full"]
    )


def pareto(summary: pd.DataFrame) -> pd.DataFrame:
    """The (method, budget) points of each scope that no other point beats on both smaller kv_ratio and higher
    score (at least as good on both and better on one); sorted by kv_ratio."""
    frontier = []
    for _, points in summary[summary["compared"]].groupby(SCOPE_KEYS, dropna=False, sort=True):
        points = points.dropna(subset=["kv_ratio", "score"])
        sign = -1.0 if points["lower_is_better"].all() else 1.0
        x, y = points["kv_ratio"].to_numpy(), sign * points["score"].to_numpy()
        dominated = [bool(np.any((x <= xi) & (y >= yi) & ((x < xi) | (y > yi)))) for xi, yi in zip(x, y)]
        frontier.append(points[~np.array(dominated, dtype=bool)].sort_values(["kv_ratio", "score"]))
    if not frontier:
        return summary.iloc[0:0]
    return pd.concat(frontier, ignore_index=True)
