"""Workloads whose requests share prefixes (offline, seeded): each example is one request, run in order.

A document is a haystack of `context_length` tokens holding `questions` (or `turns`) needles, RULER style
(key → value, at evenly spread depths); each request asks for one key's value:
- `shared_doc`: many questions on one document, each a fresh single-turn chat (multi-needle NIAH, one question
  per key); the shared prefix is the chat header, the instruction and the document.
- `system_prompt`: a long shared system prompt (the records) and independent user questions.
- `multiturn`: one chat whose history grows each turn: turn t repeats the previous turns, with the reference
  answers as the assistant's replies (the history does not depend on the model), and asks for key t.

`Example.context_ids` is the part every request of a workload shares (what `reuse=compress_once` compresses
once); `question_ids` is the rest (the question; in a chat, the history after the document too).
Rows carry `workload`, `turn` and `request_index` (the request's position in its workload).
"""

from __future__ import annotations

import abc
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvbench import KvbenchError
from kvbench.tasks.base import TASKS, Example, Task
from kvbench.tasks.haystack import Encoded, check_files, load_sentences, sentence_files
from kvbench.tasks.metrics import partial_match, string_match
from kvbench.tasks.niah import ADJECTIVES, NOUNS, VALUE_NAMES, fill_haystack, random_value

MARK = "\x00DOCUMENT\x00"


def chat_split(tokenizer, messages: list[dict], answer_prefix: str) -> tuple[list[int], list[int]]:
    """Token ids before and after the MARK inside one message of the templated chat (+ generation prompt and
    `answer_prefix`)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n".join(m["content"] for m in messages) + "\n"
    head, tail = (text + answer_prefix).split(MARK)

    def encode(s):
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    return encode(head), encode(tail)


def with_needles(sentences: list[list[int]], needles: list[list[int]], depths: list[float]) -> list[int]:
    """The haystack's tokens with each needle inserted at the sentence boundary nearest its depth (ascending)."""
    total = sum(map(len, sentences))
    out, seen, pending = [], 0, list(zip(depths, needles))
    for sentence in sentences:
        while pending and seen >= pending[0][0] * total:
            out += pending.pop(0)[1]
        out += sentence
        seen += len(sentence)
    for _, needle in pending:
        out += needle
    return out


@dataclass(frozen=True)
class Fact:
    """One request's evidence: `text` is inserted into the shared document, `question` asks for `answer`;
    `answer_prefix` follows the generation prompt (RULER's habit; empty for LongBench-style prompts)."""

    text: str
    question: str
    answer: str
    answer_prefix: str = ""


class SharedPrefixTask(Task):
    """The common frame of the workloads: one document per workload holding one fact per request at evenly spread
    depths, the requests' prompts split into the shared head and each request's tail. Subclasses say what the
    facts are (`request_facts`), how a prompt is laid out (`prompt`) and what the document's units are (`units`)."""

    metric = "string_match"
    kind = "workload"
    n_requests_key = "questions"

    def examples(self) -> list[Example]:
        return list(self.iter_examples())

    def iter_examples(self) -> Iterator[Example]:
        """One workload (document) built at a time: its requests share the document."""
        cfg = self.cfg
        n, documents = int(cfg[self.n_requests_key]), int(cfg.documents)
        if n < 1 or documents < 1:
            raise KvbenchError(f"task.{self.n_requests_key} and task.documents must be >= 1")
        units = self.units(load_sentences(cfg.haystack, list(cfg.get("haystack_files") or [])))
        for d in range(documents):
            yield from self._workload(d, n, units)

    def data_files(self):
        return sentence_files(self.cfg.haystack, list(self.cfg.get("haystack_files") or []))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @classmethod
    def check(cls, cfg: dict) -> None:
        if cfg.get("haystack") == "file":
            check_files("task.haystack_files", cfg.get("haystack_files"))

    def units(self, sentences: list[str]) -> Sequence[list[int]]:
        """The haystack's text units, token ids, in order (facts go between units): sentences, tokenized as the
        document takes them."""
        return Encoded([" " + s for s in sentences], self.encode)

    def request_facts(self, rng: random.Random, n: int) -> tuple[str, list[Fact]]:
        """(the instruction before the document, `n` facts), drawn with `rng`: RULER's key → value needles."""
        cfg = self.cfg
        if n > len(ADJECTIVES) * len(NOUNS):
            raise KvbenchError(f"task.{self.n_requests_key}={n}: at most {len(ADJECTIVES) * len(NOUNS)} keys")
        singular, plural = VALUE_NAMES.get(cfg.value_type, ("", ""))
        keys: list[str] = []
        while len(keys) < n:
            key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
            keys += [key] if key not in keys else []
        values = [random_value(rng, cfg.value_type, int(cfg.value_length)) for _ in keys]
        instruction = (
            f"Some special magic {plural} are hidden within the following text. Make sure to memorize "
            f"them. I will quiz you about the {plural} afterwards."
        )
        return instruction, [
            Fact(
                text=f" One of the special magic {plural} for {k} is: {v}.",
                question=f"What is the special magic {singular} for {k} mentioned in the provided text?",
                answer=v,
                answer_prefix=f"The special magic {singular} for {k} mentioned in the provided text is",
            )
            for k, v in zip(keys, values)
        ]

    def subset(self) -> str:
        return f"{self.cfg.haystack}-{self.cfg.value_type}"

    def rng_seed(self, doc: int) -> str:
        cfg = self.cfg
        return f"{self.seed}:{self.name}:{cfg.haystack}:{cfg.value_type}:{cfg.context_length}:{doc}"

    def _workload(self, doc: int, n: int, units: Sequence[list[int]]) -> list[Example]:
        cfg = self.cfg
        rng = random.Random(self.rng_seed(doc))
        instruction, facts = self.request_facts(rng, n)
        needles = [self.encode(f.text) for f in facts]
        prompts = [self.prompt(instruction, facts, i) for i in range(n)]
        head = prompts[0][0]
        room = int(cfg.context_length) - len(head) - sum(map(len, needles))
        if room < 1:
            raise KvbenchError(
                f"task.context_length={cfg.context_length} is too short for {n} facts and the "
                f"template (at least {int(cfg.context_length) - room + 1} tokens)"
            )
        start = rng.randrange(len(units)) if cfg.haystack != "noise" else 0
        depths = [(i + 0.5) / n for i in range(n)]
        document = with_needles(fill_haystack(units, start, room), needles, depths)
        return [
            Example(
                example_id=f"{self.name}-{cfg.haystack}-L{cfg.context_length}-d{doc}-r{i}-s{self.seed}",
                context_ids=head + document,
                question_ids=tail,
                answers=[facts[i].answer],
                max_new_tokens=int(cfg.max_new_tokens),
                subset=self.subset(),
                meta={
                    "workload": f"{self.name}-d{doc}",
                    "request_index": i,
                    "turn": i if self.name == "multiturn" else 0,
                    "depth": depths[i],
                    "length_target": int(cfg.context_length),
                    "scenario": "shared prefix",
                },
                evidence=(facts[i].answer,),
            )
            for i, (_, tail) in enumerate(prompts)
        ]

    @abc.abstractmethod
    def prompt(self, instruction: str, facts: list[Fact], i: int) -> tuple[list[int], list[int]]:
        """Request i's (shared prefix ids, its own ids): each workload lays out its chat."""

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        value = example.answers[0]
        return {"score": string_match(prediction, value), "score_partial": partial_match(prediction, value)}


@TASKS.register("shared_doc")
class SharedDocument(SharedPrefixTask):
    name = "shared_doc"

    def prompt(self, instruction, facts, i):
        user = f"{instruction}\n{MARK}\n{facts[i].question}"
        return chat_split(self.tokenizer, [{"role": "user", "content": user}], facts[i].answer_prefix)


@TASKS.register("system_prompt")
class SystemPrompt(SharedPrefixTask):
    name = "system_prompt"

    def prompt(self, instruction, facts, i):
        system = f"You are a helpful assistant. {instruction}\n{MARK}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": facts[i].question}]
        return chat_split(self.tokenizer, messages, facts[i].answer_prefix)


@TASKS.register("multiturn")
class MultiTurn(SharedPrefixTask):
    name = "multiturn"
    n_requests_key = "turns"

    def prompt(self, instruction, facts, i):
        messages = [{"role": "user", "content": f"{instruction}\n{MARK}\n{facts[0].question}"}]
        for t in range(1, i + 1):
            messages += [
                {"role": "assistant", "content": f"{facts[t - 1].answer_prefix} {facts[t - 1].answer}."},
                {"role": "user", "content": facts[t].question},
            ]
        return chat_split(self.tokenizer, messages, facts[i].answer_prefix)
