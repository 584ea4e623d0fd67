"""The report's bandwidth-bound section: one line per configuration and length with its step's bytes and share, a
plot; absent when no row decoded (rows without the column, or a stream's NaN)."""

import pandas as pd

from kvbench.report.section import Context
from kvbench.report.sections.bandwidth import bandwidth_bound


def rows(share):
    base = dict(model="m", dtype="bfloat16", device_name="cpu: X (2 cores)", method="snapkv", budget=0.5)
    return pd.DataFrame(
        [
            {**base, "length_target": 1024, "decode_ms_per_token": 20.0, "step_bytes": 3e8, "bandwidth_share": share},
            {**base, "length_target": 1024, "decode_ms_per_token": 30.0, "step_bytes": 3e8, "bandwidth_share": share},
            {**base, "length_target": 4096, "decode_ms_per_token": 40.0, "step_bytes": 4e8, "bandwidth_share": 0.5},
        ]
    )


def test_one_line_per_configuration_and_length_with_a_plot(tmp_path):
    section = bandwidth_bound(rows(0.25), pd.DataFrame(), Context(tmp_path))
    assert section is not None and [f.name for f in section.files] == ["bandwidth_share.png"]
    lines = [line for line in section.markdown.splitlines() if line.startswith("| m ")]
    assert len(lines) == 2  # 1K and 4K apart
    assert "| 1024 | snapkv | 0.500 | 1 | 25.000 | 300.000 | 0.250 | 2 |" in lines[0]
    assert "| 4096 |" in lines[1] and "| 0.500 | 1 |" in lines[1]


def test_no_decoding_rows_no_section(tmp_path):
    assert bandwidth_bound(rows(float("nan")).iloc[:2], pd.DataFrame(), Context(tmp_path)) is None
