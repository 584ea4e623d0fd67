"""What readers of result rows (report, plots, CI gate) need to know about a task, declared by the task itself.

Each task class states its facts next to its metric, as a class attribute:

    @TASKS.register("ppl")
    class Perplexity(Task):
        metric = "perplexity"
        facts = TaskFacts(lower_is_better=True, score_range=(1.0, math.inf), plots=("stream",))

Readers call `task_facts(row["task"])`. It imports kvbench.tasks (importing a task module registers it), so
task modules import torch or transformers only inside the functions that need them: `python -m kvbench.report`
stays torch-free (tests/report/test_report.py checks it). Rows of a task that is not registered (an older store, a
plugin that is not installed) get the defaults: higher is better, scores in [0, 1], no task-specific plots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PLOTS = ("heatmap", "stream")


@dataclass(frozen=True)
class TaskFacts:
    lower_is_better: bool = False  # perplexity: a smaller score is better (signs flip; never pooled with others)
    score_range: tuple[float, float] = (0.0, 1.0)  # intervals never leave it; (1.0, math.inf) for perplexity
    # extra plots the rows support: "heatmap" = rows carry `length_target` and `depth` (a length × depth heatmap
    # per method); "stream" = rows carry `perplexity_so_far` (the curve over tokens streamed)
    plots: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = set(self.plots) - set(PLOTS)
        if unknown:
            raise ValueError(f"TaskFacts.plots: unknown {sorted(unknown)}; known: {', '.join(PLOTS)}")
        low, high = self.score_range
        if not low < high or math.isnan(low) or math.isnan(high):
            raise ValueError(f"TaskFacts.score_range must be (low, high) with low < high, got {self.score_range}")


DEFAULT = TaskFacts()


def task_facts(name: str) -> TaskFacts:
    from kvbench.tasks import TASKS

    if name not in TASKS.names():
        return DEFAULT
    return getattr(TASKS.get(name), "facts", DEFAULT)
