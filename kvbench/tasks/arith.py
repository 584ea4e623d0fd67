"""Multi-step arithmetic the model works out itself: a reasoning-style trace whose length is the model's own.

Each example: a start number and `n_steps` additions and subtractions; the model is asked to write one line per step
(`Step k: a + b = c.`, a worked three-step example shows the form) and then `Answer: <number>`. Unlike `longgen`,
whose trace is replayed, here every trace token is generated, so what a decode-time eviction (R-KV, `decoding`,
H2O, TOVA) drops can change the trace itself: a lost operand is recomputed, a step repeated, the answer postponed.
The rows' `length_vs_full` (kvbench.native.fidelity) is then how much longer the compressed run wrote than the full
cache on the same problem (eviction can lengthen reasoning traces, arXiv 2512.12008). Scores: `score` 1 when the
first `Answer:` gives the final value; `score_partial` the share of the step results written after an `=` in the
trace (in any order).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from kvbench import KvbenchError
from kvbench.tasks.base import TASKS, Example, Task
from kvbench.tasks.prompts import chat_text, encode

WORKED = (
    "Start with 20. Then: add 5; subtract 7; add 11.\n"
    "Step 1: 20 + 5 = 25.\nStep 2: 25 - 7 = 18.\nStep 3: 18 + 11 = 29.\nAnswer: 29"
)
ANSWER = re.compile(r"Answer:\s*(-?\d+)")
RESULT = re.compile(r"=\s*(-?\d+)")


def problem(rng: random.Random, n_steps: int) -> tuple[int, list[int], list[int]]:
    """(start, signed operands, the running results after each step); results stay positive."""
    total = start = rng.randint(10, 99)
    operands, results = [], []
    for _ in range(n_steps):
        operand = rng.randint(2, 49)
        operand = -operand if rng.random() >= 0.5 and total > operand else operand
        total += operand
        operands.append(operand)
        results.append(total)
    return start, operands, results


@TASKS.register("arith")
class Arithmetic(Task):
    metric = "answer_match"
    selection_keys = frozenset({"n_steps", "n_problems"})  # one example per (step count, problem index)

    def examples(self) -> list[Example]:
        return list(self.iter_examples())

    def iter_examples(self) -> Iterator[Example]:
        steps = [int(n) for n in self.cfg.n_steps]
        if not steps or min(steps) < 1 or int(self.cfg.n_problems) < 1:
            raise KvbenchError("task arith needs task.n_steps (positive step counts) and task.n_problems ≥ 1")
        for n in steps:
            for i in range(int(self.cfg.n_problems)):
                yield self._example(n, i)

    def _example(self, n_steps: int, index: int) -> Example:
        start, operands, results = problem(random.Random(f"{self.seed}:arith:{n_steps}:{index}"), n_steps)
        ops = "; ".join(f"add {o}" if o > 0 else f"subtract {-o}" for o in operands)
        task_text = f"Start with {start}. Then: {ops}."
        instruction = (
            "Work it out step by step, one line per step as in the example, then give the final number as "
            "'Answer: <number>'."
        )
        content = f"Example:\n{WORKED}\n\nNow this one:\n{task_text}\n{instruction}"
        text = chat_text(self.tokenizer, [{"role": "user", "content": content}], content + "\n") + "Step 1:"
        head, _, tail = text.partition(instruction)  # the problem is the context; the instruction, the question
        return Example(
            example_id=f"arith-S{n_steps}-{index}-s{self.seed}",
            context_ids=encode(self.tokenizer, head),
            question_ids=encode(self.tokenizer, instruction + tail),
            answers=[str(results[-1]), *(str(r) for r in results)],
            max_new_tokens=int(self.cfg.max_new_tokens),
            subset=f"steps{n_steps}",
            meta={"n_steps": n_steps, "scenario": "reasoning trace"},
        )

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        found = ANSWER.search(prediction)
        final = float(found is not None and found.group(1) == example.answers[0])
        written = set(RESULT.findall(prediction))
        return {
            "score": final,
            "score_partial": sum(r in written for r in example.answers[1:]) / (len(example.answers) - 1),
        }
