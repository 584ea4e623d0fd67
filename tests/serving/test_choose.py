"""The guide's "meets the SLO at this memory" (kvbench.guide.serving) on hand-made serving rows."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kvbench import KvbenchError
from kvbench.guide.serving import choose, main


def rows():
    """full queues at 40 MB (slow TTFT), meets at 250 MB; snapkv meets at 40 MB with a small score drop; a vLLM
    option meets at 40 MB with the full score."""
    req, run = [], []
    cases = [
        ("kvbench", "full", 1.0, 40_000_000, [1.0, 9.0, 9.0, 9.0], 1.0),
        ("kvbench", "full", 1.0, 250_000_000, [1.0, 1.0, 1.0, 2.0], 1.0),
        ("kvbench", "snapkv", 0.25, 40_000_000, [1.0, 1.0, 2.0, 3.0], 0.98),
        ("vllm", "vllm:full", 1.0, 40_000_000, [0.5, 0.5, 0.5, 8.0], 1.0),
    ]
    for engine, method, budget, kv, ttfts, score in cases:
        keys = {"engine": engine, "method": method, "budget": budget, "kv_budget_bytes": kv}
        req += [{**keys, "ttft_s": t, "tpot_s": 0.1} for t in ttfts]
        run.append(
            {
                **keys,
                "duration_s": 10.0,
                "throughput_tokens_s": 5.0,
                "ttft_p99_s": max(ttfts),
                "tpot_p99_s": 0.1,
                "max_concurrency": 2,
                "score": score,
                "slo_ttft_s": 5.0,
                "slo_tpot_s": 0.25,
            }
        )
    return pd.DataFrame(req), pd.DataFrame(run)


def test_at_40_mb_the_compressed_cache_meets_and_the_full_one_does_not():
    table = choose(*rows(), kv_memory=40_000_000, attainment=0.9, max_drop=0.05).set_index("method")
    assert table.loc["snapkv", "fit"] == "meets" and table.loc["snapkv", "slo_attainment"] == 1.0
    assert math.isclose(table.loc["snapkv", "drop"], 0.02)
    assert table.loc["full", "fit"] == "SLO met by 25% < 90%"
    assert table.loc["full", "goodput_req_s"] == 0.1
    assert table.loc["vllm:full", "slo_attainment"] == 0.75
    assert table.index[0] == "snapkv"  # the ones that meet come first


def test_more_memory_picks_each_configurations_largest_run_within_it():
    table = choose(*rows(), kv_memory=300_000_000).set_index("method")
    assert table.loc["full", "kv_budget_MB"] == 250.0 and table.loc["full", "fit"] == "meets"
    # snapkv at 250 MB was not measured: its 40 MB run stands, its drop against full at 40 MB
    assert table.loc["snapkv", "kv_budget_MB"] == 40.0


def test_a_looser_slo_recomputed_from_the_request_rows():
    table = choose(*rows(), kv_memory=40_000_000, slo_ttft=10.0, slo_tpot=0.25).set_index("method")
    assert table.loc["full", "fit"] == "meets" and table.loc["vllm:full", "slo_attainment"] == 1.0


def test_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(KvbenchError, match="the smallest measured KV budget is 40,000,000"):
        choose(*rows(), kv_memory=1_000)
    with pytest.raises(KvbenchError, match="the SLOs are in the wrong order"):
        choose(*rows(), kv_memory=40_000_000, slo_ttft=0.1, slo_tpot=0.2)
    assert main([str(tmp_path), "--kv-memory", "4e7"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    requests, runs = rows()
    requests.to_parquet(tmp_path / "serving_requests.parquet")
    runs.to_parquet(tmp_path / "serving_runs.parquet")
    assert main([str(tmp_path), "--kv-memory", "4e7"]) == 0
    assert "snapkv" in capsys.readouterr().out


def test_a_missing_folder_is_named_as_given(tmp_path):
    from kvbench.guide.serving import load

    with pytest.raises(KvbenchError) as missing:
        load(tmp_path / "nope")
    assert str(missing.value) == (
        f"{tmp_path / 'nope'} does not exist; give the output directory of python -m kvbench.serving"
    )
