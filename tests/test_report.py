"""kvbench.aggregate and kvbench.report on synthetic rows (no model): statistics with known answers, drop vs the
full cache on matched examples, knees, Pareto, plots and the self-contained HTML."""

from __future__ import annotations

import base64
import math
import re

import pandas as pd
import pytest

from kvbench import KvbenchError
from kvbench.aggregate import ALL, knees, load_rows, mean_ci, pareto, summarize, t_quantile
from kvbench.report import main as report_main
from kvbench.results import COLUMNS, SCHEMA_VERSION, write_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(method: str, budget: float, example_id: str, score: float, *, task: str = "niah", subset: str = "s1",
        kv_ratio: float | None = None, query_aware: bool = True, model: str = "tiny",
        timestamp: str = "2026-01-01T00:00:00+00:00", **extra) -> dict:
    """One result row with every ★ column (plus schema_version and dtype, as the runner writes them)."""
    kv_ratio = budget if kv_ratio is None else kv_ratio
    values = dict(
        run_id="run-1", timestamp=timestamp, git_sha="abc123", config_hash=f"{model}-{task}-{method}-{budget}-"
        f"{query_aware}", kvbench_version="0.1.0", torch_version="2.x", transformers_version="5.x",
        device_name="cpu: test", model=model, task=task, subset=subset, example_id=example_id, context_tokens=1000,
        new_tokens=5, method=method, budget=float(budget), method_params="{}", query_aware=query_aware,
        score=float(score), metric="string_match", prediction="x", answers='["x"]', kv_bytes=int(1e6 * kv_ratio),
        kv_bytes_full=1_000_000, kv_ratio=kv_ratio, peak_mem_bytes=int(5e7 + 1e7 * kv_ratio), prefill_s=0.5,
        decode_s=0.1, decode_ms_per_token=20.0 + 10 * kv_ratio, seed=0, schema_version=SCHEMA_VERSION,
        dtype="float32", reused=False)
    values.update(extra)
    assert set(COLUMNS) <= set(values)
    return values


def store(tmp_path, rows: list[dict], name: str = "run-1"):
    write_rows(pd.DataFrame(rows), tmp_path / "rows" / f"{name}.parquet")
    return tmp_path


def niah_grid(methods_budgets, scores_of) -> list[dict]:
    """NIAH rows over lengths × depths; scores_of(method, budget, length, depth) → score."""
    rows = []
    for method, budget in methods_budgets:
        for length in (1024, 2048):
            for depth in (0.1, 0.5, 0.9):
                score = scores_of(method, budget, length, depth)
                rows.append(row(method, budget, f"niah-L{length}-D{depth}", score, length_target=length,
                                depth=depth, score_partial=min(1.0, score + 0.3)))
    return rows


# ----------------------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("df, expected", [(1, 12.706), (2, 4.303), (3, 3.182), (9, 2.262), (29, 2.045),
                                          (120, 1.980), (1e7, 1.960)])
def test_t_quantile_matches_tables(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=6e-4)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=6e-4)


def test_mean_ci_known_answers():
    mean, low, high = mean_ci([0, 1, 1, 1])  # s = 0.5, n = 4: half width t_{.975,3}·0.5/2
    assert mean == 0.75 and (high - mean) == pytest.approx(3.182446 * 0.25, rel=1e-5)
    mean, low, high = mean_ci(range(1, 11))  # s = 3.02765
    assert mean == 5.5 and (mean - low) == pytest.approx(2.262157 * 3.0276504 / math.sqrt(10), rel=1e-5)
    assert mean_ci([0.3]) == (0.3, 0.3, 0.3)
    assert all(math.isnan(v) for v in mean_ci([]))


def test_drop_vs_full_uses_only_matched_examples():
    rows = [row("full", 1.0, f"e{i}", s) for i, s in enumerate([1, 1, 1, 0])]
    rows += [row("snapkv", 0.5, "e0", 0), row("snapkv", 0.5, "e1", 1)]  # only two of the four examples ran
    rows += [row("full", 1.0, "q0", 1, task="qa", subset="a"), row("snapkv", 0.5, "q0", 0.5, task="qa", subset="a")]
    summary = summarize(pd.DataFrame(rows)).set_index(["level", "task", "subset", "method"])
    snap = summary.loc[("subset", "niah", "s1", "snapkv")]
    # full on e0, e1 = 1.0, snapkv = 0.5: drop 0.5 (the unmatched full mean 0.75 would give 0.25)
    assert snap["n"] == 2 and snap["score"] == 0.5 and snap["drop_vs_full"] == 0.5 and snap["n_matched"] == 2
    assert summary.loc[("subset", "niah", "s1", "full"), "drop_vs_full"] == 0
    overall = summary.loc[("overall", ALL, ALL, "snapkv")]
    assert overall["n"] == 3 and overall["drop_vs_full"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert summary.loc[("task", "qa", ALL, "snapkv"), "drop_vs_full"] == 0.5


def test_knee_and_pareto_on_a_constructed_curve():
    curve = {0.1: 0.5, 0.25: 0.97, 0.5: 0.99, 1.0: 1.0}
    rows = [row("full", 1.0, "e0", 1.0)] + [row("snapkv", b, "e0", s) for b, s in curve.items()]
    rows += [row("random", 0.05, "e0", 0.2), row("random", 0.3, "e0", 0.6)]
    summary = summarize(pd.DataFrame(rows))
    knee = knees(summary, tolerance=0.02).query("level == 'task'").set_index("method")
    assert knee.loc["snapkv", "knee_budget"] == 0.5  # 0.25 drops 0.03 > 0.02
    assert math.isnan(knee.loc["random", "knee_budget"]) and "full" not in knee.index
    assert knees(summary, tolerance=0.05).query("level == 'task'").set_index("method").loc[
        "snapkv", "knee_budget"] == 0.25
    front = pareto(summary).query("level == 'task'")
    points = set(zip(front["method"], front["budget"]))
    # random@0.3 (0.6) is beaten by snapkv@0.25 (0.97); snapkv@1.0 ties full and so is not beaten
    assert points == {("random", 0.05), ("snapkv", 0.1), ("snapkv", 0.25), ("snapkv", 0.5), ("snapkv", 1.0),
                      ("full", 1.0)}
    assert list(front["kv_ratio"]) == sorted(front["kv_ratio"])


# ----------------------------------------------------------------------------------------- loading


def test_load_rows_merges_paths_and_keeps_the_newest(tmp_path):
    old = store(tmp_path / "a", [row("full", 1.0, "e0", 0.0, timestamp="2026-01-01T00:00:00+00:00")])
    new = store(tmp_path / "b", [row("full", 1.0, "e0", 1.0, timestamp="2026-02-01T00:00:00+00:00"),
                                 row("full", 1.0, "e1", 1.0)])
    rows = load_rows([old, new])
    assert len(rows) == 2 and rows.set_index("example_id").loc["e0", "score"] == 1.0


def test_load_rows_rejects_incompatible_schemas(tmp_path):
    bad = pd.DataFrame([row("full", 1.0, "e0", 1.0)]).drop(columns=["kv_ratio"])
    write_rows(bad, tmp_path / "missing" / "r.parquet")
    with pytest.raises(KvbenchError, match="missing columns kv_ratio"):
        load_rows([tmp_path / "missing"])
    store(tmp_path / "future", [row("full", 1.0, "e0", 1.0, schema_version=SCHEMA_VERSION + 1)])
    with pytest.raises(KvbenchError, match=f"schema_version {SCHEMA_VERSION + 1}"):
        load_rows([tmp_path / "future"])


# ----------------------------------------------------------------------------------------- the report


def test_report_writes_every_plot_and_a_self_contained_html(tmp_path, capsys):
    configs = [("full", 1.0), ("streamingllm", 0.25), ("streamingllm", 0.5), ("snapkv", 0.25), ("snapkv", 0.5)]
    rows = niah_grid(configs, lambda m, b, length, depth: 1.0 if m == "full" or depth > 0.3 else b)
    rows += [row(m, b, f"q{i}", (i % 2) * b + (1 - b) * (m == "full"), task="qa", subset=f"sub{i % 2}")
             for m, b in configs for i in range(4)]
    results = store(tmp_path / "results", rows)
    out = tmp_path / "out"
    assert report_main([str(results), "--out", str(out), "--tolerance", "0.05"]) == 0
    written = [line for line in capsys.readouterr().out.splitlines() if line]
    names = {p.split("/")[-1] for p in written}
    expected = {f"{kind}_{scope}.png" for kind in ("quality", "pareto") for scope in ("niah", "qa", "overall")}
    expected |= {"costs_niah.png", "costs_qa.png", "heatmap_niah_full.png", "heatmap_niah_streamingllm.png",
                 "heatmap_niah_snapkv.png", "report.html", "report.md", "summary.csv"}
    assert expected <= names
    for path in map(lambda p: out / p, names):
        assert path.stat().st_size > 0
        if path.suffix == ".png":
            assert path.read_bytes().startswith(PNG_MAGIC)

    page = (out / "report.html").read_text()
    sources = re.findall(r'<img[^>]*\bsrc="([^"]+)"', page)
    assert len(sources) == len([n for n in names if n.endswith(".png")])
    for src in sources:
        if src.startswith("data:"):
            assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG_MAGIC)
        else:
            assert (out / src).is_file()
    for needed in ("Knees", "Pareto frontier", "Provenance", "abc123", "cpu: test", "float32", "<table>"):
        assert needed in page
    markdown = (out / "report.md").read_text()
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown):
        assert (out / image).is_file()
    assert "| snapkv |" in markdown


def test_report_default_out_is_inside_the_results_dir(tmp_path, capsys):
    results = store(tmp_path, [row("full", 1.0, "e0", 1.0), row("streamingllm", 0.5, "e0", 0.0)])
    assert report_main([str(results)]) == 0
    assert (results / "report" / "report.html").is_file()


@pytest.mark.parametrize("case", ["missing", "empty", "incompatible"])
def test_report_bad_input_exits_2_with_one_line(tmp_path, capsys, case):
    target = tmp_path / "results"
    if case != "missing":
        target.mkdir()
    if case == "incompatible":
        store(target, [row("full", 1.0, "e0", 1.0, schema_version=99)])
    assert report_main([str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvbench.report: error:")
    assert {"missing": "no such file", "empty": "no result rows", "incompatible": "schema_version"}[case] in err[0]


def test_rows_without_subsets_still_match_the_full_cache(tmp_path):
    # an all-missing column reads back from Parquet as object/None in one file and float/NaN in another
    write_rows(pd.DataFrame([row("full", 1.0, "e0", 1.0, subset=None)]), tmp_path / "rows" / "a.parquet")
    write_rows(pd.DataFrame([row("h2o", 0.5, "e0", 0.25, subset=None, timestamp="2026-01-02T00:00:00+00:00")]),
               tmp_path / "rows" / "b.parquet")
    summary = summarize(load_rows([tmp_path]))
    assert summary.query("level == 'subset' and method == 'h2o'")["drop_vs_full"].tolist() == [0.75]


def test_perplexity_is_lower_is_better_and_never_pooled_with_scores():
    from kvbench.aggregate import knees, pareto, summarize

    rows = [row("full", 1.0, f"w{i}", 10.0, task="ppl", metric="perplexity") for i in range(3)]
    rows += [row("h2o", 0.25, f"w{i}", 12.0, task="ppl", metric="perplexity") for i in range(3)]  # worse
    rows += [row("h2o", 0.5, f"w{i}", 10.01, task="ppl", metric="perplexity") for i in range(3)]  # within 0.02
    rows += [row("full", 1.0, "n1", 1.0), row("h2o", 0.25, "n1", 1.0)]
    summary = summarize(pd.DataFrame(rows))
    overall = summary[(summary.level == "overall") & (summary.method == "h2o") & (summary.budget == 0.25)]
    assert overall.score.tolist() == [1.0]  # only the NIAH score, not a mean of 1.0 and 12.0
    knee = knees(summary, 0.02)
    ppl_knee = knee[(knee.level == "task") & (knee.task == "ppl")]
    assert ppl_knee.knee_budget.tolist() == [0.5]  # 0.25 raised perplexity by 2: not within tolerance
    frontier = pareto(summary)
    ppl_front = frontier[(frontier.level == "task") & (frontier.task == "ppl")]
    # lowest perplexity wins: each point is best at its own cache size
    assert set(zip(ppl_front.method, ppl_front.budget)) == {("h2o", 0.25), ("h2o", 0.5), ("full", 1.0)}


def test_registered_report_sections_appear_when_their_columns_do(tmp_path):
    from kvbench.report_sections import SECTIONS, Section, report_section

    @report_section("Reuse check", needs=["reused_tokens"], where="summary")
    def reuse(rows, summary, out_dir):
        return Section(html=f"<p>mean reused {rows['reused_tokens'].mean():g}</p>",
                       markdown=f"mean reused {rows['reused_tokens'].mean():g}")

    try:
        plain = store(tmp_path / "plain", [row("full", 1.0, "e0", 1.0)])
        assert report_main([str(plain), "--out", str(tmp_path / "a")]) == 0
        assert "Reuse check" not in (tmp_path / "a" / "report.html").read_text()
        extra = store(tmp_path / "extra", [row("full", 1.0, "e0", 1.0, reused_tokens=6),
                                           row("full", 1.0, "e1", 1.0, reused_tokens=2)])
        assert report_main([str(extra), "--out", str(tmp_path / "b")]) == 0
        page = (tmp_path / "b" / "report.html").read_text()
        assert "<h2>Reuse check</h2>" in page and "mean reused 4" in page
        assert "mean reused 4" in (tmp_path / "b" / "report.md").read_text()
    finally:
        SECTIONS[:] = [s for s in SECTIONS if s.build is not reuse]
