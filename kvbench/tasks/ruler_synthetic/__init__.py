"""`task=ruler_synthetic`: kvbench's own offline re-implementation of RULER's synthetic tasks (needs no data
package; `task=ruler` is the official RULER, kvbench/tasks/ruler/): NIAH variants, variable tracking, common and
frequent words extraction, with RULER's templates, answer prefixes, generation lengths and all-of string match.

Each (subtask, length, sample) draws from its own seeded stream, so an example does not change when the subtask
list or the number of samples does; its prompt (chat template included) is `length` tokens or at most 2 % fewer.
Its haystacks and word lists are substitutes and it has no QA subtasks, so its scores do not compare with RULER's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial

from kvbench import KvbenchError
from kvbench.config.rules import Rule
from kvbench.tasks.base import TASKS, Example, Task
from kvbench.tasks.facts import TaskFacts
from kvbench.tasks.metrics import string_match_all
from kvbench.tasks.prompts import encode
from kvbench.tasks.ruler_synthetic.aggregation import cwe_draft, fwe_draft
from kvbench.tasks.ruler_synthetic.draft import Draft, fit
from kvbench.tasks.ruler_synthetic.niah import VARIANTS, niah_draft
from kvbench.tasks.ruler_synthetic.vt import vt_draft


@dataclass(frozen=True)
class Subtask:
    draft: Callable[..., Draft]  # (rng, length, knobs, encode) -> Draft
    scenario: str
    max_new_tokens: int  # RULER's tokens_to_generate
    knobs: dict | None = None  # the config section task.<name> and its defaults (RULER's scripts/synthetic.yaml)


SUBTASKS = {
    **{name: Subtask(partial(niah_draft, variant), "synthetic retrieval", 128) for name, variant in VARIANTS.items()},
    "vt": Subtask(vt_draft, "multi-hop tracing", 30, {"num_chains": 1, "num_hops": 4}),
    "cwe": Subtask(cwe_draft, "aggregation", 120, {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    "fwe": Subtask(fwe_draft, "aggregation", 50, {"alpha": 2.0}),
}


@TASKS.register("ruler_synthetic")
class Ruler(Task):
    metric = "string_match_all"
    facts = TaskFacts(plots=("heatmap",))  # rows carry length_target and depth
    selection_keys = frozenset({"tasks", "context_lengths", "num_samples"})
    knobs = {
        "tasks": Rule(
            "list",
            "task.tasks=[niah_single_1,vt] or task.tasks=null (all)",
            nullable=True,
            non_empty=True,
            item=Rule("str", choices=tuple(SUBTASKS)),
        ),
        "context_lengths": Rule(
            "list",
            "task.context_lengths=[2048,4096] (prompt tokens)",
            non_empty=True,
            item=Rule("int", "token counts ≥ 1", min=1),
        ),
        "num_samples": Rule("int", "task.num_samples=2 (examples per subtask and length)", min=1),
        "max_new_tokens": Rule("int", "task.max_new_tokens=64 or null (RULER's lengths)", nullable=True, min=1),
        **{
            name: Rule("dict", f"task.{name}.<knob>=... (conf/task/ruler_synthetic.yaml)", nullable=True)
            for name, sub in SUBTASKS.items()
            if sub.knobs
        },
    }

    @classmethod
    def check(cls, cfg: dict) -> None:
        for name, subtask in SUBTASKS.items():
            if subtask.knobs is not None:
                cls._merged_knobs(cfg, name, subtask.knobs)

    def examples(self) -> list[Example]:
        return list(self.iter_examples())

    def iter_examples(self) -> Iterator[Example]:
        names, lengths = self._subtasks(), self._lengths()
        samples = int(self.cfg.get("num_samples", 2))
        if samples < 1:
            raise KvbenchError(f"task.num_samples={samples}: use at least 1")
        for name in names:
            for length in lengths:
                for index in range(samples):
                    yield self._example(name, length, index)

    def _subtasks(self) -> list[str]:
        names = list(self.cfg.get("tasks") or SUBTASKS)
        unknown = [n for n in names if n not in SUBTASKS]
        if unknown:
            raise KvbenchError(
                f"task.tasks: unknown RULER subtask {', '.join(map(repr, unknown))}; valid subtasks: "
                f"{', '.join(SUBTASKS)} (the QA subtasks need downloads and are not offered)"
            )
        return names

    @classmethod
    def longest_request(cls, cfg: dict):
        """RULER's lengths already count the generated tokens."""
        want = super().longest_request(cfg)
        return want and replace(want, new=0)

    def _lengths(self) -> list[int]:
        lengths = list(self.cfg.get("context_lengths") or [])
        if not lengths or any(int(n) < 1 for n in lengths):
            raise KvbenchError(f"task.context_lengths={lengths}: give prompt lengths in tokens, e.g. [2048, 4096]")
        return [int(n) for n in lengths]

    def _knobs(self, name: str, defaults: dict) -> dict:
        return self._merged_knobs(self.cfg, name, defaults)

    @staticmethod
    def _merged_knobs(cfg, name: str, defaults: dict) -> dict:
        given = dict(cfg.get(name) or {})
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise KvbenchError(
                f"task.{name} has no parameter {', '.join(map(repr, unknown))}; valid parameters: {', '.join(defaults)}"
            )
        for knob, value in given.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise KvbenchError(
                    f"task.{name}.{knob}={value} is not a positive number; use "
                    f"task.{name}.{knob}={defaults[knob]} (RULER's default)"
                )
        return {**defaults, **given}

    def _max_new_tokens(self, subtask: Subtask) -> int:
        cap = self.cfg.get("max_new_tokens")
        if cap is None:
            return subtask.max_new_tokens
        if int(cap) < 1:
            raise KvbenchError(f"task.max_new_tokens={cap}: use a positive cap, or null for RULER's lengths")
        return min(subtask.max_new_tokens, int(cap))

    def _example(self, name: str, length: int, index: int) -> Example:
        subtask = SUBTASKS[name]
        rng = random.Random(f"ruler:{self.seed}:{name}:{length}:{index}")
        knobs = self._knobs(name, subtask.knobs) if subtask.knobs is not None else {}
        draft = subtask.draft(rng, length, knobs, self._encode)
        context_ids, question_ids, layout = fit(draft, self.tokenizer, length, name)
        meta = {"length_target": length, "scenario": subtask.scenario}
        if layout.depth is not None:
            meta["depth"] = layout.depth
        return Example(
            example_id=f"ruler_synthetic-{name}-L{length}-i{index}-s{self.seed}",
            context_ids=context_ids,
            question_ids=question_ids,
            answers=draft.answers,
            max_new_tokens=self._max_new_tokens(subtask),
            subset=name,
            meta=meta,
            evidence=tuple(draft.answers) if name.startswith("niah") else (),  # the queried needles' values
        )

    def data_files(self):
        from kvbench.tasks.haystack import sentence_files

        return sentence_files("prose")  # the essay haystack of the niah variants (Python's bundled docs)

    def _encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        return {"score": string_match_all(prediction, example.answers)}
