"""kvbench.report.sections.models: per-model rankings and Spearman's rank correlation with a bootstrap interval."""

import math

import numpy as np
import pandas as pd
import pytest

from kvbench.report.section import Context
from kvbench.report.sections.models import model_ranking, rank_transfer, spearman


def _rows(scores: dict[str, dict[str, list[float]]]) -> pd.DataFrame:
    """scores[model][method] = one score per example (examples e0, e1, ...), budget 0.25, plus a full-cache row."""
    out = []
    for model, methods in scores.items():
        for method, values in {"full": [1.0] * len(next(iter(methods.values()))), **methods}.items():
            for i, score in enumerate(values):
                out.append(
                    dict(model=model, task="niah", method=method, budget=1.0 if method == "full" else 0.25,
                         query_aware=True, example_id=f"e{i}", score=score)
                )  # fmt: skip
    return pd.DataFrame(out)


def test_spearman_has_the_textbook_values():
    assert spearman(np.array([1, 2, 3, 4]), np.array([10, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(np.array([1, 2, 3, 4]), np.array([4, 3, 2, 1])) == pytest.approx(-1.0)
    # ranks 1..5 vs 2,1,4,3,5: d² = 1+1+1+1+0 = 4 → 1 − 6·4/(5·24) = 0.8
    assert spearman(np.array([1, 2, 3, 4, 5]), np.array([2, 1, 4, 3, 5])) == pytest.approx(0.8)
    assert math.isnan(spearman(np.array([1, 2, 3]), np.array([5, 5, 5])))


def test_a_ranking_that_transfers_and_one_that_reverses():
    rng = np.random.default_rng(0)
    levels = {"a": 0.9, "b": 0.6, "c": 0.3}
    same = {m: {k: list((rng.random(40) < p).astype(float)) for k, p in levels.items()} for m in ("m1", "m2")}
    ranking, pairs = rank_transfer(_rows(same))
    assert pairs["spearman"].iloc[0] == "1.00" and pairs["examples"].iloc[0] == 40
    assert ranking.set_index("configuration")["m1"].str.endswith("(#1)").tolist() == [True, False, False]
    low, high = map(float, pairs["ci95"].iloc[0].split("–"))
    assert low <= 1.0 <= high + 1e-9 and low > 0  # far-apart levels: every resample keeps the order
    reverse = {"m1": same["m1"], "m2": {k: same["m1"][k2] for k, k2 in zip("abc", "cba")}}
    _, pairs = rank_transfer(_rows(reverse))
    assert pairs["spearman"].iloc[0] == "-1.00"


def test_only_examples_every_model_has_count_and_one_model_shows_nothing():
    rows = _rows({"m1": {"a": [1, 1, 0, 0, 1, 1], "b": [0, 0, 0, 1, 0, 0]}, "m2": {"a": [1, 1, 1, 0, 1], "b": [0] * 5}})
    _, pairs = rank_transfer(rows)
    assert pairs["examples"].iloc[0] == 5  # e5 exists on m1 only
    assert pairs["spearman"].iloc[0].startswith("undefined") is False
    assert rank_transfer(rows[rows.model == "m1"]) is None
    assert model_ranking(rows[rows.model == "m1"], pd.DataFrame(), Context(out_dir=None)) is None
    section = model_ranking(rows, pd.DataFrame(), Context(out_dir=None))
    assert "Spearman" in section.html and "| m1 vs m2 |" in section.markdown


def test_a_configuration_only_one_model_ran_is_left_out_not_the_examples():
    rows = _rows({"m1": {"a": [1, 1, 0, 1, 1], "b": [0, 0, 1, 0, 0], "c": [1] * 5}, "m2": {"a": [1] * 5, "b": [0] * 5}})
    ranking, pairs = rank_transfer(rows)
    assert list(ranking["configuration"]) == ["a 0.25", "b 0.25"] and pairs["examples"].iloc[0] == 5
