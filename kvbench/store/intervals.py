"""Confidence intervals that respect the metric: Wilson's score interval when every score is 0 or 1, a
percentile bootstrap of the mean otherwise; both stay inside the metric's range (a mean of scores in [0, 1]
never gets an interval reaching below 0 or above 1, as a Student-t interval on 0/1 scores does). Below
MIN_N examples no interval is given at all: the report shows n and greys the point instead."""

from __future__ import annotations

import math

import numpy as np

MIN_N = 5  # fewer examples: no interval (a 2-example interval says nothing a reader should act on)
BOOTSTRAP_RESAMPLES = 2000
NO_INTERVAL = "n too small for an interval"  # in sentences
NO_INTERVAL_SHORT = f"n<{MIN_N}: no interval"  # in table cells


def normal_quantile(p: float) -> float:
    """Φ⁻¹(p) by bisection on erf (scipy is not a dependency); 0.975 → 1.95996."""
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if 0.5 * (1.0 + math.erf(mid / math.sqrt(2.0))) < p else (lo, mid)
    return 0.5 * (lo + hi)


def wilson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927); always inside [0, 1]."""
    z = normal_quantile((1.0 + confidence) / 2.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap(scores: np.ndarray, confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap of the mean (fixed seed: the same rows give the same report)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(scores), size=(BOOTSTRAP_RESAMPLES, len(scores)))  # (R, n)
    means = scores[picks].mean(axis=1)  # (R,)
    tail = (1.0 - confidence) / 2.0
    return float(np.quantile(means, tail)), float(np.quantile(means, 1.0 - tail))


def mean_interval(
    scores, score_range: tuple[float, float] = (0.0, 1.0), confidence: float = 0.95, min_n: int = MIN_N
) -> tuple[float, float, float, str]:
    """(mean, low, high, method): method is "wilson", "bootstrap", or "" with NaN bounds (n < min_n or no
    scores). The bounds are clipped to `score_range`, the metric's possible values."""
    x = np.asarray(scores, dtype=float)
    x = x[~np.isnan(x)]
    if len(x) == 0:
        return math.nan, math.nan, math.nan, ""
    mean = float(x.mean())
    if len(x) < min_n:
        return mean, math.nan, math.nan, ""
    if np.isin(x, (0.0, 1.0)).all() and score_range == (0.0, 1.0):
        low, high = wilson(int(x.sum()), len(x), confidence)
        how = "wilson"
    else:
        low, high = bootstrap(x, confidence)
        how = "bootstrap"
    low, high = max(low, score_range[0]), min(high, score_range[1])
    return mean, min(low, mean), max(high, mean), how


def interval_text(low: float | None, high: float | None, digits: int = 2, short: bool = True) -> str:
    """`0.35–0.88`, or — where mean_interval gave NaN bounds (fewer than MIN_N examples) — words saying there is
    none (NO_INTERVAL_SHORT in table cells, NO_INTERVAL in sentences), never `nan–nan`."""
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return NO_INTERVAL_SHORT if short else NO_INTERVAL
    return f"{low:.{digits}f}–{high:.{digits}f}"
