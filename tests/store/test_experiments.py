"""Rows are pooled only within one experiment: a configuration's float32 and bfloat16 runs (different config
hashes), two models' rows, or one configuration's rows from two code versions are never counted as one n, in the
summary (report), the gate and the guide; latency measured on several machines is not pooled."""

from __future__ import annotations

import math

import pandas as pd

from kvbench.guide.selection import guide_table
from kvbench.report.gate import main as check_main
from kvbench.store.aggregate import load_rows, summarize, with_experiment_labels
from tests.report.test_report import row, store


def runs(dtypes=("float32", "bfloat16"), models=("tiny",), **extra) -> list[dict]:
    """full and snapkv@0.25 on 3 examples per (model, dtype): a configuration's own run is n=3."""
    rows = []
    for model in models:
        for dtype in dtypes:
            for method, budget, score in (("full", 1.0, 1.0), ("snapkv", 0.25, 1.0 if dtype == "float32" else 0.0)):
                for i in range(3):
                    rows.append(
                        row(
                            method,
                            budget,
                            f"e{i}",
                            score,
                            model=model,
                            dtype=dtype,
                            config_hash=f"{model}-{dtype}-{method}",
                            **extra,
                        )
                    )
    return rows


def test_two_dtypes_are_two_experiments_in_the_summary(tmp_path):
    summary = summarize(load_rows([store(tmp_path, runs())]))
    snap = summary[(summary["level"] == "subset") & (summary["method"] == "snapkv")].set_index("dtype")
    assert sorted(snap.index) == ["bfloat16", "float32"]  # before: one line, n=6, score 0.5
    assert (snap["n"] == 3).all()
    assert snap.loc["float32", "drop_vs_full"] == 0.0 and snap.loc["bfloat16", "drop_vs_full"] == 1.0


def test_the_gate_refuses_to_pool_two_dtypes_into_one_n(tmp_path, capsys):
    thresholds = tmp_path / "t.yaml"
    thresholds.write_text("thresholds:\n  - select: {method: snapkv}\n    min_score: 0\n    min_examples: 6\n")
    code = check_main([str(store(tmp_path, runs())), "--thresholds", str(thresholds)])
    err = capsys.readouterr().err.strip()
    assert code == 2  # before: exit 0, "examples 6 >= 6 (n=6)"
    assert err.endswith(
        "pools rows of 2 dtypes (bfloat16, float32): different experiments; add dtype: <one of them> to its select"
    )


def test_a_float_min_examples_is_bad_input(tmp_path, capsys):
    thresholds = tmp_path / "t.yaml"
    thresholds.write_text(
        "thresholds:\n  - select: {method: snapkv, dtype: float32}\n    min_score: 0\n    min_examples: 3.0\n"
    )
    code = check_main([str(store(tmp_path, runs())), "--thresholds", str(thresholds)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1  # before: exit 0, "examples 3 >= 3"
    assert "min_examples must be a positive integer, got 3.0 (min_examples is a float, not an integer" in err[0]


def test_the_guide_ranks_a_configuration_per_model(tmp_path):
    table = guide_table(load_rows([store(tmp_path, runs(dtypes=("float32",), models=("a", "b")))]), min_n=1)
    assert sorted(table["model"]) == ["a", "b"] and (table["n"] == 3).all()  # before: one line over both, n=6


def test_one_configuration_across_code_versions_is_not_pooled(tmp_path):
    rows = runs(dtypes=("float32",))
    for r in rows[3:]:
        r["code_fingerprint"] = "new" if r["example_id"] == "e2" else "old"
    summary = summarize(load_rows([store(tmp_path, rows)]))
    snap = summary[(summary["level"] == "subset") & (summary["method"] == "snapkv")]
    assert sorted(snap["n"]) == [1, 2]


def old_and_rerun():
    """The same runs twice: by an older code version, then rerun a month later by a newer one (another config_hash)."""
    old = runs(dtypes=("float32",))
    for r in old:
        r.update(code_fingerprint="old", timestamp="2026-01-01T00:00:00+00:00")
    new = [
        dict(r, code_fingerprint="new", config_hash=r["config_hash"] + "-rerun", timestamp="2026-02-01T00:00:00+00:00")
        for r in old
    ]
    return old, new


def test_a_newer_version_that_reproduces_an_older_one_replaces_it(tmp_path):
    old, new = old_and_rerun()
    rows = load_rows([store(tmp_path, old + new)])
    assert set(rows["code_fingerprint"]) == {"new"} and len(rows) == 6  # the same 3 examples, the same scores
    snap = summarize(rows).query("level == 'subset' and method == 'snapkv'")
    assert list(snap["n"]) == [3]


def test_versions_that_disagree_on_an_example_stay_apart(tmp_path):
    old, new = old_and_rerun()
    new[3]["score"] = 0.0  # snapkv on e0: the new code answers otherwise
    rows = load_rows([store(tmp_path, old + new)])
    kept = rows.groupby("method")["code_fingerprint"].agg(lambda v: sorted(set(v)))
    assert kept["full"] == ["new"] and kept["snapkv"] == ["new", "old"]
    snap = summarize(rows).query("level == 'subset' and method == 'snapkv'")
    assert sorted(snap["n"]) == [3, 3]


def test_latency_from_several_machines_is_not_pooled(tmp_path):
    rows = runs(dtypes=("float32",))
    for i, r in enumerate(rows):
        r["device_name"] = "cpu: a" if i % 2 else "cuda: H100"
    snap = summarize(load_rows([store(tmp_path, rows)])).query("level == 'subset' and method == 'snapkv'").iloc[0]
    assert snap["machines"] == 2 and math.isnan(snap["prefill_s"]) and snap["n"] == 3


def test_a_length_run_by_other_code_is_its_own_line_not_a_version():
    """RULER at 16K (older code) and at 32K (newer) are two lengths, not one configuration from two code versions:
    no `@` label. The same length from two versions still is."""
    rows = pd.DataFrame(
        [
            row("snapkv", 0.5, "e1", 1.0, task="ruler", length_target=length, code_fingerprint=code)
            for length, code in ((16384, "old00000"), (32768, "new00000"))
        ]
    )
    assert list(with_experiment_labels(rows)["method"]) == ["snapkv", "snapkv"]
    mixed = with_experiment_labels(rows.assign(length_target=16384))
    assert list(mixed["method"]) == ["snapkv @old00000", "snapkv @new00000"]
