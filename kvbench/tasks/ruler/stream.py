"""The state one run of a RULER generator script holds: its seeded `random` and numpy streams, its seed (the scripts
also shuffle with fresh `random.Random(seed)` objects), the token counter, and the sample it returns.

A script seeds the global streams once and draws every sample of a length from them in order, the haystack-size
search included, so sample i depends on everything drawn before it; kvbench replays the same draws in the same
order from private streams (`random.Random(seed)` draws what `random.seed(seed)` does, `RandomState(seed)` what
`np.random.seed(seed)` does).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvbench import KvbenchError


@dataclass
class Stream:
    seed: int
    count: Callable[[str], int]  # tokens of a text as RULER counts them (tokenizer.tokenize: no special tokens)
    rng: random.Random = field(init=False)
    np_rng: np.random.RandomState = field(init=False)

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.np_rng = np.random.RandomState(self.seed)

    def shuffled(self, items: list) -> list:
        """`random.Random(seed).shuffle(items)`, in place, as the scripts do."""
        random.Random(self.seed).shuffle(items)
        return items


@dataclass
class Sample:
    text: str  # RULER's input with its "base" template: task template + answer prefix, filled
    answers: list[str]  # RULER's `outputs`
    question: str  # the end of `text` after the context: the question and the answer prefix
    answer_prefix: str  # the end of `text` that is the answer prefix (after the generation prompt for chat models)
    depth: float | None = None  # where the one queried needle sits (0 = start, 1 = end), when there is one


class TooLong(Exception):
    """A sample over the length: the scripts catch it (a bare except) and retry with a smaller haystack."""


def retry(
    make: Callable[[int], Sample], size: int, step: int, limit: int, ttg: int, stream: Stream, what: str, shrink=True
) -> Sample:
    """A script's per-sample loop: draw at `size`, and while the prompt + `ttg` is over `limit` tokens, draw again at
    `size - step` (never below one step; variable_tracking.py redraws at the same size: `shrink=False`). The scripts
    loop for ever where nothing fits; kvbench stops after 100 draws that cannot shrink and says so."""
    stuck = 0
    while True:
        try:
            sample = make(size)
            if stream.count(sample.text) + ttg > limit:
                raise TooLong
            return sample
        except (TooLong, ValueError):  # ValueError: random.sample of more than the haystack holds, as the script's
            if shrink and size > step:
                size -= step
            else:
                stuck += 1
                if stuck > 100:
                    raise KvbenchError(
                        f"task.context_lengths: RULER's {what} does not fit in {limit} tokens with this tokenizer; "
                        f"use longer lengths or leave the task out of task.tasks"
                    ) from None
