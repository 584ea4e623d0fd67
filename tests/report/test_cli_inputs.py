"""The row-reading commands on bad input, by class — report, guide, check: each argument checked by the shared
Rules before any row is read (one `<command>: error:` line naming the flag and its fix, exit 2), and a foreign
Parquet file in the store named and skipped instead of making every row unreadable."""

from __future__ import annotations

import pandas as pd
import pytest

from kvbench.guide.selection import main as guide_main
from kvbench.report.build import main as report_main
from kvbench.report.gate import main as check_main
from tests.report.test_report import row, store

ROWS = [row("full", 1.0, f"e{i}", 1.0) for i in range(5)] + [row("snapkv", 0.5, f"e{i}", 1.0) for i in range(5)]
COMMANDS = {"report": report_main, "guide": guide_main, "check": check_main}


@pytest.fixture
def results(tmp_path):
    store(tmp_path / "results", ROWS)
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "t.yaml").write_text("thresholds:\n  - select: {method: full}\n    min_score: 0.5\n")
    return tmp_path


def _argv(tmp, command, extra):
    argv = [str(tmp / "results"), *[a.format(tmp=tmp) for a in extra]]
    return argv + (["--thresholds", str(tmp / "t.yaml")] if command == "check" and "--thresholds" not in extra else [])


# (class, command, arguments ({tmp}: the test's folder), text the one line must contain)
CASES = [
    ("missing input", "report", ["{tmp}/nope"], "results={tmp}/nope does not exist"),
    ("missing input", "guide", ["{tmp}/nope"], "does not exist"),
    ("missing input", "check", ["{tmp}/nope"], "does not exist"),
    ("missing input", "check", ["--thresholds", "{tmp}/none.yaml"], "--thresholds={tmp}/none.yaml does not exist"),
    ("missing input", "check", ["--thresholds", "{tmp}/results"], "is a directory, not a file"),
    (
        "output folder",
        "report",
        ["--out", "{tmp}/afile"],
        "--out={tmp}/afile is a file, not a directory; use --out DIR",
    ),
    ("output folder", "report", ["--out", "{tmp}/afile/sub"], "({tmp}/afile is a file); use --out DIR"),
    ("output folder", "guide", ["--out", "{tmp}/afile"], "use --out DIR"),
    ("output folder", "guide", ["--out", "{tmp}/afile/sub"], "use --out DIR"),
    ("number", "report", ["--tolerance", "inf"], "--tolerance=inf is not a finite number"),
    ("number", "report", ["--tolerance", "-0.1"], "must be ≥ 0"),
    ("number", "guide", ["--max-drop", "nan"], "--max-drop 0.05"),
    ("number", "guide", ["--max-kv-ratio", "0"], "--max-kv-ratio=0.0 must be > 0"),
    ("number", "guide", ["--min-n", "0"], "--min-n 5"),
    ("number", "guide", ["--scenario", ""], "--scenario NAME"),
]


@pytest.mark.parametrize("kind,command,extra,fix", CASES, ids=[f"{c[0]}: {c[1]} {' '.join(c[2])}" for c in CASES])
def test_bad_arguments_are_one_line_and_exit_2(results, capsys, kind, command, extra, fix):
    code = COMMANDS[command](_argv(results, command, extra))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"kvbench.{command}: error:") and fix.format(tmp=results) in err[0], err[0]


@pytest.mark.parametrize(
    "bound", ["min_score: .inf", "max_drop_vs_full: -.inf", "min_score: .nan", "min_score: 0\n    min_examples: 1.5"]
)
def test_a_non_finite_threshold_is_bad_input_not_a_gate_failure(results, capsys, bound):
    (results / "t.yaml").write_text(f"thresholds:\n  - select: {{method: snapkv}}\n    {bound}\n")
    assert check_main(_argv(results, "check", [])) == 2  # 1 would read as "the gate failed"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "thresholds entry 1:" in err[0] and "must be" in err[0]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_foreign_parquet_file_is_named_and_skipped(results, capsys, command):
    foreign = results / "results" / "rows" / "notes.parquet"
    pd.DataFrame({"a": [1, 2]}).to_parquet(foreign)
    extra = ["--out", str(results / "out")] if command != "check" else []
    assert COMMANDS[command](_argv(results, command, extra)) == 0
    err = capsys.readouterr().err
    assert f"skipping foreign results file {foreign} (not kvbench result rows" in err and "Traceback" not in err
