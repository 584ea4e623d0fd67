"""The report's RULER leaderboard (kvbench/report/sections/leaderboard.py), torch-free, on a small synthetic rows
frame: one line per method × compression ratio with RULER's 0–100 score and its interval, the measured kv_ratio
and the timings; other tasks' rows left out; kvpress's plot written; the section inside the whole report."""

import json

import pandas as pd
import pytest

from kvbench.report.build import build_report
from kvbench.report.section import Context
from kvbench.report.sections.leaderboard import labels, leaderboard, ruler_leaderboard
from kvbench.store.aggregate import press_label, variant_label
from tests.report.test_report import row, store

N = 6  # examples per configuration: 3 tasks × 2 samples


def ruler_rows(method: str, budget: float, hits: int, kv_ratio: float, query_aware: bool = False, **more) -> list:
    """N examples over 3 RULER tasks, the first `hits` answered."""
    return [
        row(method, budget, f"ruler-t{i % 3}-i{i}", float(i < hits), task="ruler", subset=f"t{i % 3}",
            kv_ratio=kv_ratio, query_aware=query_aware, prefill_s=0.25 + budget, decode_ms_per_token=7.0, **more)
        for i in range(N)
    ]  # fmt: skip


@pytest.fixture
def frame():
    rows = ruler_rows("full", 1.0, 6, 1.0)
    rows += ruler_rows("snapkv", 0.5, 5, 0.52) + ruler_rows("snapkv", 0.25, 3, 0.27)
    rows += ruler_rows("streamingllm", 0.5, 4, 0.5) + ruler_rows("streamingllm", 0.25, 1, 0.25)
    rows += [row("snapkv", 0.5, f"n{i}", 0.0, task="niah") for i in range(N)]  # not RULER: left out
    rows += [row("snapkv", 1024, f"r{i}", 1.0, task="ruler") for i in range(N)]  # a token budget: no ratio
    return pd.DataFrame(rows)


def test_one_line_per_method_and_ratio_with_measurements(frame):
    table = leaderboard(frame).set_index(["method", "ratio"])
    assert sorted(table.index) == [("full", 0.0), ("snapkv", 0.5), ("snapkv", 0.75)] + [
        ("streamingllm", 0.5),
        ("streamingllm", 0.75),
    ]
    snap = table.loc[("snapkv", 0.5)]
    assert snap["n"] == N and snap["tasks"] == 3
    assert snap["score"] == pytest.approx(100 * 5 / 6)
    assert snap["ci_low"] < snap["score"] < snap["ci_high"] <= 100  # Wilson on 0/1 scores, RULER's scale
    assert snap["kv_ratio"] == pytest.approx(0.52)  # measured, not the knob
    assert snap["prefill_s"] == pytest.approx(0.75) and snap["decode_ms_per_token"] == 7.0
    assert table.loc[("full", 0.0), "score"] == 100
    assert table.loc[("streamingllm", 0.75), "score"] == pytest.approx(100 / 6)


def test_section_has_a_sortable_table_and_kvpress_plot(frame, tmp_path):
    section = ruler_leaderboard(frame, pd.DataFrame(), Context(out_dir=tmp_path))
    assert section is not None
    assert '<table class="sortable' in section.html and "compression ratios: 0.5, 0.75" in section.html
    assert section.files == [tmp_path / "leaderboard_ruler.png"] and section.files[0].stat().st_size > 10_000
    line = next(x for x in section.markdown.splitlines() if "snapkv" in x and "| 0.5 |" in x)
    assert "83.3" in line and "0.520" in line  # score, measured kv_ratio
    assert "niah" not in section.markdown
    page = (tmp_path / "leaderboard.html").read_text()  # the page alone: table, sorting script, plot inline
    assert '<table class="sortable' in page and "addEventListener('click'" in page and "data:image/png" in page
    standalone = (tmp_path / "leaderboard.md").read_text()
    assert "| 83.3 |" in standalone
    # the score by compression ratio: a column per ratio, ordered by the mean over the ratios each ran
    grid = standalone.split("## Score by compression ratio")[1].split("## Every line")[0]
    heading = next(x for x in grid.splitlines() if x.startswith("| model"))
    assert heading.split("|")[6:10] == [
        " 0 ",
        " 0.5 ",
        " 0.75 ",
        " mean ",
    ]  # after model, length, setting, engine, method
    lines = [x for x in grid.splitlines() if x.startswith("| tiny ")]
    assert [x.split("|")[5].strip() for x in lines] == ["full", "snapkv", "streamingllm"]
    assert lines[1].split("|")[7:10] == [" 83.3 ", " 50.0 ", " 66.7 "]  # snapkv at 0.5, 0.75, their mean
    csv = pd.read_csv(tmp_path / "leaderboard.csv")
    assert len(csv) == 5 and set(csv["method"]) == {"full", "snapkv", "streamingllm"}


def test_presses_knobs_engines_and_quantized_caches_are_told_apart(frame):
    """kvpress's presses by class (not all "kvpress"), kivi's bits, a knob off its yaml's default, llama.cpp's
    snapkv apart from kvbench's, and a cache without a budget at 1 − its measured kv_ratio."""
    press = '{"press": {"name": "AdaKVPress", "press": "CompactorPress"}, "press_kwargs": {}}'
    more = ruler_rows("kvpress", 0.5, 2, 0.5, method_params=press) + ruler_rows(
        "kvpress", 0.5, 1, 0.5, method_params='{"press": "LagKVPress", "press_kwargs": {}}'
    )
    more += ruler_rows("kivi", 1.0, 6, 0.27, method_params='{"bits": 4, "group_size": 64}')
    more += ruler_rows("kivi", 1.0, 0, 0.14, method_params='{"bits": 2, "group_size": 64}')
    more += ruler_rows("rkv", 0.5, 3, 0.5, method_params='{"evict_every": 128, "window_size": 8}')  # not its yaml's 1
    more += ruler_rows("snapkv", 0.5, 0, 0.5, engine="llamacpp") + ruler_rows("full", 1.0, 6, 1.0, engine="llamacpp")
    table = leaderboard(pd.concat([frame, pd.DataFrame(more)], ignore_index=True))
    table = table.set_index(["engine", "method", "ratio"])
    assert table.loc[("kvbench", "AdaKVPress(CompactorPress)", 0.5), "score"] == pytest.approx(100 * 2 / 6)
    assert table.loc[("kvbench", "LagKVPress", 0.5), "score"] == pytest.approx(100 / 6)
    bits4 = table.loc[("kvbench", "kivi(bits=4)", 0.73)]  # no budget: 1 − 0.27 measured, said so
    assert bits4["score"] == 100 and not bits4["nominal"] and table.loc[("kvbench", "kivi(bits=2)", 0.86), "n"] == N
    assert table.loc[("kvbench", "rkv(evict_every=128)", 0.5), "score"] == 50  # named by the knob it changed
    assert table.loc[("llamacpp", "snapkv", 0.5), "score"] == 0  # not merged with kvbench's snapkv
    assert table.loc[("kvbench", "snapkv", 0.5), "score"] == pytest.approx(100 * 5 / 6)
    assert table.loc[("kvbench", "full", 0.0), "nominal"] and table.loc[("llamacpp", "full", 0.0), "score"] == 100


def test_no_ruler_rows_no_section(tmp_path):
    frame = pd.DataFrame([row("snapkv", 0.5, f"n{i}", 1.0) for i in range(N)])
    assert ruler_leaderboard(frame, pd.DataFrame(), Context(out_dir=tmp_path)) is None


def test_in_the_report(frame, tmp_path):
    written = build_report([store(tmp_path, frame.to_dict("records"))], tmp_path / "report", 0.02)
    page = (tmp_path / "report" / "report.html").read_text()
    assert "RULER leaderboard (kvpress&#x27;s protocol)" in page or "RULER leaderboard (kvpress's protocol)" in page
    assert (tmp_path / "report" / "leaderboard_ruler.png") in written or (
        tmp_path / "report" / "leaderboard_ruler.png"
    ).exists()


def test_pair_agreement_with_kvpress_board(frame):
    """Method pairs ordered alike, opposite or tied between our table and kvpress's published scores."""
    from kvbench.report.sections.leaderboard import pair_agreement

    ours = leaderboard(frame)  # snapkv 83.3 / 50.0, streamingllm 66.7 / 16.7 at ratios 0.5 / 0.75
    theirs = pd.DataFrame(
        dict(press_name=["snapkv", "streaming_llm", "snapkv", "streaming_llm", "snapkv"],
             query_aware=[False, False, False, False, True], compression_ratio=[0.5, 0.5, 0.75, 0.75, 0.5],
             score=[69.7, 59.2, 30.0, 37.7, 88.9])
    )  # fmt: skip
    pairs = pair_agreement(ours, theirs).set_index("ratio")
    assert list(pairs.index) == [0.5, 0.75]  # the query-aware snapkv has no query-aware row of ours: no pair
    assert pairs.loc[0.5, "verdict"] == "same" and pairs.loc[0.75, "verdict"] == "opposite"
    assert (pairs.loc[0.5, "a"], pairs.loc[0.5, "b"]) == ("snapkv", "streaming_llm")
    assert not pairs["apart"].any()  # 6 examples: the intervals overlap


def test_lengths_are_never_pooled(frame, tmp_path):
    """The same model at 16K and 32K (the Qwen command runs both): a line per length, each its own panel."""
    long = pd.DataFrame(ruler_rows("full", 1.0, 2, 1.0) + ruler_rows("snapkv", 0.5, 0, 0.5)).assign(length_target=32768)
    both = pd.concat([frame.assign(length_target=16384), long], ignore_index=True)
    table = leaderboard(both).set_index(["length", "method", "ratio"])
    assert (
        table.loc[(16384, "snapkv", 0.5), "score"] == pytest.approx(100 * 5 / 6)
        and table.loc[(16384, "snapkv", 0.5), "n"] == N
    )
    assert table.loc[(32768, "snapkv", 0.5), "score"] == 0 and table.loc[
        (32768, "full", 0.0), "score"
    ] == pytest.approx(100 / 3)
    section = ruler_leaderboard(both, pd.DataFrame(), Context(out_dir=tmp_path))
    assert "| 16,384 |" in section.markdown and "| 32,768 |" in section.markdown


def test_a_press_with_every_resolved_field_through_the_whole_report(frame, tmp_path):
    """method=kvpress rows as the store holds them (the press and every field kvpress resolved, ~300 characters) go
    through the whole report: the press is named by its classes on the page and in the plots' labels, and no file
    name or conf lookup grows with the fields."""
    resolved = "AdaKVPress(press=CompactorPress(" + ", ".join(f"field_{i}={i}" for i in range(30)) + "))"
    params = json.dumps(
        {"press": {"name": "AdaKVPress", "press": "CompactorPress"}, "press_kwargs": {}, "resolved": resolved}
    )
    more = ruler_rows("kvpress", 0.5, 2, 0.5, method_params=params)
    build_report([store(tmp_path, frame.to_dict("records") + more)], tmp_path / "report", 0.02)
    page = pd.read_csv(tmp_path / "report" / "leaderboard.csv").set_index("method")
    assert page.loc["AdaKVPress(CompactorPress)", "score"] == pytest.approx(100 * 2 / 6, abs=0.01)  # csv: 2 decimals
    assert max(len(p.name) for p in (tmp_path / "report").iterdir()) < 160
    assert variant_label("kvpress", json.loads(params)) == "kvpress(AdaKVPress(CompactorPress))"


@pytest.mark.parametrize(
    ("press", "label"),
    [
        ("LagKVPress", "LagKVPress"),
        ({"name": "AdaKVPress", "press": "CompactorPress"}, "AdaKVPress(CompactorPress)"),
        (
            {"block_size": 128, "name": "BlockPress", "press": "KeyDiffPress"},
            "BlockPress(KeyDiffPress, block_size=128)",
        ),
        (
            {"name": "AdaKVPress", "press": {"name": "SnapKVPress", "window_size": 32}},
            "AdaKVPress(SnapKVPress(window_size=32))",
        ),
    ],
)
def test_a_press_is_named_by_its_classes_and_the_fields_it_was_given(press, label):
    """Two BlockPresses of different block sizes are two lines, on the page and in every plot."""
    assert press_label(press) == label and variant_label("kvpress", {"press": press}) == f"kvpress({label})"
    assert variant_label("kvpress @1a2b3c4d", {"press": press}) == f"kvpress({label}) @1a2b3c4d"  # two code versions
    for stored in ("kvpress", f"kvpress({label})", "kvpress @1a2b3c4d", f"kvpress({label}) @1a2b3c4d"):
        row = pd.DataFrame({"method": [stored], "method_params": [json.dumps({"press": press})]})
        assert labels(row).iloc[0] == label + (" @1a2b3c4d" if "@" in stored else "")
