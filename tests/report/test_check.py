"""kvbench.report.gate: exit 0 / 1 / 2 with the right lines, on synthetic rows."""

from __future__ import annotations

import pytest

from kvbench.report.gate import main as check_main
from tests.report.test_report import row, store

# full: 1 on all four examples; streamingllm@0.5: 1, 0, 1, 0 → mean 0.5, drop 0.5
ROWS = [row("full", 1.0, f"e{i}", 1.0) for i in range(4)] + [
    row("streamingllm", 0.5, f"e{i}", float(i % 2 == 0)) for i in range(4)
]


@pytest.fixture
def results(tmp_path):
    return store(tmp_path / "results", ROWS)


def run_check(results, tmp_path, text: str, capsys) -> tuple[int, list[str], str]:
    thresholds = tmp_path / "thresholds.yaml"
    thresholds.write_text(text)
    code = check_main([str(results), "--thresholds", str(thresholds)])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.strip()


def test_all_hold_exits_0_with_one_ok_line_each(results, tmp_path, capsys):
    code, out, err = run_check(
        results,
        tmp_path,
        """
description: smoke gate
thresholds:
  - select: {task: niah, method: full}
    min_score: 0.9
    min_examples: 4
  - select: {task: niah, method: streamingllm, budget: 0.5000000001, query_aware: true}
    min_score: 0.4
    max_drop_vs_full: 0.6
  - select: {method: [full, streamingllm]}
    min_score: 0.75
""",
        capsys,
    )
    assert code == 0 and err == ""
    assert out == [
        "ok {task: niah, method: full}: examples 4 >= 4, score 1 >= 0.9 (n=4)",
        "ok {task: niah, method: streamingllm, budget: 0.5000000001, query_aware: true}: score 0.5 >= 0.4, "
        "drop_vs_full 0.5 <= 0.6 (n=4)",
        "ok {method: [full, streamingllm]}: score 0.75 >= 0.75 (n=8)",
    ]


def test_violations_exit_1_with_one_fail_line_each(results, tmp_path, capsys):
    code, out, _ = run_check(
        results,
        tmp_path,
        """
thresholds:
  - select: {task: niah, method: full}
    min_score: 0.9
  - select: {task: niah, method: streamingllm, budget: 0.5}
    min_score: 0.6
    max_drop_vs_full: 0.25
    min_examples: 10
""",
        capsys,
    )
    assert code == 1
    sel = "{task: niah, method: streamingllm, budget: 0.5}"
    assert out == [
        "ok {task: niah, method: full}: score 1 >= 0.9 (n=4)",
        f"FAIL {sel}: examples expected >= 10, measured 4 (n=4)",
        f"FAIL {sel}: score expected >= 0.6, measured 0.5 (n=4)",
        f"FAIL {sel}: drop_vs_full expected <= 0.25, measured 0.5 (n=4)",
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "thresholds:\n  - select: {method: full}\n    min_score: 0.9\nnote: x\n",
            "unknown key(s) note; valid keys: description, thresholds",
        ),
        (
            "thresholds:\n  - select: {method: full}\n    min_scor: 0.9\n    min_score: 0.9\n",
            "thresholds entry 1: unknown key(s) min_scor; valid keys: select, min_score, max_drop_vs_full, "
            "max_kl_mean, max_kl_p95, min_top1_agreement, min_examples",
        ),
        ("thresholds:\n  - select: {methd: full}\n    min_score: 0.9\n", "unknown key(s) methd; valid keys: "),
        (
            "thresholds:\n  - select: {method: snapkv}\n    min_score: 0.9\n",
            "selector {method: snapkv} matches no rows (present: method ∈ {full, streamingllm})",
        ),
        ("thresholds:\n  - select: {method: full}\n", "needs at least one of min_score, max_drop_vs_full"),
        ("thresholds:\n  - select: {method: full}\n    min_score: high\n", "min_score must be a number"),
        ("thresholds: [\n", "invalid YAML"),
        ("thresholds: []\n", "`thresholds` must be a non-empty list"),
    ],
)
def test_bad_thresholds_exit_2_with_one_line(results, tmp_path, capsys, text, message):
    code, out, err = run_check(results, tmp_path, text, capsys)
    assert code == 2 and out == []
    assert len(err.splitlines()) == 1 and err.startswith("kvbench.check: error:") and message in err


def test_drop_without_full_rows_is_bad_input(tmp_path, capsys):
    results = store(tmp_path / "results", [row("streamingllm", 0.5, "e0", 1.0)])
    code, _, err = run_check(
        results, tmp_path, "thresholds:\n  - select: {method: streamingllm}\n    max_drop_vs_full: 0.1\n", capsys
    )
    assert code == 2 and "no full-cache rows" in err


def test_missing_inputs_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    thresholds = tmp_path / "t.yaml"
    thresholds.write_text("thresholds:\n  - select: {method: full}\n    min_score: 0.9\n")
    assert check_main([str(tmp_path / "empty"), "--thresholds", str(thresholds)]) == 2
    assert "no result rows" in capsys.readouterr().err
    assert check_main([str(tmp_path / "empty"), "--thresholds", str(tmp_path / "nope.yaml")]) == 2
    assert "--thresholds=" in (err := capsys.readouterr().err) and "does not exist" in err
    assert check_main([str(tmp_path / "nowhere"), "--thresholds", str(thresholds)]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_a_selector_over_several_configurations_uses_their_common_examples(tmp_path, capsys):
    # h2o ran two of the four examples (both scored 0); snapkv ran all four (1, 1, 0, 0). Pooling all six rows
    # would mix example sets; on the common two (e0, e1) snapkv scores 1 and h2o 0.
    rows = (
        ROWS
        + [row("snapkv", 0.5, f"e{i}", float(i < 2)) for i in range(4)]
        + [row("h2o", 0.5, f"e{i}", 0.0) for i in range(2)]
    )
    results = store(tmp_path / "results", rows)
    code, out, _ = run_check(
        results,
        tmp_path,
        """
thresholds:
  - select: {budget: 0.5, method: [snapkv, h2o]}
    min_score: 0.5
    max_drop_vs_full: 0.5
""",
        capsys,
    )
    assert code == 0, out
    assert out == [
        "ok {budget: 0.5, method: [snapkv, h2o]}: score 0.5 >= 0.5, drop_vs_full 0.5 <= 0.5 "
        "(n=4; 2 rows left out: not run by every selected configuration)"
    ]


def test_fidelity_bounds_gate_a_mean_and_a_tail(tmp_path, capsys):
    """max_kl_mean bounds the mean of the rows' kl_mean, max_kl_p95 its 95th percentile over the rows (one bad
    examples of twenty set the tail, not the mean), min_top1_agreement the mean agreement."""
    kl = [0.01] * 17 + [1.0] * 3  # mean 0.1585 passes 0.2; the 95th percentile (1.0) fails 0.1
    rows = [row("full", 1.0, f"e{i}", 1.0, kl_mean=0.0, top1_agreement=1.0) for i in range(20)] + [
        row("snapkv", 0.25, f"e{i}", 1.0, kl_mean=k, top1_agreement=0.9) for i, k in enumerate(kl)
    ]
    results = store(tmp_path / "results", rows)
    text = """
thresholds:
  - select: {method: full}
    max_kl_p95: 0.0
    min_top1_agreement: 1.0
  - select: {method: snapkv}
    max_kl_mean: 0.2
    max_kl_p95: 0.1
    min_top1_agreement: 0.95
"""
    code, out, err = run_check(results, tmp_path, text, capsys)
    assert code == 1 and err == ""
    assert out == [
        "ok {method: full}: kl_mean p95 0 <= 0, top1_agreement 1 >= 1 (n=20)",
        "FAIL {method: snapkv}: kl_mean p95 expected <= 0.1, measured 1 (n=20)",
        "FAIL {method: snapkv}: top1_agreement expected >= 0.95, measured 0.9 (n=20)",
    ]


def test_a_fidelity_bound_on_rows_without_the_columns_is_bad_input(results, tmp_path, capsys):
    code, out, err = run_check(
        results, tmp_path, "thresholds:\n  - select: {method: full}\n    max_kl_p95: 0.1\n", capsys
    )
    assert code == 2 and out == [] and "no row has kl_mean" in err and "max_kl_p95 cannot be measured" in err


@pytest.mark.parametrize(
    "bounds, message",
    [
        ("max_kl_mean: -1", "max_kl_mean must be ≥ 0 (KL divergence, nats), got -1"),
        ("max_kl_p95: -0.1", "max_kl_p95 must be ≥ 0 (KL divergence, nats), got -0.1"),
        ("min_top1_agreement: 1.5", "min_top1_agreement must be in [0, 1] (a share of answer tokens), got 1.5"),
        ("min_top1_agreement: -0.5", "min_top1_agreement must be in [0, 1]"),
        ("min_score: 1.5", "min_score must lie in the score range of niah, [0, 1], got 1.5"),
        ("min_score: -0.5", "min_score must lie in the score range of niah, [0, 1], got -0.5"),
        ("max_drop_vs_full: -2", "max_drop_vs_full must lie in [-1, 1] (the score range of niah is [0, 1]), got -2"),
    ],
)
def test_a_bound_outside_its_metrics_domain_is_refused(results, tmp_path, capsys, bounds, message):
    """A bound that holds always or never (KL < 0, an agreement above 1, a score beyond the task's range) is bad
    input: exit 2 with one line naming the valid range, no verdict lines."""
    code, out, err = run_check(results, tmp_path, f"thresholds:\n  - select: {{method: full}}\n    {bounds}\n", capsys)
    assert code == 2 and out == [] and len(err.splitlines()) == 1
    assert message in err


def test_rows_with_impossible_fidelity_values_are_not_gated_on(tmp_path, capsys):
    """A row with KL < 0 or top-1 agreement > 1 is a broken measurement: left out of the statistic, said in the line."""
    rows = [row("snapkv", 0.25, f"e{i}", 1.0, kl_mean=0.1, top1_agreement=0.9) for i in range(4)]
    rows += [row("snapkv", 0.25, "e4", 1.0, kl_mean=-3.0, top1_agreement=2.0)]
    text = "thresholds:\n  - select: {method: snapkv}\n    max_kl_mean: 0.1\n    min_top1_agreement: 0.9\n"
    code, out, err = run_check(store(tmp_path / "r", rows), tmp_path, text, capsys)
    assert code == 0, err
    assert out == [
        "ok {method: snapkv}: kl_mean 0.1 <= 0.1, top1_agreement 0.9 >= 0.9 "
        "(n=5; 1 rows with impossible fidelity values left out)"
    ]
