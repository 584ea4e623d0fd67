"""Recall after a long generation: a fact stated at the start must survive hundreds of generated tokens.

Each example: the user states a fact ("the access code for the amber-falcon vault is 4829163") and asks for a long
step-by-step calculation; the assistant's answer is a synthetic arithmetic trace of `trace_tokens` tokens (each
step's result is the next step's operand); then the user asks for the access code. The trace is replayed token by
token through the decode loop after the prompt is prefilled and compressed — the generation that decode-time
compression (method `decoding`) acts on — so the example measures what a compressed cache still holds after a
long generation. `query_aware` has no effect here: the trace and the question are generated-side tokens, always
appended after the prompt's compression. Rows carry `trace_tokens`; each row's kv_bytes is the cache after that
many generated tokens, so rows over several lengths are the cache size over time. Scored like NIAH.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

from kvbench import KvbenchError
from kvbench.tasks.base import TASKS, Example, Task
from kvbench.tasks.metrics import partial_match, string_match
from kvbench.tasks.niah import ADJECTIVES, NOUNS
from kvbench.tasks.prompts import chat_text
from kvbench.tasks.prompts import encode as encode_text


@dataclass
class TraceExample(Example):
    """The question (trace + question) is appended after compression whatever `query_aware` says."""

    def split(self, query_aware: bool) -> tuple[list[int], list[int]]:
        return self.context_ids, self.question_ids


def arithmetic_trace(rng: random.Random, tokenizer, n_tokens: int) -> list[int]:
    """Numbered steps `Step k: a + b = c.` chained through their results, cut to exactly n_tokens tokens."""
    ids: list[int] = []
    total, step = rng.randint(10, 99), 1
    while len(ids) < n_tokens:
        operand = rng.randint(2, 49)
        if rng.random() < 0.5 or total < operand:
            line, total = f"Step {step}: {total} + {operand} = {total + operand}.\n", total + operand
        else:
            line, total = f"Step {step}: {total} - {operand} = {total - operand}.\n", total - operand
        ids += tokenizer(line, add_special_tokens=False)["input_ids"]
        step += 1
    return ids[:n_tokens]


@TASKS.register("longgen")
class LongGeneration(Task):
    metric = "string_match"
    selection_keys = frozenset({"trace_tokens", "n_facts"})  # one example per (trace length, fact index)

    MARK = "\x00TRACE\x00"

    def examples(self) -> list[Example]:
        return list(self.iter_examples())

    def iter_examples(self) -> Iterator[Example]:
        cfg = self.cfg
        lengths = [int(n) for n in cfg.trace_tokens]
        if not lengths or min(lengths) < 1 or int(cfg.n_facts) < 1:
            raise KvbenchError("task longgen needs task.trace_tokens (positive token counts) and task.n_facts ≥ 1")
        for length in lengths:
            for i in range(int(cfg.n_facts)):
                yield self._example(length, i)

    def _example(self, length: int, index: int) -> Example:
        rng = random.Random(f"{self.seed}:longgen:{index}")  # the same fact at every trace length
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        value = str(rng.randint(10 ** (int(self.cfg.value_length) - 1), 10 ** int(self.cfg.value_length) - 1))
        messages = [
            {
                "role": "user",
                "content": f"Remember this: the access code for the {key} vault is {value}. Now add "
                f"and subtract step by step, and afterwards I will ask you for the code.",
            },
            {"role": "assistant", "content": self.MARK},
            {"role": "user", "content": f"What is the access code for the {key} vault?"},
        ]
        tokenizer = self.tokenizer
        text = chat_text(tokenizer, messages, "\n".join(m["content"] for m in messages) + "\n")
        head, tail = (text + f"The access code for the {key} vault is").split(self.MARK)
        encode = partial(encode_text, tokenizer)
        trace = arithmetic_trace(random.Random(f"{self.seed}:trace:{index}"), tokenizer, length)
        return TraceExample(
            example_id=f"longgen-T{length}-{index}-s{self.seed}",
            context_ids=encode(head),
            question_ids=trace + encode(tail),
            answers=[value],
            max_new_tokens=int(self.cfg.max_new_tokens),
            subset=f"trace{length}",
            meta={"trace_tokens": length, "scenario": "recall after long generation"},
        )

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        value = example.answers[0]
        return {"score": string_match(prediction, value), "score_partial": partial_match(prediction, value)}
