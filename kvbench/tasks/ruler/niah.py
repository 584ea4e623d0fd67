"""RULER's needle-in-a-haystack generator (data/synthetic/niah.py), draw for draw: the 8 niah_* tasks."""

from __future__ import annotations

import re
import uuid
from bisect import bisect_right
from collections.abc import Sequence
from functools import cache
from itertools import accumulate

import numpy as np

from kvbench.tasks.ruler import source
from kvbench.tasks.ruler.stream import Sample, Stream, retry

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = list(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))  # np.int64s, as the script's


@cache
def essay_words() -> list[str]:
    return re.sub(r"\s+", " ", source.essay()).split(" ")


class KeyWords(Sequence):
    """The script's `words`: every `adjective-noun` of wonderwords' lists, distinct and sorted (6.2M strings, 25 s and
    0.8 GB to build), read by index without building it. Strings under one prefix `adj-` are contiguous once sorted,
    and prefixes neither of which starts the other order their strings as they order themselves; so the list is
    the runs of prefixes that start with the run's first one, in order, each run its sorted distinct strings (a run
    of one prefix: its nouns in order; of more, e.g. `blue-` and `blue-eyed-`: built, 2 × 6.8K strings)."""

    def __init__(self, adjs, nouns):
        self.nouns = sorted(set(nouns))
        runs: list[list[str]] = []
        for p in sorted({f"{a}-" for a in adjs}):
            if runs and p.startswith(runs[-1][0]):
                runs[-1].append(p)
            else:
                runs.append([p])
        self.runs = [r[0] if len(r) == 1 else sorted({p + n for p in r for n in self.nouns}) for r in runs]
        sizes = (len(self.nouns) if isinstance(r, str) else len(r) for r in self.runs)
        self.starts = list(accumulate(sizes, initial=0))  # where each run begins in the sorted list

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i):  # type: ignore[override]  # ints only: what random.choice asks
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = bisect_right(self.starts, i) - 1
        run, at = self.runs[k], i - self.starts[k]
        return run + self.nouns[at] if isinstance(run, str) else run[at]


@cache
def key_words() -> KeyWords:
    return KeyWords(source.wonderwords_list("adjectivelist.txt"), source.wonderwords_list("nounlist.txt"))


class Niah:
    def __init__(self, args: dict, template: str, answer_prefix: str, stream: Stream):
        self.a = {"num_needle_k": 1, "num_needle_v": 1, "num_needle_q": 1, **args}
        self.a["num_needle_k"] = max(self.a["num_needle_k"], self.a["num_needle_q"])
        self.template, self.answer_prefix, self.s = template, answer_prefix, stream

    def random(self, kind: str) -> str:
        rng = self.s.rng
        if kind == "numbers":
            return str(rng.randint(10**6, 10**7 - 1))
        if kind == "words":
            return rng.choice(key_words())
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        raise ValueError(f"RULER's niah has no needle type {kind!r}")

    def sample(self, num_haystack: int) -> Sample:
        a, rng = self.a, self.s.rng
        keys, values, needles = [], [], []
        for _ in range(a["num_needle_k"]):
            keys.append(self.random(a["type_needle_k"]))
            value = []
            for _ in range(a["num_needle_v"]):
                value.append(self.random(a["type_needle_v"]))
                needles.append(NEEDLE.format(type_needle_v=a["type_needle_v"], key=keys[-1], value=value[-1]))
            values.append(value)
        self.s.shuffled(needles)

        if a["type_haystack"] == "essay":
            sents = source.sent_tokenizer().tokenize(" ".join(essay_words()[:num_haystack]).strip())
            depths = rng.sample(DEPTHS, len(needles))
            cuts = [0] + sorted(int(len(sents) * (d / 100)) for d in depths) + [len(sents)]
            parts = []
            for i in range(1, len(cuts)):
                parts.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if a["type_haystack"] == "repeat":
                sentences = [REPEAT] * num_haystack
            else:  # "needle": a haystack of needles with random keys and values
                sentences = [
                    NEEDLE.format(
                        type_needle_v=a["type_needle_v"],
                        key=self.random(a["type_needle_k"]),
                        value=self.random(a["type_needle_v"]),
                    )
                    for _ in range(num_haystack)
                ]
            for index, needle in zip(sorted(rng.sample(range(num_haystack), len(needles)), reverse=True), needles):
                sentences.insert(index, needle)
            context = "\n".join(sentences)

        indices = rng.sample(range(a["num_needle_k"]), a["num_needle_q"])
        queries = [keys[i] for i in indices]
        answers = [v for i in indices for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

        # the script's singular rewrite runs over its whole template (task template + answer prefix), here over the
        # two parts: no replaced word spans their joint
        template, prefix, type_v = self.template, self.answer_prefix, a["type_needle_v"]
        if a["num_needle_q"] * a["num_needle_v"] == 1:
            template, prefix = (_singular(t) for t in (template, prefix))
            type_v = type_v[:-1]
        fill = {"type_needle_v": type_v, "context": context, "query": query}
        text = (template + prefix).format(**fill)
        after = (template + prefix).split("{context}", 1)[1]
        head = f"for {queries[0]} is: {answers[0]}."
        depth = context.find(head) / max(1, len(context)) if len(answers) == 1 else None
        return Sample(text, answers, after.format(**fill), prefix.format(**fill), depth)

    def generate(self, length: int, ttg: int, num_samples: int) -> list[Sample]:
        kind = self.a["type_haystack"]
        step = 500 if kind == "essay" else 25
        if kind != "essay" and length < 4096:
            step = 5
        n, total = step, 0
        while total + ttg < length:  # the script's haystack-size search, on its first draws
            sample = self.sample(n)
            total = self.s.count(sample.text + " ".join(sample.answers))
            if total + ttg > length:
                n -= step
                break
            if kind == "essay" and n > len(essay_words()):
                n = len(essay_words())
                break
            n += step
        return [retry(self.sample, n, step, length, ttg, self.s, "niah") for _ in range(num_samples)]


def _singular(t: str) -> str:
    return t.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")
