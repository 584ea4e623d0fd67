"""RULER's aggregation generators, draw for draw: common words extraction (data/synthetic/common_words_extraction.py)
and frequent (coded) words extraction (data/synthetic/freq_words_extraction.py)."""

from __future__ import annotations

import string
from functools import cache

import numpy as np

from kvbench.tasks.ruler import source
from kvbench.tasks.ruler.stream import Sample, Stream, retry


@cache
def _cwe_vocabulary() -> list[str]:
    lists = ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
    return sorted({w for name in lists for w in source.wonderwords_list(name)})


def _split(template: str, answer_prefix: str, fill: dict) -> tuple[str, str, str]:
    whole = template + answer_prefix
    return whole.format(**fill), whole.split("{context}", 1)[1].format(**fill), answer_prefix.format(**fill)


class CommonWords:
    def __init__(self, args: dict, template: str, answer_prefix: str, stream: Stream):
        self.freq_cw, self.freq_ucw = args.get("freq_cw", 30), args.get("freq_ucw", 3)
        self.num_cw = args.get("num_cw", 10)
        self.template, self.answer_prefix, self.s = template, answer_prefix, stream
        self.words = stream.shuffled(list(_cwe_vocabulary()))  # shuffled once per run with the seed

    def _list(self, num_words: int, common_repeats, uncommon_repeats, common_nums) -> tuple[str, list[str]]:
        full = self.s.rng.sample(self.words, num_words)
        common, uncommon = full[:common_nums], full[common_nums:]
        listed = self.s.shuffled(common * int(common_repeats) + uncommon * int(uncommon_repeats))
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(listed)), common

    def sample(self, num_words: int, length: int) -> Sample:
        if length < 4096:  # RULER's short setting: a smaller solved example, 6 and 1 repetitions
            example, example_answer = self._list(20, 3, 1, self.num_cw)
            context, answer = self._list(num_words, 6, 1, self.num_cw)
        else:
            example, example_answer = self._list(40, 10, 3, self.num_cw)
            context, answer = self._list(num_words, self.freq_cw, self.freq_ucw, self.num_cw)
        solved, _, _ = _split(self.template, self.answer_prefix, {"context": example, "query": ""})
        solved += " ".join(f"{i + 1}. {word}" for i, word in enumerate(example_answer))
        text, question, prefix = _split(self.template, self.answer_prefix, {"context": context, "query": ""})
        return Sample(solved + "\n" + text, answer, question, prefix)

    def generate(self, length: int, ttg: int, num_samples: int) -> list[Sample]:
        step = 10
        n, total = step, 0
        while total + ttg < length:
            sample = self.sample(n, length)
            numbered = " ".join(f"{i + 1}. {word}" for i, word in enumerate(sample.answers))
            total = self.s.count(sample.text + " " + numbered)
            if total + ttg > length:
                n -= step
                break
            n += step
            if n > len(self.words):
                n = len(self.words)
                break
        make = lambda m: self.sample(m, length)
        return [retry(make, n, step, length, ttg, self.s, "cwe") for _ in range(num_samples)]


class FrequentWords:
    def __init__(self, args: dict, template: str, answer_prefix: str, stream: Stream):
        self.alpha, self.wordlen = float(args.get("alpha", 2.0)), int(args.get("coded_wordlen", 6))
        self.vocab_size = int(args.get("vocab_size", -1))
        self.template, self.answer_prefix, self.s = template, answer_prefix, stream

    def _vocab(self, size: int) -> list[str]:
        rng = self.s.rng
        vocab = ["".join(rng.choices(string.ascii_lowercase, k=self.wordlen)) for _ in range(size)]
        while len(set(vocab)) < size:
            vocab.append("".join(rng.choices(string.ascii_lowercase, k=self.wordlen)))
        vocab = self.s.shuffled(sorted(set(vocab)))
        vocab[0] = "..."  # the most frequent word is noise
        return vocab

    def _text(self, vocab: list[str], num_words: int) -> Sample:
        from scipy.special import zeta

        k = np.arange(1, len(vocab) + 1)  # (V,) ranks
        counts = (num_words * (k**-self.alpha) / zeta(self.alpha)).astype(int)  # (V,) Zipf counts, floored
        words = self.s.shuffled([w for w, c in zip(vocab, counts) for _ in range(c)])
        text, question, prefix = _split(self.template, self.answer_prefix, {"context": " ".join(words), "query": ""})
        return Sample(text, vocab[1:4], question, prefix)

    def _draw(self, max_len: int, vocab_size: int, step: int, num_words: int = -1) -> tuple[Sample, int]:
        vocab = self._vocab(vocab_size)
        if num_words > 0:
            sample = self._text(vocab, num_words)
            while self.s.count(sample.text) > max_len:
                num_words -= step
                sample = self._text(vocab, num_words)
        else:
            num_words = max_len // self.wordlen
            sample = self._text(vocab, num_words)
            while self.s.count(sample.text) < max_len:
                num_words += step
                sample = self._text(vocab, num_words)
            num_words -= step
        return self._text(vocab, num_words), num_words

    def generate(self, length: int, ttg: int, num_samples: int) -> list[Sample]:
        # RULER's fwe fits the text itself to `length` (the generated tokens are not subtracted)
        vocab_size = length // 50 if self.vocab_size == -1 else self.vocab_size
        _, num_words = self._draw(length, vocab_size, length // 32)
        return [self._draw(length, vocab_size, length // 32, num_words)[0] for _ in range(num_samples)]
