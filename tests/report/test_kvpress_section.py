"""The report's "kvpress: claimed vs held" section (kvbench/report/sections/kvpress.py), torch-free: a press's claim
beside its held bytes, its resolved defaults in its name, and kvbench's counterpart method's score beside it."""

import json

import pandas as pd

from kvbench.report.section import Context
from kvbench.report.sections.kvpress import claimed_vs_held, native_scores
from tests.report.test_report import row


def press_row(press: dict, resolved: str, budget: float, score: float, kv_ratio: float, i: int) -> dict:
    params = json.dumps({"press": press, "resolved": resolved})
    return row("kvpress", budget, f"e{i}", score, kv_ratio=kv_ratio, method_params=params,
               kv_ratio_nominal=budget, peak_mem_delta_bytes=2**21)  # fmt: skip


def test_claimed_vs_held_names_presses_that_hold_the_full_cache_and_shows_kvbenchs_own(tmp_path):
    snap = "SnapKVPress(window_size=64, kernel_size=5)"
    ada = "AdaKVPress(press=SnapKVPress(window_size=64, kernel_size=5), alpha_safeguard=0.2)"
    rows = [press_row({"name": "SnapKVPress"}, snap, 0.25, 0.0, 0.25, i) for i in range(2)]
    rows += [press_row({"name": "AdaKVPress", "press": "SnapKVPress"}, ada, 0.25, 1.0, 1.0, i) for i in range(2)]
    rows += [row("snapkv", 0.25, f"e{i}", 1.0) for i in range(2)]
    rows += [row("snapkv(window_size=64)", 0.25, f"e{i}", 0.5) for i in range(2)]
    rows += [row("snapkv", 0.5, f"e{i}", 0.1) for i in range(2)]  # another budget: not beside the 0.25 presses
    frame = pd.DataFrame(rows)
    assert native_scores(frame, snap, 0.25) == "snapkv 1 · snapkv(window_size=64) 0.5"
    assert native_scores(frame, "KVzipPress(layerwise=False)", 0.25) == ""  # no kvzip rows here
    section = claimed_vs_held(frame, pd.DataFrame(), Context(out_dir=tmp_path))
    assert section is not None
    lines = section.markdown.splitlines()
    snap_line = next(line for line in lines if line.startswith(f"| {snap}"))
    ada_line = next(line for line in lines if line.startswith(f"| {ada}"))
    assert "held as claimed" in snap_line and "snapkv 1 · snapkv(window_size=64) 0.5" in snap_line
    assert "held in full ¹" in ada_line and "adakv" not in ada_line.split("|")[-2]
    assert "does not reduce peak memory" in section.markdown  # kvpress's own reason, quoted


def test_no_press_rows_no_section(tmp_path):
    frame = pd.DataFrame([row("snapkv", 0.25, "e0", 1.0, kv_ratio_nominal=None)])
    assert claimed_vs_held(frame, pd.DataFrame(), Context(out_dir=tmp_path)) is None
