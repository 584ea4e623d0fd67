"""The report's "Predicted vs measured" section reads `python -m kvbench.bench throughput`'s CSV from beside the store."""

import pandas as pd

from kvbench.report.build import main as report_main
from tests.report.test_report import row, store

FIXTURE = pd.DataFrame(
    [
        # model, hardware, config, context, limit_bytes, quantity, predicted, measured, unit
        ["m", "cpu", "full", 4096, 4 * 2**30, "kv_bytes per request", 94_371_840, 94_371_840, "B"],
        ["m", "cpu", "full", 4096, 4 * 2**30, "largest batch within the limit", 42, 30, "requests"],
        ["m", "cpu", "full", 4096, 4 * 2**30, "decode ms per step at that batch", 50.0, 2050.0, "ms"],
        ["m", "cpu", "snapkv:0.25", 4096, 4 * 2**30, "largest batch within the limit", 170, 120, "requests"],
    ],
    columns=["model", "hardware", "config", "context", "limit_bytes", "quantity", "predicted", "measured", "unit"],
)


def test_section_shows_the_csv_beside_the_store(tmp_path):
    results = store(tmp_path / "reference" / "store", [row("full", 1.0, "e0", 1.0), row("snapkv", 0.5, "e0", 0.0)])
    out = tmp_path / "report"
    assert report_main([str(results), "--out", str(out)]) == 0
    assert "Predicted vs measured" not in (out / "report.md").read_text()  # no CSV: no section

    (tmp_path / "reference" / "throughput").mkdir()
    FIXTURE.to_csv(tmp_path / "reference" / "throughput" / "predicted_vs_measured.csv", index=False)
    assert report_main([str(results), "--out", str(out)]) == 0
    page = (out / "report.md").read_text()
    assert "Predicted vs measured" in page and "context 4096, memory limit 4.00 GiB" in page
    assert "| full | kv_bytes per request | 94.37 | 94.37 | 1 | MB |" in page  # bytes shown as MB, exact
    assert "| snapkv:0.25 | largest batch within the limit | 170 | 120 | 0.706 | requests |" in page
    assert "2000 ms of per-step overhead (41× the bound)" in page  # measured − bound, stated
    assert "Predicted vs measured" in (out / "report.html").read_text()
