"""kvbench.guide.selection on constructed rows: ranking, intervals, fit, ties, cost ratios, composition candidates, exit codes,
no torch import, and its static method facts against the method registry."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from kvbench.guide.selection import (
    CHANGES_MODEL,
    NEEDS_STATISTICS,
    PRECISION,
    compositions,
    guide_table,
    main,
    report_summary,
)
from tests.conftest import native_method_names
from tests.report.test_report import row, store


def rows_for(method, budget, scores, params="{}", kv_ratio=None, prefill_s=0.5, scenario="synthetic retrieval"):
    return [
        row(
            method, budget, f"ex{i}", s, kv_ratio=kv_ratio, method_params=params, prefill_s=prefill_s, scenario=scenario
        )
        for i, s in enumerate(scores)
    ]


def constructed():
    n = 10
    return (
        rows_for("full", 1.0, [1.0] * n, kv_ratio=1.0)
        + rows_for("snapkv", 0.5, [1.0] * n, kv_ratio=0.5, prefill_s=1.0)  # lossless, needs statistics
        + rows_for("streamingllm", 0.5, [1.0] * 9 + [0.0], kv_ratio=0.5)  # one miss: interval straddles 0.05
        + rows_for("random", 0.5, [0.0] * n, kv_ratio=0.5)  # clearly worse
        + rows_for("kivi", 1.0, [1.0] * n, params=json.dumps({"bits": 8}), kv_ratio=0.3)
        + rows_for("headmerge", 1.0, [1.0] * 3, params=json.dumps({"kv_heads": 1}), kv_ratio=0.33)
    )


def test_ranking_fit_ties_and_costs():
    table = guide_table(pd.DataFrame(constructed()), max_drop=0.05, max_kv_ratio=0.6, min_n=5)
    at_half = table[table.budget == "0.5"].set_index("config")
    assert list(at_half["rank"]) == [1, 2, 3] and at_half.index[0] == "snapkv" and at_half.index[-1] == "random"
    assert at_half.loc["snapkv", "fit"] == "meets" and at_half.loc["snapkv", "drop"] == 0
    assert at_half.loc["random", "fit"] == "fails (drop)" and at_half.loc["random", "drop"] == 1
    assert at_half.loc["streamingllm", "fit"].startswith("not enough evidence")
    assert at_half.loc["streamingllm", "drop"] == pytest.approx(0.1)
    assert "streamingllm" in at_half.loc["snapkv", "ties"] and at_half.loc["random", "ties"] == ""
    assert at_half.loc["snapkv", "prefill_vs_full"] == pytest.approx(2.0)  # 1.0 s vs the full cache's 0.5 s
    assert bool(at_half.loc["snapkv", "needs_statistics"]) and not at_half.loc["streamingllm", "needs_statistics"]
    no_budget = table[table.budget == "none"].set_index("config")
    assert bool(no_budget.loc["headmerge", "changes_model"])
    assert no_budget.loc["headmerge", "fit"] == "not enough evidence (n=3)"
    assert no_budget.loc["kivi(bits=8)", "fit"] == "meets"


def test_composition_candidates():
    table = guide_table(pd.DataFrame(constructed()), max_drop=0.05, max_kv_ratio=0.2)
    combos = compositions(table, max_drop=0.05, max_kv_ratio=0.2)
    assert list(combos["eviction"]) == ["snapkv@0.5"]  # streamingllm drops 0.1, random 1.0: not candidates
    assert combos["kv_ratio_product"].iloc[0] == pytest.approx(0.15)
    assert "method.stack=[snapkv,kivi]" in combos["try"].iloc[0]
    assert compositions(table, max_drop=0.05, max_kv_ratio=0.6).empty  # each part fits alone: nothing to compose


def test_report_summary_best_per_budget():
    best = report_summary(pd.DataFrame(constructed()))
    assert set(best["config"]) == {"snapkv", "kivi(bits=8)"}


def test_cli_exit_codes(tmp_path, capsys):
    path = store(tmp_path, constructed())
    assert main([str(path), "--max-kv-ratio", "0.6", "--out", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    assert "synthetic retrieval" in out and "composition candidates" in out
    assert (tmp_path / "g" / "guide.md").exists() and (tmp_path / "g" / "guide.csv").exists()
    assert main([str(path), "--scenario", "code"]) == 2
    assert "present: synthetic retrieval" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2
    assert main([str(path), "--max-drop", "-1"]) == 2


def test_intervals_below_five_examples_print_as_words(tmp_path, capsys):
    """headmerge ran 3 examples: its score and drop intervals say n is too small, in the text and guide.md; the
    numbers stay NaN in guide.csv."""
    path = store(tmp_path, constructed())
    assert main([str(path), "--out", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if " headmerge " in x)
    assert line.count("n too small for an interval") == 2 and "0.722–1.000" in out  # kivi's 10 examples: Wilson
    md = (tmp_path / "g" / "guide.md").read_text()
    assert "| headmerge | 3 | 1.000 | n too small for an interval | 0.000 | n too small for an interval |" in md
    for text in (out, md):
        assert "nan" not in text.lower()
    assert pd.read_csv(tmp_path / "g" / "guide.csv").query("config == 'headmerge'")["ci_low"].isna().all()


def test_guide_and_sections_import_no_torch():
    code = (
        "import sys, kvbench.guide.selection, kvbench.report.sections.guide, kvbench.report.sections.diagnose; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_static_method_facts_match_the_registry():
    from kvbench.methods import build_method
    from kvbench.methods.base import METHODS

    for name in native_method_names():
        if name in ("compose", "full"):
            continue
        method = build_method(name)
        assert bool(method.stats_request()) == (name in NEEDS_STATISTICS), name
        assert (not method.caps.shares_prefill) == (name in CHANGES_MODEL), name
        assert (method.caps.family == "precision") == (name in PRECISION), name


def test_a_hybrids_state_share_is_shown_where_rows_hold_a_state():
    """A hybrid model's rows carry state_bytes (its linear/Mamba/conv states): the guide and the report's summary show
    their share of the bytes held — the floor of kv_ratio — and attention-only rows (state_bytes 0) show nothing."""
    from kvbench.report.tables import summary_columns
    from kvbench.store.aggregate import summarize

    plain = pd.DataFrame(constructed())
    hybrid = plain.assign(state_bytes=plain["kv_bytes"] // 10)  # a tenth of what each row holds
    table = guide_table(hybrid, max_drop=0.05, max_kv_ratio=0.6)
    assert table["state_share"].round(3).eq(0.1).all()
    assert "state_share" in report_summary(hybrid).columns and "state_share" not in report_summary(plain).columns
    headings = {c.heading for c in summary_columns(summarize(hybrid))}
    assert "state share" in headings and "state share" not in {c.heading for c in summary_columns(summarize(plain))}


def ruler_at_two_lengths() -> pd.DataFrame:
    """RULER at 16K and 32K, 3 examples each; snapkv loses nothing: pooled, n = 6 would meet --max-drop."""
    return pd.DataFrame(
        [
            row(
                method,
                budget,
                f"ruler-niah_single_1-L{length}-i{i}",
                1.0,
                task="ruler",
                subset="niah_single_1",
                length_target=length,
                context_tokens=length - 7 * i,
                scenario="retrieval",
            )
            for method, budget in (("full", 1.0), ("snapkv", 0.5))
            for length in (16384, 32768)
            for i in range(3)
        ]
    )


def test_each_context_length_is_its_own_cell():
    """A configuration's rows at two lengths are two lines of the guide, each with its own n and fit."""
    table = guide_table(ruler_at_two_lengths(), max_drop=0.05, min_n=5)
    assert list(table["n"]) == [3, 3] and set(table["fit"]) == {"not enough evidence (n=3)"}  # pooled: 6, meets
    assert list(table["length"]) == [16384, 32768]
    best = report_summary(ruler_at_two_lengths())
    assert list(best["n"]) == [3, 3] and list(best["length"]) == [16384, 32768]


def test_the_reports_summary_and_takeaways_keep_lengths_apart():
    from kvbench.report.takeaways import takeaways
    from kvbench.store.aggregate import knees, summarize

    summary = summarize(ruler_at_two_lengths())
    task = summary.query("level == 'task' and method == 'snapkv'")
    assert list(task["n"]) == [3, 3] and list(task["length"]) == [16384, 32768]
    knee = knees(summary)
    for length in (16384, 32768):
        lines = takeaways(summary, knee, 0.02, "task", "tiny", "ruler", length, True)
        assert lines[0].startswith("2 configurations compared on the same 3 examples")
