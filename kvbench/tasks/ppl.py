"""Long-text perplexity with a bounded cache (StreamingLLM's evaluation): the text streams through the model in
chunks and every method keeps its cache within budget as it grows; one row per window (chunk), so the curve of
perplexity against tokens seen shows where a bounded cache starts to cost quality.

Text: Python's bundled documentation prose (present wherever Python is), or the user's files. A fractional
budget is a fraction of the whole text's tokens; an integer budget is the cache size in tokens.
"""

from __future__ import annotations

import math
import random

from kvbench import KvbenchError
from kvbench.config.rules import Rule
from kvbench.tasks.base import TASKS, Example, Task
from kvbench.tasks.facts import TaskFacts
from kvbench.tasks.haystack import check_files, load_sentences, sentence_files


@TASKS.register("ppl")
class Perplexity(Task):
    metric = "perplexity"
    facts = TaskFacts(lower_is_better=True, score_range=(1.0, math.inf), plots=("stream",))
    kind = "stream"
    knobs = {
        "text": Rule("str", "task.text=prose or task.text=file", choices=("prose", "file")),
        "text_files": Rule("list", "task.text_files=[a.txt]", item=Rule("str", "file paths")),
        "length": Rule("int", "task.length=4096 (tokens to stream)", min=2),
        "chunk": Rule("int", "task.chunk=256 (tokens per step)", min=1),
    }

    @classmethod
    def check(cls, cfg: dict) -> None:
        if int(cfg.get("length", 0)) < 2 * int(cfg.get("chunk", 1)):
            raise KvbenchError(
                f"task ppl: length={cfg.get('length')} must be at least two chunks of "
                f"chunk={cfg.get('chunk')}; raise task.length or lower task.chunk"
            )
        if cfg.get("text") == "file":
            check_files("task.text_files", cfg.get("text_files"))

    @property
    def chunk(self) -> int:
        return int(self.cfg.chunk)

    def examples(self) -> list[Example]:
        cfg = self.cfg
        if int(cfg.length) < 2 * self.chunk or self.chunk < 1:
            raise KvbenchError(f"task ppl: length={cfg.length} must be at least two chunks of chunk={cfg.chunk}")
        sentences = load_sentences(cfg.text, list(cfg.get("text_files") or []), "task.text_files")
        start = random.Random(f"{self.seed}:ppl").randrange(len(sentences)) if cfg.text == "prose" else 0
        ids: list[int] = []
        i = start
        while len(ids) < int(cfg.length):  # cycle through the text until it is long enough
            ids += self.tokenizer(" " + sentences[i % len(sentences)], add_special_tokens=False)["input_ids"]
            i += 1
        ids = ids[: int(cfg.length)]
        return [
            Example(
                example_id=f"ppl-{cfg.text}-L{len(ids)}-s{self.seed}",
                context_ids=ids,
                question_ids=[],
                answers=[],
                max_new_tokens=0,
                subset=cfg.text,
                meta={"length_target": int(cfg.length), "scenario": "language modelling"},
            )
        ]

    def data_files(self):
        return sentence_files(self.cfg.text, list(self.cfg.get("text_files") or []))

    def row_ids(self, example: Example) -> list[str]:
        n_windows = math.ceil((len(example.context_ids) - 1) / self.chunk)
        return [f"{example.example_id}/w{k:03d}" for k in range(n_windows)]

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        raise KvbenchError("task ppl is scored per window by kvbench.native.streaming, not from generated text")
