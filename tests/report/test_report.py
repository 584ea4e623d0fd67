"""kvbench.store.aggregate and kvbench.report.build on synthetic rows (no model): statistics with known answers, drop vs the
full cache on matched examples, knees, Pareto, plots and the self-contained HTML."""

from __future__ import annotations

import base64
import math
import re

import pandas as pd
import pytest

from kvbench import KvbenchError
from kvbench.report.build import main as report_main
from kvbench.store.aggregate import ALL, knees, load_rows, pareto, summarize
from kvbench.store.intervals import mean_interval, wilson
from kvbench.store.results import COLUMNS, SCHEMA_VERSION, write_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(
    method: str,
    budget: float,
    example_id: str,
    score: float,
    *,
    task: str = "niah",
    subset: str = "s1",
    kv_ratio: float | None = None,
    query_aware: bool = True,
    model: str = "tiny",
    timestamp: str = "2026-01-01T00:00:00+00:00",
    **extra,
) -> dict:
    """One result row with every ★ column (plus schema_version and dtype, as the runner writes them)."""
    kv_ratio = budget if kv_ratio is None else kv_ratio
    values = dict(
        run_id="run-1",
        timestamp=timestamp,
        git_sha="abc123",
        config_hash=f"{model}-{task}-{method}-{budget}-{query_aware}",
        kvbench_version="0.1.0",
        torch_version="2.x",
        transformers_version="5.x",
        device_name="cpu: test",
        model=model,
        task=task,
        subset=subset,
        example_id=example_id,
        context_tokens=1000,
        new_tokens=5,
        method=method,
        budget=float(budget),
        method_params="{}",
        query_aware=query_aware,
        score=float(score),
        metric="string_match",
        prediction="x",
        answers='["x"]',
        kv_bytes=int(1e6 * kv_ratio),
        kv_bytes_full=1_000_000,
        kv_ratio=kv_ratio,
        peak_mem_bytes=int(5e7 + 1e7 * kv_ratio),
        prefill_s=0.5,
        decode_s=0.1,
        decode_ms_per_token=20.0 + 10 * kv_ratio,
        seed=0,
        schema_version=SCHEMA_VERSION,
        dtype="float32",
        reused=False,
    )
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
                rows.append(
                    row(
                        method,
                        budget,
                        f"niah-L{length}-D{depth}",
                        score,
                        length_target=length,
                        depth=depth,
                        score_partial=min(1.0, score + 0.3),
                    )
                )
    return rows


# ----------------------------------------------------------------------------------------- statistics


def test_wilson_matches_known_values_and_stays_in_0_1():
    assert wilson(9, 10) == pytest.approx((0.5958, 0.9821), abs=1e-4)  # Wilson 1927 / R's prop.test(correct=F)
    assert wilson(0, 5)[0] == 0.0 and wilson(5, 5)[1] == 1.0


def test_intervals_respect_the_metric_range_and_need_five_examples():
    mean, low, high, how = mean_interval([0, 1, 1, 1, 1, 1])  # Student-t gave 0.40–1.26 here
    assert how == "wilson" and 0.0 <= low < mean < high <= 1.0
    mean, low, high, how = mean_interval([0.0, 0.0, 0.0, 0.0, 0.1])  # t: below 0
    assert how == "bootstrap" and low == 0.0 and 0.02 < high <= 0.1 and mean == pytest.approx(0.02)
    assert mean_interval([0.9, 1.0, 1.0, 1.0, 1.0])[2] <= 1.0
    mean, low, high, how = mean_interval([1.0, 0.0])  # n = 2: a mean, no interval
    assert mean == 0.5 and math.isnan(low) and math.isnan(high) and how == ""
    _, low, high, how = mean_interval([10.0, 12.0, 11.0, 13.0, 9.5], score_range=(1.0, math.inf))
    assert how == "bootstrap" and 9.5 <= low < high <= 13.0
    assert mean_interval([0.3, 0.5, 0.2, 0.9, 0.4]) == mean_interval([0.3, 0.5, 0.2, 0.9, 0.4])  # seeded
    assert all(math.isnan(v) for v in mean_interval([])[:3])


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


def test_pooled_numbers_compare_only_configurations_on_the_same_examples():
    # the reference report's bug: full over NIAH + RULER (0.59) ranked against compose over NIAH only (1.0)
    rows = [row("full", 1.0, f"n{i}", 1.0) for i in range(6)]
    rows += [row("full", 1.0, f"r{i}", 0.0, task="ruler") for i in range(6)]
    rows += [row("snapkv", 0.5, f"n{i}", 1.0) for i in range(6)] + [
        row("snapkv", 0.5, f"r{i}", 0.0, task="ruler") for i in range(6)
    ]
    rows += [row("compose", 0.5, f"n{i}", 1.0) for i in range(6)]  # NIAH only
    rows += (
        [row("h2o", 0.5, f"n{i}", float(i < 3)) for i in range(6)]
        + [row("h2o", 0.5, f"r{i}", 0.0, task="ruler") for i in range(6)]
        + [row("h2o", 0.5, "r-extra", 1.0, task="ruler")]
    )  # one example nobody else ran
    summary = summarize(pd.DataFrame(rows)).set_index(["level", "task", "method"]).sort_index()
    overall = summary.loc["overall", ALL]
    assert overall.loc["full", "compared"] and overall.loc["full", "n"] == 12
    assert overall.loc["full", "score"] == 0.5 and overall.loc["snapkv", "compared"]
    assert not overall.loc["compose", "compared"]  # kept apart, with its own n and tasks
    assert overall.loc["compose", "n"] == 6 and overall.loc["compose", "tasks"] == "niah"
    assert overall.loc["full", "tasks"] == "niah, ruler"
    # h2o is compared on the 12 common examples: its extra RULER example is left out of every pooled number
    assert overall.loc["h2o", "n"] == 12 and overall.loc["h2o", "score"] == 0.25
    assert summary.loc[("task", "ruler", "h2o"), "n"] == 6 and summary.loc[("task", "ruler", "h2o"), "score"] == 0
    assert summary.loc[("task", "niah", "compose"), "compared"]  # on NIAH alone it ran everything
    knee = knees(summarize(pd.DataFrame(rows)), 0.02).query("level == 'overall'")
    assert "compose" not in set(knee["method"])
    front = pareto(summarize(pd.DataFrame(rows))).query("level == 'overall'")
    assert "compose" not in set(front["method"])


def test_report_keeps_partial_configurations_apart(tmp_path):
    rows = [row("full", 1.0, f"n{i}", 1.0) for i in range(6)] + [
        row("full", 1.0, f"r{i}", 0.0, task="ruler") for i in range(6)
    ]
    rows += [row("compose", 0.5, f"n{i}", 1.0, method_params='{"stack": ["snapkv", "kivi"]}') for i in range(6)]
    out = tmp_path / "out"
    assert report_main([str(store(tmp_path / "results", rows)), "--out", str(out)]) == 0
    csv = pd.read_csv(out / "summary.csv").query("level == 'overall'").set_index("method")
    assert not csv.loc["compose(snapkv+kivi)", "compared"] and csv.loc["full", "compared"]
    page = (out / "report.html").read_text()
    overall = page[page.index('id="overall"') :]
    compared, apart = overall.split("Ran on only part of the examples", 1)
    assert "compose(snapkv+kivi)" not in compared.split("</table>")[0] and "compose(snapkv+kivi)" in apart


def test_knee_and_pareto_on_a_constructed_curve():
    curve = {0.1: 0.5, 0.25: 0.97, 0.5: 0.99, 1.0: 1.0}
    rows = [row("full", 1.0, "e0", 1.0)] + [row("snapkv", b, "e0", s) for b, s in curve.items()]
    rows += [row("random", 0.05, "e0", 0.2), row("random", 0.3, "e0", 0.6)]
    summary = summarize(pd.DataFrame(rows))
    knee = knees(summary, tolerance=0.02).query("level == 'task'").set_index("method")
    assert knee.loc["snapkv", "knee_budget"] == 0.5  # 0.25 drops 0.03 > 0.02
    assert math.isnan(knee.loc["random", "knee_budget"]) and "full" not in knee.index
    assert (
        knees(summary, tolerance=0.05).query("level == 'task'").set_index("method").loc["snapkv", "knee_budget"] == 0.25
    )
    front = pareto(summary).query("level == 'task'")
    points = set(zip(front["method"], front["budget"]))
    # random@0.3 (0.6) is beaten by snapkv@0.25 (0.97); snapkv@1.0 ties full and so is not beaten
    assert points == {
        ("random", 0.05),
        ("snapkv", 0.1),
        ("snapkv", 0.25),
        ("snapkv", 0.5),
        ("snapkv", 1.0),
        ("full", 1.0),
    }
    assert list(front["kv_ratio"]) == sorted(front["kv_ratio"])


# ----------------------------------------------------------------------------------------- loading


def test_load_rows_merges_paths_and_keeps_the_newest(tmp_path):
    old = store(tmp_path / "a", [row("full", 1.0, "e0", 0.0, timestamp="2026-01-01T00:00:00+00:00")])
    new = store(
        tmp_path / "b",
        [row("full", 1.0, "e0", 1.0, timestamp="2026-02-01T00:00:00+00:00"), row("full", 1.0, "e1", 1.0)],
    )
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
    rows += [
        row(m, b, f"q{i}", (i % 2) * b + (1 - b) * (m == "full"), task="qa", subset=f"sub{i % 2}")
        for m, b in configs
        for i in range(4)
    ]
    results = store(tmp_path / "results", rows)
    out = tmp_path / "out"
    assert report_main([str(results), "--out", str(out), "--tolerance", "0.05"]) == 0
    written = [line for line in capsys.readouterr().out.splitlines() if line]
    names = {p.split("/")[-1] for p in written}
    # NIAH at 1024 and 2048 tokens: a plot per length; qa has no length; no two tasks share one: nothing pooled
    scopes = ("niah_1024", "niah_2048", "qa")
    expected = {f"{kind}_{scope}.png" for kind in ("quality", "pareto", "costs") for scope in scopes}
    assert not any("overall" in n for n in names)
    expected |= {
        "heatmap_niah_full.png",
        "heatmap_niah_streamingllm.png",
        "heatmap_niah_snapkv.png",
        "report.html",
        "report.md",
        "summary.csv",
    }
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
    for needed in ("Knees", "Pareto frontier", "Provenance", "abc123", "cpu: test", "float32", "<table"):
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
    write_rows(
        pd.DataFrame([row("h2o", 0.5, "e0", 0.25, subset=None, timestamp="2026-01-02T00:00:00+00:00")]),
        tmp_path / "rows" / "b.parquet",
    )
    summary = summarize(load_rows([tmp_path]))
    assert summary.query("level == 'subset' and method == 'h2o'")["drop_vs_full"].tolist() == [0.75]


def test_perplexity_is_lower_is_better_and_never_pooled_with_scores():
    from kvbench.store.aggregate import knees, pareto, summarize

    rows = [row("full", 1.0, f"w{i}", 10.0, task="ppl", metric="perplexity") for i in range(3)]
    rows += [row("h2o", 0.25, f"w{i}", 12.0, task="ppl", metric="perplexity") for i in range(3)]  # worse
    rows += [row("h2o", 0.5, f"w{i}", 10.01, task="ppl", metric="perplexity") for i in range(3)]  # within 0.02
    rows += [row("full", 1.0, "n1", 1.0), row("h2o", 0.25, "n1", 1.0)]
    summary = summarize(pd.DataFrame(rows))
    assert "overall" not in set(summary.level)  # one task with scores: nothing to pool, never 1.0 with 12.0
    knee = knees(summary, 0.02)
    ppl_knee = knee[(knee.level == "task") & (knee.task == "ppl")]
    assert ppl_knee.knee_budget.tolist() == [0.5]  # 0.25 raised perplexity by 2: not within tolerance
    frontier = pareto(summary)
    ppl_front = frontier[(frontier.level == "task") & (frontier.task == "ppl")]
    # lowest perplexity wins: each point is best at its own cache size
    assert set(zip(ppl_front.method, ppl_front.budget)) == {("h2o", 0.25), ("h2o", 0.5), ("full", 1.0)}


def test_registered_report_sections_appear_when_their_columns_do(tmp_path):
    from kvbench.report.section import SECTIONS, Section, report_section

    seen = []

    @report_section("Reuse check", needs=["reused_tokens"], where="summary")
    def reuse(rows, summary, context):
        seen.append(context)
        return Section(
            html=f"<p>mean reused {rows['reused_tokens'].mean():g}</p>",
            markdown=f"mean reused {rows['reused_tokens'].mean():g}",
        )

    try:
        plain = store(tmp_path / "plain", [row("full", 1.0, "e0", 1.0)])
        assert report_main([str(plain), "--out", str(tmp_path / "a")]) == 0
        assert "Reuse check" not in (tmp_path / "a" / "report.html").read_text()
        extra = store(
            tmp_path / "extra",
            [row("full", 1.0, "e0", 1.0, reused_tokens=6), row("full", 1.0, "e1", 1.0, reused_tokens=2)],
        )
        assert report_main([str(extra), "--out", str(tmp_path / "b")]) == 0
        page = (tmp_path / "b" / "report.html").read_text()
        assert "<h3>Reuse check</h3>" in page and "mean reused 4" in page  # inside Takeaways
        assert page.index("Reuse check") < page.index('id="plots"')
        assert "mean reused 4" in (tmp_path / "b" / "report.md").read_text()
        # the report's inputs and directory reach the section as its context (no module state between reports)
        assert [(c.out_dir, c.inputs) for c in seen] == [(tmp_path / "b", (extra,))]
        with pytest.raises(AttributeError):
            seen[0].inputs = ()  # frozen: a section cannot change what the next one sees
    finally:
        SECTIONS[:] = [s for s in SECTIONS if s.build is not reuse]


def test_no_module_global_carries_the_report_inputs():
    import kvbench.report.section as section

    assert not hasattr(section, "INPUTS")
    assert {name for name, value in vars(section).items() if isinstance(value, list)} == {"SECTIONS"}


def test_the_headline_plot_opens_the_report_before_any_table(tmp_path):
    """First under the title: quality vs measured kv_ratio per task, then the takeaways and the selection guide."""
    rows = niah_grid([("full", 1.0), ("snapkv", 0.25), ("snapkv", 0.5)], lambda m, b, length, depth: b)
    out = tmp_path / "out"
    assert report_main([str(store(tmp_path / "results", rows)), "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "Which method (selection guide)" in page  # the guide's table is there, after the plot
    first_img = page.index("<img")
    assert first_img < page.index("<table") and first_img < page.index("Which method (selection guide)")
    assert 'alt="quality_niah_1024"' in page[first_img : first_img + 40]  # a plot per length
    markdown = (out / "report.md").read_text()
    lines = markdown.splitlines()
    first_table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    first_image = next(i for i, line in enumerate(lines) if line.startswith("!["))
    assert first_image < first_table and lines[first_image] == "![quality_niah_1024](quality_niah_1024.png)"
    assert first_image < lines.index("### Which method (selection guide)")


def test_an_interval_below_five_examples_is_said_never_printed_as_nan(tmp_path):
    from kvbench.store.intervals import NO_INTERVAL, NO_INTERVAL_SHORT, interval_text

    assert interval_text(math.nan, math.nan) == NO_INTERVAL_SHORT == "n<5: no interval"
    assert interval_text(math.nan, math.nan, short=False) == NO_INTERVAL == "n too small for an interval"
    assert interval_text(None, None) == NO_INTERVAL_SHORT and interval_text(0.354, 0.8789, digits=3) == "0.354–0.879"
    rows = [row(m, b, f"e{i}", s) for m, b, s in [("full", 1.0, 1.0), ("snapkv", 0.5, 0.0)] for i in range(3)]
    out = tmp_path / "out"
    assert report_main([str(store(tmp_path / "results", rows)), "--out", str(out)]) == 0
    markdown = (out / "report.md").read_text()
    assert "| full | 1 | 3 | 1.000 | n<5: no interval |" in markdown  # the per-task table
    assert "the full cache scores 1.000 (n too small for an interval)" in markdown  # the takeaways
    assert "| snapkv | 3 | 0.000 (n<5: no interval) |" in markdown  # the selection guide's summary
    page = re.sub(r'src="data:[^"]*"', "", (out / "report.html").read_text())
    for text in (markdown, page):
        assert not re.search(r"\bnan\b", text, re.IGNORECASE)


class _Outline(__import__("html.parser").parser.HTMLParser):
    """The page's h2 ids in order, and every table's rows (cell texts) with the nearest preceding anchor."""

    def __init__(self):
        super().__init__()
        self.order, self.tables, self._anchor, self._cell = [], [], "", None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self._anchor = attrs["id"]
            if tag == "h2":
                self.order.append(attrs["id"])
        if tag == "table":
            self.tables.append((self._anchor, []))
        elif tag == "tr":
            self.tables[-1][1].append([])
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][1][-1].append(self._cell)
            self._cell = None


def test_page_leads_with_takeaways_and_never_pools_unlike_example_sets(tmp_path):
    rows = [row("full", 1.0, f"n{i}", 1.0) for i in range(6)] + [
        row("full", 1.0, f"r{i}", float(i < 2), task="ruler") for i in range(6)
    ]
    rows += [row("snapkv", b, f"n{i}", float(i < 5)) for b in (0.25, 0.5) for i in range(6)]
    rows += [row("snapkv", b, f"r{i}", 0.0, task="ruler") for b in (0.25, 0.5) for i in range(6)]
    rows += [row("compose", 0.5, f"n{i}", 1.0, method_params='{"stack": ["snapkv", "kivi"]}') for i in range(6)]
    rows += [row("h2o", 0.5, f"n{i}", 1.0) for i in range(3)]  # n = 3: no interval, greyed
    out = tmp_path / "out"
    assert report_main([str(store(tmp_path / "results", rows)), "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    outline = _Outline()
    outline.feed(page)
    assert outline.order[:3] == ["takeaways", "plots", "tables"] and outline.order[-1] == "provenance"
    assert page.index('id="takeaways"') < page.index("<img") < page.index('id="plots"')  # headline plot first
    takeaways = page[page.index('id="takeaways"') : page.index('id="plots"')]
    assert "Knees" in takeaways and "Budget 0.5: best" in takeaways
    assert "Not ranked (ran on only part of the examples): compose(snapkv+kivi)" in takeaways
    # every table after the overall anchor: the first holds only configurations run on all 12 examples
    overall = [cells for anchor, cells in outline.tables if anchor == "overall"]
    heading, *body = overall[0]
    n = heading.index("n")
    assert {r[0] for r in body} == {"full", "snapkv"} and {r[n] for r in body} == {"12"}
    assert {r[0] for r in overall[1][1:]} == {"compose(snapkv+kivi)", "h2o"}
    # n < 5: no interval, greyed row
    assert re.search(r"<tr class=few><td>h2o</td>.*?n&lt;5", page)
    assert page.count("<script>") == 1 and "<link" not in page and "@import" not in page
    for src in re.findall(r'src="([^"]+)"', page):
        assert src.startswith("data:image/png;base64,")  # self-contained: nothing fetched


def test_python_m_kvbench_report_and_check_import_neither_torch_nor_transformers(tmp_path):
    import subprocess
    import sys

    results = store(tmp_path / "results", [row("full", 1.0, "e0", 1.0), row("snapkv", 0.5, "e0", 1.0)])
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['kvbench.report', {str(results)!r}, '--out', {str(tmp_path / 'out')!r}]\n"
        "try:\n    runpy.run_module('kvbench.report', run_name='__main__')\nexcept SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "import kvbench.report.gate\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "out" / "report.html").is_file()


def test_tasks_declare_their_facts_and_the_plots_follow_them(tmp_path, capsys):
    from kvbench.tasks import TASKS
    from kvbench.tasks.facts import TaskFacts, task_facts

    for name in TASKS.names():
        assert isinstance(task_facts(name), TaskFacts)  # every registered task's facts are valid
    assert task_facts("ppl").lower_is_better and task_facts("ppl").score_range[0] == 1.0
    assert "heatmap" in task_facts("niah").plots and task_facts("not-a-task") == TaskFacts()
    with pytest.raises(ValueError, match="unknown"):
        TaskFacts(plots=("pie",))
    # the same grid columns on a task that declares no heatmap (here an unregistered one) give no heatmap
    grid = niah_grid([("full", 1.0)], lambda *_: 1.0)
    rows = grid + [{**r, "task": "other", "config_hash": "other-" + r["config_hash"]} for r in grid]
    assert report_main([str(store(tmp_path / "results", rows)), "--out", str(tmp_path / "out")]) == 0
    names = {p.split("/")[-1] for p in capsys.readouterr().out.split()}
    assert "heatmap_niah_full.png" in names and not any(n.startswith("heatmap_other") for n in names)


def test_peak_by_prefill_reads_streamed_rows_from_before_peak_mem_delta_bytes():
    from kvbench.report.sections.prefill import peak_table
    from tests.conftest import ppl_window_rows

    # ppl windows written before the column existed: the absolute peak alone
    windows = ppl_window_rows().drop(columns=["run_id", "prefill_chunk", "peak_mem_delta_bytes"])
    table = peak_table(windows)
    assert table.iloc[0][["shared", "inline"]].tolist() == ["– (950)", "– (860)"]  # one stream each, at its peak


def test_plot_file_names_stay_short_and_apart():
    """A kvpress press's label holds every nested field (AdaKVPress(CompactorPress) is ~300 characters): its plots'
    file names are cut with a hash of the whole, so they open on any file system and two long labels never collide."""
    from kvbench.report.plots import SLUG_MAX, slug

    assert slug("smollm2-135m", "ruler", "snapkv", "context-only") == "smollm2-135m_ruler_snapkv_context-only"
    press = "kvpress(press={name: AdaKVPress, press: CompactorPress, " + "sketch_dimension: 48, " * 12
    a, b = slug("m", "ruler", press + "a}", "context-only"), slug("m", "ruler", press + "b}", "context-only")
    assert len(a) == len(b) == SLUG_MAX and a != b and a.startswith("m_ruler_kvpress-press-name-AdaKVPress")
    assert len(f"heatmap_{a}.png".encode()) < 255
