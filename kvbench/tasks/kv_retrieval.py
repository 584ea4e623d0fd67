"""Key-value retrieval (Liu et al. 2023, "Lost in the Middle", https://arxiv.org/abs/2307.03172;
nelson-liu/lost-in-the-middle): a JSON object of `num_pairs` random UUID → UUID pairs, and the question for one
key's value, the gold pair placed at a relative `position` (0 = first, 1 = last). Every token of the answer must
survive compression: a 36-character UUID is many tokens, so it is a hard test of what eviction keeps.

Prompt: the paper's kv_retrieval template (instruction, "JSON data:", the object, `Key: "<key>"`, "Corresponding
value:"). Scored by exact containment of the value (`score`) and the longest matching run (`score_partial`).
This task is also CONTRIBUTING.md's example: a task is this file and conf/task/kv_retrieval.yaml, nothing else.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

from kvbench.config.rules import Rule
from kvbench.tasks.base import TASKS, Example, Task
from kvbench.tasks.facts import TaskFacts
from kvbench.tasks.metrics import partial_match, string_match
from kvbench.tasks.prompts import PromptBuilder, encode

INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below."


def random_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def json_records(pairs: list[tuple[str, str]]) -> str:
    """The paper's formatting: one `"key": "value"` per line inside braces."""
    return "{" + ",\n ".join(f'"{key}": "{value}"' for key, value in pairs) + "}"


@TASKS.register("kv_retrieval")
class KeyValueRetrieval(Task):
    metric = "string_match"
    facts = TaskFacts()  # higher is better, scores in [0, 1]
    selection_keys = frozenset({"num_pairs", "positions", "num_samples"})
    knobs = {
        "num_pairs": Rule(
            "list",
            "task.num_pairs=[25,50] (key-value pairs per object)",
            non_empty=True,
            item=Rule("int", "pair counts ≥ 2", min=2),
        ),
        "positions": Rule(
            "list",
            "task.positions=[0,0.5,1] (where the gold pair sits: 0 = first, 1 = last)",
            non_empty=True,
            item=Rule("float", "positions in [0, 1]", min=0, max=1),
        ),
        "num_samples": Rule("int", "task.num_samples=2 (objects per pair count)", min=1),
        "max_new_tokens": Rule("int", "task.max_new_tokens=100", min=1),
    }

    def examples(self) -> list[Example]:
        return list(self.iter_examples())

    def iter_examples(self) -> Iterator[Example]:
        for n in self.cfg.num_pairs:
            for position in self.cfg.positions:
                for index in range(int(self.cfg.num_samples)):
                    yield self._example(int(n), float(position), index)

    def _example(self, n_pairs: int, position: float, index: int) -> Example:
        # the object depends on (seed, n_pairs, index) only: positions move the same gold pair through it
        rng = random.Random(f"kv_retrieval:{self.seed}:{n_pairs}:{index}")
        pairs = [(random_uuid(rng), random_uuid(rng)) for _ in range(n_pairs)]
        gold = pairs.pop(0)
        gold_index = round(position * (n_pairs - 1))
        pairs.insert(gold_index, gold)
        prompt = PromptBuilder(
            self.tokenizer,
            instruction=INSTRUCTION + "\n\nJSON data:",
            question=f'Key: "{gold[0]}"\nCorresponding value:',
            answer_prefix="",
        )
        return Example(
            example_id=f"kvr-N{n_pairs}-P{position:g}-i{index}-s{self.seed}",
            context_ids=prompt.head_ids + encode(self.tokenizer, json_records(pairs)),
            question_ids=prompt.tail_ids,
            answers=[gold[1]],
            max_new_tokens=int(self.cfg.max_new_tokens),
            subset=f"N{n_pairs}",
            meta={"num_pairs": n_pairs, "gold_index": gold_index, "depth": position, "scenario": "synthetic retrieval"},
        )

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        value = example.answers[0]
        return {"score": string_match(prediction, value), "score_partial": partial_match(prediction, value)}
