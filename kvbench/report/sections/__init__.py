"""The report's sections, registered explicitly: a new section is a module here and its name in this import.

Each module registers its functions with `kvbench.report.section.report_section`; the order here is the order
on the page.
"""

from kvbench.report.sections import (
    bandwidth,
    batched,
    diagnose,
    engines,
    fidelity,
    guide,
    kvpress,
    leaderboard,
    models,
    predicted,
    prefill,
    prefix,
    serving,
)

__all__ = [
    "bandwidth",
    "batched",
    "diagnose",
    "engines",
    "fidelity",
    "guide",
    "kvpress",
    "leaderboard",
    "models",
    "predicted",
    "prefill",
    "prefix",
    "serving",
]
