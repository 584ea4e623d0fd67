"""Metrics as small pure functions `name(prediction, ground_truth, **kwargs) -> float`."""

from __future__ import annotations

from difflib import SequenceMatcher


def string_match(prediction: str, ground_truth: str, **kwargs) -> float:
    """1.0 when the answer occurs in the prediction (case-insensitive), as RULER's string match."""
    return float(ground_truth.lower() in prediction.lower())


def partial_match(prediction: str, ground_truth: str, **kwargs) -> float:
    """Longest run of the answer's characters found contiguously in the prediction, over the answer's length.

    A 7-digit value returned with only its first 5 digits scores 5/7 (exact match would hide that).
    """
    if not ground_truth:
        return 0.0
    pred, truth = prediction.lower(), ground_truth.lower()
    match = SequenceMatcher(None, pred, truth, autojunk=False).find_longest_match(0, len(pred), 0, len(truth))
    return match.size / len(truth)


def string_match_all(prediction: str, ground_truths: list[str], **kwargs) -> float:
    """RULER: the fraction of the references found in the prediction."""
    return sum(string_match(prediction, t) for t in ground_truths) / len(ground_truths)


def string_match_part(prediction: str, ground_truths: list[str], **kwargs) -> float:
    """RULER (QA): 1.0 when any reference is found in the prediction."""
    return max(string_match(prediction, t) for t in ground_truths)
