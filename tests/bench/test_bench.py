"""kvbench.bench: one door per benchmark, over the validated configuration (bad input: one line, exit 2); each
benchmark runs on the tiny model and prints its ratios; the sweep benchmark's plain transformers loop gives
kvbench's full-cache predictions."""

import re

import pytest

from kvbench.bench import BENCHMARKS
from kvbench.bench.__main__ import main

TINY = [
    "model=tiny-random",
    "device=cpu",
    "dtype=float32",
    "task.context_lengths=[600]",
    "task.depths=[0.3,0.7]",
    "task.max_new_tokens=5",
]


@pytest.mark.parametrize(
    "argv,line",
    [
        (["nope"], r"no benchmark 'nope'; choose one of sweep, decode, stats, .* or all"),
        (["stats", "dtype=float8"], r"dtype=float8 is not one of"),
        (["decode", "bogus=["], r"\(overrides: bogus=\[\)"),
        (["sweep", "method=nosuch"], r"nosuch"),
        (["sweep", "bench.pairs=0"], r"bench.pairs=0: give 1 or more \(full, sweep\) pairs"),
        (["sweep", "task=ppl", "bench.by_length=true"], r"bench.by_length=true needs a task with context_lengths"),
        (["sweep", "bench.by_length=3"], r"bench.by_length=3: give true, false or null"),
        ([], r"usage: python -m kvbench.bench"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, line, capsys):
    assert main(argv) == 2
    out = capsys.readouterr()
    text = (out.err or out.out).strip()
    assert re.search(line, text) and "Traceback" not in text
    if argv:
        assert len(out.err.strip().splitlines()) == 1


def test_the_sweep_benchmark_prints_its_ratios_and_full_equals_plain(capsys, monkeypatch):
    monkeypatch.setenv("KVBENCH_BANDWIDTH_GBS", "10")
    assert main(["sweep", *TINY]) == 0
    out = capsys.readouterr().out
    assert re.search(r"method=full +[\d.]+ s +[\d.]+× plain; predictions equal: 2/2", out)
    assert re.search(r"sweep, fidelity on +[\d.]+ s +[\d.]+× full", out)
    assert re.search(r"fidelity columns +[\d.]+ s +[\d.]+% of the sweep", out)
    assert "11 configurations in the sweep (22 rows)" in out


def test_the_sweep_benchmark_interleaves_pairs_and_prints_their_median(capsys, monkeypatch):
    monkeypatch.setenv("KVBENCH_BANDWIDTH_GBS", "10")
    assert main(["sweep", *TINY, "bench.pairs=2"]) == 0
    found = re.search(r"sweep / full, 2 interleaved pairs: ([\d.]+) / ([\d.]+); median ([\d.]+)×", capsys.readouterr().out)
    assert found is not None
    first, second, median = (float(x) for x in found.groups())
    assert median == pytest.approx((first + second) / 2, abs=1e-3)


def test_the_sweep_benchmark_pairs_each_length_and_joins_them(capsys, monkeypatch):
    monkeypatch.setenv("KVBENCH_BANDWIDTH_GBS", "10")
    lengths = [*TINY[:3], "task.context_lengths=[450,600]", *TINY[4:]]
    assert main(["sweep", *lengths]) == 0  # by length: the default where the task has lengths
    out = capsys.readouterr().out
    assert re.search(r"method=full +[\d.]+ s +[\d.]+× plain; predictions equal: 4/4", out)
    assert "11 configurations in the sweep (44 rows)" in out


@pytest.mark.parametrize("name", ["decode", "stats"])
def test_each_benchmark_runs_on_the_tiny_model(name, capsys, monkeypatch):
    monkeypatch.setenv("KVBENCH_BANDWIDTH_GBS", "10")
    assert main([name, *TINY]) == 0
    out = capsys.readouterr().out
    assert f"{name} benchmark: tiny-random float32 on cpu" in out
    rows = re.findall(r"^ +(\d+) +[\d.]+ +([\d.]+) ", out, re.M) if name == "decode" else re.findall(r"× plain", out)
    assert len(rows) == (6 if name == "decode" else 6)
    assert {"sweep", "decode", "stats"} <= set(BENCHMARKS)
