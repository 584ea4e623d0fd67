"""A verdict per diagnosed row: why the compressed cache lost quality (or that it did not).

The rule, first match wins (thresholds: the `verdict` block of conf/config.yaml):

1. `model fails anyway` — the full cache's own answer scores below `full_fails_below`: no compression to blame.
2. `no loss` — the score is within `score_tolerance` of the full cache's and `kl_mean` ≤ `kl_tolerance`;
   `answer intact` — the score is within `score_tolerance` but `kl_mean` is above `kl_tolerance`: the next-token
   distribution moved (evidence partly evicted, or precision lost) and the answer still scores as the full cache's.
   A fully correct answer is never called a loss, whatever was evicted.
3. `precision loss` — nothing was evicted (`evicted_share` ≤ `evicted_tolerance`): the divergence comes from
   quantization or head merging.
4. `wrong positions` — tokens were evicted but the full cache's attention mass mostly survived (`mass_recall` ≥
   `recall_high`), or the task's evidence was evicted (`evidence_retention` < `evidence_retention_min`) or lost
   its attention mass (compressed / full evidence mass < `evidence_mass_min`) while `mass_recall` ≥ `recall_low`:
   the budget was spent on the wrong tokens.
5. `budget too small` — otherwise: attention mass was lost broadly (low recall across layers, entropy up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from kvbench import KvbenchError
from kvbench.config.rules import Rule, _show, check_value, did_you_mean, plain

VERDICTS = ("model fails anyway", "wrong positions", "budget too small", "precision loss", "answer intact", "no loss")
NOT_LOST = ("no loss", "answer intact", "model fails anyway")  # the verdicts of rows that lost no quality
SHARES = ("evicted_tolerance", "recall_high", "recall_low", "evidence_retention_min")  # thresholds on shares in [0, 1]


@dataclass(frozen=True)
class Thresholds:
    full_fails_below: float = 0.5  # the full cache's score below this: its answer is wrong
    score_tolerance: float = 0.0  # a drop vs the full cache up to this is no loss
    kl_tolerance: float = 0.05  # mean KL(full ‖ compressed) per step (nats) up to this is no loss
    evicted_tolerance: float = 0.0  # share of positions evicted up to this counts as nothing evicted
    recall_high: float = 0.9  # attention-mass recall at or above this: the budget kept what attention needs
    recall_low: float = 0.5  # below this, lost evidence is put down to the budget, not to the positions
    evidence_retention_min: float = 1.0  # share of evidence tokens kept (mean over layers × heads)
    evidence_mass_min: float = 0.5  # compressed / full attention mass on the evidence

    @classmethod
    def from_config(cls, block) -> Thresholds:
        """The `verdict:` block, every key checked (kvbench.preflight.entrance runs this before the model loads)."""
        given = plain(block) or {}
        if not isinstance(given, dict):
            raise KvbenchError(f"verdict={_show(given)} is not a mapping; use e.g. verdict.recall_high=0.9")
        names = [f.name for f in fields(cls)]
        for key in given:
            if key not in names:
                hint = did_you_mean(key, names, prefix="verdict.")
                raise KvbenchError(f"verdict.{key} is not a threshold; {hint}valid: {', '.join(names)}")
        defaults = cls()
        for key, value in given.items():
            shown = getattr(defaults, key)
            rule = Rule("float", f"verdict.{key}={shown:g} (a number ≥ 0; kvbench/guide/verdict.py)", min=0)
            if key in SHARES:
                rule = Rule(
                    "float", f"verdict.{key}={shown:g} (a share in [0, 1]; kvbench/guide/verdict.py)", min=0, max=1
                )
            check_value(f"verdict.{key}", value, rule)
        thresholds = cls(**{k: float(v) for k, v in given.items()})
        if thresholds.recall_low > thresholds.recall_high:
            raise KvbenchError(
                f"verdict.recall_low={thresholds.recall_low:g} is above verdict.recall_high={thresholds.recall_high:g}"
                "; recall_low must be ≤ recall_high (below recall_low lost evidence is put down to the budget)"
            )
        return thresholds


def _nan(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def verdict(row: dict, full_score: float, t: Thresholds = Thresholds()) -> str:
    """The verdict for one diagnosed row (its `score`, `kl_mean`, `mass_recall`, `evicted_share`, evidence
    columns) given the full cache's score on the same example."""
    if full_score < t.full_fails_below:
        return "model fails anyway"
    if row["score"] >= full_score - t.score_tolerance:  # the answer scores as the full cache's: nothing lost
        return "no loss" if row["kl_mean"] <= t.kl_tolerance else "answer intact"
    if not _nan(row.get("evicted_share")) and row["evicted_share"] <= t.evicted_tolerance:
        return "precision loss"
    recall = row.get("mass_recall", math.nan)  # a missing column reads as NaN, like a None
    if _nan(recall):
        return "budget too small"  # eviction without recorded positions: only the loss is known
    if recall >= t.recall_high:
        return "wrong positions"
    retention, mass_full = row.get("evidence_retention", math.nan), row.get("evidence_mass_full", math.nan)
    evidence_lost = not _nan(retention) and retention < t.evidence_retention_min
    if not _nan(mass_full) and mass_full > 0:
        evidence_lost |= row["evidence_mass_compressed"] / mass_full < t.evidence_mass_min
    if evidence_lost and recall >= t.recall_low:
        return "wrong positions"
    return "budget too small"
