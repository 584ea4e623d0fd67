"""The report's serving section (kvbench/report/sections/serving.py) on synthetic run rows beside a store."""

from __future__ import annotations

import pandas as pd

from kvbench.report.build import main as report_main
from kvbench.report.sections.serving import render, shown_table
from tests.report.test_report import row, store


def runs() -> pd.DataFrame:
    out = []
    for method, budget, tokens_s, conc in (("full", 1.0, 40.0, [2, 8]), ("snapkv", 0.25, 90.0, [6, 8])):
        for kv_budget, c in zip((40_000_000, 250_000_000), conc):
            out.append(
                {
                    "run_id": "r",
                    "model": "smollm2-135m",
                    "requests": 8,
                    "arrival": "poisson",
                    "device_name": "cpu: test",
                    "method": method,
                    "budget": budget,
                    "kv_budget_bytes": kv_budget,
                    "throughput_tokens_s": tokens_s * c / 8,
                    "ttft_p50_s": 1.0 / c,
                    "ttft_p99_s": 4.0 / c,
                    "tpot_p50_s": 0.05,
                    "tpot_p99_s": 0.08,
                    "max_concurrency": c,
                    "predicted_max_concurrency": c + 1,
                    "predicted_tokens_s": 5000.0,
                    "goodput_requests_s": 0.1 * c,
                    "preemptions": 0,
                    "score": 1.0,
                    "slo_ttft_s": 5.0,
                    "slo_tpot_s": 0.25,
                }
            )
    return pd.DataFrame(out)


def test_table_has_measured_beside_predicted():
    table = shown_table(runs())
    first = table.iloc[0].to_dict()
    assert first["method"] == "full" and first["KV budget MB"] == "40.0"
    assert first["concurrency"] == 2 and first["planner concurrency"] == "3"
    assert first["tokens/s"] == "10" and first["planner tokens/s"] == "5,000"
    assert first["ttft p99 s"] == "2" and first["goodput req/s"] == "0.2"


def test_render_draws_the_curves(tmp_path):
    section = render(runs(), tmp_path)
    assert (tmp_path / "serving.png").stat().st_size > 10_000
    assert "| snapkv | 0.25 | 250.0 | 8 | 9 |" in section.markdown


def test_section_shows_the_runs_beside_the_store(tmp_path):
    results = store(tmp_path / "reference" / "store", [row("full", 1.0, "e0", 1.0), row("snapkv", 0.5, "e0", 0.0)])
    out = tmp_path / "report"
    assert report_main([str(results), "--out", str(out)]) == 0
    assert "Serving under a KV memory budget" not in (out / "report.md").read_text()  # no runs: no section

    (tmp_path / "reference" / "serving").mkdir()
    runs().to_parquet(tmp_path / "reference" / "serving" / "serving_runs.parquet")
    assert report_main([str(results), "--out", str(out)]) == 0
    page = (out / "report.md").read_text()
    assert "Serving under a KV memory budget" in page and "| full | 1.00 | 40.0 | 2 | 3 |" in page
    assert (out / "serving.png").is_file()
    assert "Serving under a KV memory budget" in (out / "report.html").read_text()


def test_prefix_table_beside_the_runs(tmp_path):
    prefix = pd.DataFrame(
        [
            {
                "workload": "shared_doc",
                "system": "vllm",
                "option": "full",
                "requests": 6,
                "hit_rate": 0.8,
                "ttft_with_s": 1.0,
                "ttft_without_s": 4.0,
                "identical": True,
                "score": 1.0,
            },
            {
                "workload": "shared_doc",
                "system": "openvino",
                "option": "full",
                "requests": 6,
                "hit_rate": float("nan"),
                "ttft_with_s": 3.0,
                "ttft_without_s": 2.0,
                "identical": False,
                "score": 0.5,
            },
        ]
    )
    section = render(runs(), tmp_path, prefix=prefix)
    assert "| shared_doc | vllm | full | 6 | 0.80 | 0.25 | yes | 1.00 |" in section.markdown
    assert "| shared_doc | openvino | full | 6 | n/a | 1.50 | no | 0.50 |" in section.markdown
