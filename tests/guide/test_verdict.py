"""The verdict rule on constructed rows: each verdict, and the thresholds' validation."""

from __future__ import annotations

import pytest

from kvbench import KvbenchError
from kvbench.guide.verdict import NOT_LOST, VERDICTS, Thresholds, verdict

NAN = float("nan")


def row(**kw):
    base = {
        "score": 0.0,
        "kl_mean": 1.0,
        "mass_recall": 0.5,
        "evicted_share": 0.8,
        "evidence_retention": NAN,
        "evidence_mass_full": NAN,
        "evidence_mass_compressed": NAN,
    }
    return {**base, **kw}


@pytest.mark.parametrize(
    "case, full_score, expected",
    [
        (row(score=1.0), 0.0, "model fails anyway"),  # the full cache is wrong: not compression's fault
        (row(score=1.0, kl_mean=0.01), 1.0, "no loss"),
        (row(score=1.0, kl_mean=0.4, evicted_share=0.0, mass_recall=1.0), 1.0, "answer intact"),  # KL alone: no loss
        (row(evicted_share=0.0, mass_recall=1.0), 1.0, "precision loss"),  # quantization got the answer wrong
        (row(mass_recall=0.95), 1.0, "wrong positions"),  # most attention mass kept, still wrong
        (
            row(mass_recall=0.7, evidence_retention=0.4, evidence_mass_full=0.2, evidence_mass_compressed=0.05),
            1.0,
            "wrong positions",
        ),  # the needle was evicted while recall stayed moderate
        (
            row(mass_recall=0.7, evidence_retention=1.0, evidence_mass_full=0.2, evidence_mass_compressed=0.02),
            1.0,
            "wrong positions",
        ),  # kept but its attention mass collapsed
        (
            row(mass_recall=0.3, evidence_retention=0.0, evidence_mass_full=0.2, evidence_mass_compressed=0.0),
            1.0,
            "budget too small",
        ),  # recall low across layers: the budget, not the choice
        (
            row(mass_recall=0.7, evidence_retention=1.0, evidence_mass_full=0.2, evidence_mass_compressed=0.19),
            1.0,
            "budget too small",
        ),  # evidence intact, attention lost elsewhere
        (row(mass_recall=0.7), 1.0, "budget too small"),  # no evidence known (LongBench): recall decides
    ],
)
def test_each_verdict(case, full_score, expected):
    assert verdict(case, full_score) == expected
    assert expected in VERDICTS


# SnapKV 0.25 on a 1K NIAH prompt, needle at 10 % depth: the answer is exactly right (1.0) while part of the
# needle's tokens were evicted and the distribution moved; the other rows: every rule's region with a correct answer
CORRECT = [
    row(
        score=1.0,
        kl_mean=0.3,
        mass_recall=0.95,
        evicted_share=0.75,
        evidence_retention=0.6,
        evidence_mass_full=0.2,
        evidence_mass_compressed=0.05,
    ),
    row(score=1.0, kl_mean=2.0, mass_recall=0.2, evicted_share=0.9),
    row(score=1.0, kl_mean=0.4, evicted_share=0.0, mass_recall=NAN),
    row(score=1.0, kl_mean=NAN, mass_recall=NAN, evicted_share=NAN),
]


@pytest.mark.parametrize("case", CORRECT, ids=range(len(CORRECT)))
def test_a_fully_correct_answer_is_never_a_loss(case):
    """Whatever was evicted and however far the distribution moved, an answer scoring as the full cache's is not
    called a loss (the verdict must not contradict its own row)."""
    assert verdict(case, 1.0) in NOT_LOST
    assert verdict(case, 1.0) == ("no loss" if case["kl_mean"] <= 0.05 else "answer intact")
    assert verdict({**case, "score": 0.0}, 1.0) not in NOT_LOST  # the same row answering wrong is a loss


def test_thresholds_come_from_config():
    strict = Thresholds.from_config({"recall_high": 0.6})
    assert verdict(row(mass_recall=0.7), 1.0, strict) == "wrong positions"
    lenient = Thresholds.from_config({"kl_tolerance": 2, "score_tolerance": 1})
    assert verdict(row(), 1.0, lenient) == "no loss"


@pytest.mark.parametrize(
    "block, message",
    [
        ({"recal_high": 0.5}, "not a threshold"),
        ({"kl_tolerance": "x"}, "is not a number"),
        ({"recall_low": -1}, "≥ 0"),
        ({"recall_hgh": 0.5}, "did you mean verdict.recall_high"),
        ({"recall_low": 0.9, "recall_high": 0.5}, "recall_low must be ≤ recall_high"),
        ({"recall_high": 1.5}, "a share in \\[0, 1\\]"),
        ({"kl_tolerance": float("inf")}, "finite"),
        ({"kl_tolerance": 10**400}, "too large"),
        ({"kl_tolerance": True}, "is not a number"),
        ([0.5], "is not a mapping"),
    ],
)
def test_bad_thresholds(block, message):
    with pytest.raises(KvbenchError, match=message):
        Thresholds.from_config(block)


def test_config_defaults_are_the_dataclass_defaults():
    from omegaconf import OmegaConf

    from tests.conftest import CONF_DIR

    assert Thresholds.from_config(OmegaConf.load(CONF_DIR / "config.yaml").verdict) == Thresholds()
