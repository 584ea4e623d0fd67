"""Needle in a haystack, RULER style: a random key → value needle in an offline haystack, over a grid of
context lengths × depths; scored by exact value match plus a partial (longest matching run) score.

Template (RULER niah_single): instruction, context, question; the answer prefix is appended after the
generation prompt so the model answers with the value directly.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence

from kvbench import KvbenchError
from kvbench.config.rules import Rule
from kvbench.tasks.base import TASKS, Example, Task
from kvbench.tasks.facts import TaskFacts
from kvbench.tasks.haystack import HAYSTACKS, Encoded, check_files, load_sentences, sentence_files
from kvbench.tasks.metrics import partial_match, string_match
from kvbench.tasks.prompts import PromptBuilder, encode

ADJECTIVES = (
    "amber ancient bitter brave bright calm clever cold crimson curious damp eager early faint fancy "
    "fierce gentle giant golden hollow humble icy jolly lively lonely loud lucky misty modern narrow "
    "noble odd pale patient plain proud quiet rapid rough royal rusty sandy shiny silent silver sleepy "
    "smooth solid spicy steady stormy sturdy sunny swift tidy tiny vivid warm wild windy wooden"
).split()
NOUNS = (
    "anchor apple arrow badger banjo barrel beacon bison blanket bottle bridge bucket cactus camel candle "
    "canyon castle cedar cherry clock comet copper coral cricket dolphin dragon drum eagle falcon feather "
    "fiddle forest fossil garden glacier harbor hammer helmet island jacket kettle ladder lantern lemon "
    "meadow mirror needle oyster panther pepper pigeon pillow planet pocket puzzle quartz rabbit river "
    "saddle salmon tulip tunnel violin walnut whistle willow zebra"
).split()
VALUE_NAMES = {"digits": ("number", "numbers"), "words": ("word", "words"), "uuid": ("uuid", "uuids")}


def random_value(rng: random.Random, value_type: str, length: int) -> str:
    if value_type == "digits":
        return str(rng.randint(10 ** (length - 1), 10**length - 1))
    if value_type == "words":
        return rng.choice(NOUNS)
    if value_type == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise KvbenchError(f"task.value_type={value_type!r}: use one of {', '.join(VALUE_NAMES)}")


def fill_haystack(encoded: Sequence[list[int]], start: int, n_tokens: int) -> list[list[int]]:
    """Sentences (cycling from `start`) adding up to exactly `n_tokens` tokens; the last one cut to fit."""
    out, total, i = [], 0, start
    while total < n_tokens:
        sentence = encoded[i % len(encoded)][: n_tokens - total]
        out.append(sentence)
        total += len(sentence)
        i += 1
    return out


def insert_at_depth(sentences: list[list[int]], needle: list[int], depth: float) -> list[int]:
    """Insert the needle at the sentence boundary nearest `depth` (0 = start, 1 = end) of the haystack tokens."""
    total = sum(map(len, sentences))
    cut, seen = len(sentences), 0
    for i, sentence in enumerate(sentences):
        if seen >= depth * total:
            cut = i
            break
        seen += len(sentence)
    ids = [t for s in sentences[:cut] for t in s] + needle + [t for s in sentences[cut:] for t in s]
    return ids


@TASKS.register("niah")
class NeedleInAHaystack(Task):
    metric = "string_match"
    facts = TaskFacts(plots=("heatmap",))  # rows carry length_target and depth
    selection_keys = frozenset({"context_lengths", "depths"})
    knobs = {
        "context_lengths": Rule(
            "list",
            "task.context_lengths=[1024,2048] (prompt tokens)",
            non_empty=True,
            item=Rule("int", "token counts ≥ 1", min=1),
        ),
        "depths": Rule(
            "list",
            "task.depths=[0.1,0.5,0.9] (0 = start of the context, 1 = end)",
            non_empty=True,
            item=Rule("float", "depths in [0, 1]", min=0, max=1),
        ),
        "haystack": Rule("str", "task.haystack=noise, prose or file", choices=HAYSTACKS),
        "haystack_files": Rule("list", "task.haystack_files=[a.txt,b.txt]", item=Rule("str", "file paths")),
        "value_type": Rule("str", "task.value_type=digits, words or uuid", choices=tuple(VALUE_NAMES)),
        "value_length": Rule("int", "task.value_length=7 (digits per value)", min=1),
        "max_new_tokens": Rule("int", "task.max_new_tokens=24", min=1),
    }

    @classmethod
    def check(cls, cfg: dict) -> None:
        if cfg.get("haystack") == "file":
            check_files("task.haystack_files", cfg.get("haystack_files"))

    def examples(self) -> list[Example]:
        cfg = self.cfg
        if not cfg.context_lengths or not cfg.depths:
            raise KvbenchError("task niah needs non-empty task.context_lengths and task.depths")
        for depth in cfg.depths:
            if not 0 <= float(depth) <= 1:
                raise KvbenchError(f"task.depths: {depth} is outside [0, 1] (0 = start of the context, 1 = end)")
        sentences = load_sentences(cfg.haystack, list(cfg.get("haystack_files") or []))
        encoded = Encoded([" " + s for s in sentences], self._encode)  # tokenized as prompts take them
        return [
            self._example(int(length), float(depth), encoded) for length in cfg.context_lengths for depth in cfg.depths
        ]

    def data_files(self):
        return sentence_files(self.cfg.haystack, list(self.cfg.get("haystack_files") or []))

    def _encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)

    def _example(self, length: int, depth: float, encoded: Sequence[list[int]]) -> Example:
        cfg = self.cfg
        rng = random.Random(f"{self.seed}:{cfg.haystack}:{cfg.value_type}:{length}:{depth}")
        singular, plural = VALUE_NAMES.get(cfg.value_type, ("", ""))
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        value = random_value(rng, cfg.value_type, int(cfg.value_length))
        prompt = PromptBuilder(
            self.tokenizer,
            instruction=f"Some special magic {plural} are hidden within the following text. Make sure to memorize "
            f"it. I will quiz you about the {plural} afterwards.",
            question=f"What is the special magic {singular} for {key} mentioned in the provided text?",
            answer_prefix=f"The special magic {singular} for {key} mentioned in the provided text is",
        )
        needle = self._encode(f" One of the special magic {plural} for {key} is: {value}.")
        room = length - len(prompt.head_ids) - len(prompt.tail_ids) - len(needle)
        if room < 1:
            raise KvbenchError(
                f"task.context_lengths: {length} tokens is too short for the NIAH template "
                f"(at least {length - room + 1} with this tokenizer)"
            )
        start = rng.randrange(len(encoded)) if cfg.haystack != "noise" else 0
        haystack = insert_at_depth(fill_haystack(encoded, start, room), needle, depth)
        return Example(
            example_id=f"niah-{cfg.haystack}-{cfg.value_type}-L{length}-D{depth:g}-s{self.seed}",
            context_ids=prompt.head_ids + haystack,
            question_ids=prompt.tail_ids,
            answers=[value],
            max_new_tokens=int(cfg.max_new_tokens),
            subset=f"{cfg.haystack}-{cfg.value_type}",
            meta={"length_target": length, "depth": depth, "scenario": "synthetic retrieval"},
            evidence=(value,),
        )

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        value = example.answers[0]
        return {"score": string_match(prediction, value), "score_partial": partial_match(prediction, value)}
