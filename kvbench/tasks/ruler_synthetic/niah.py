"""RULER's needle-in-a-haystack variants (hsiehjackson/RULER scripts/synthetic.yaml and synthetic/niah.py).

Haystacks: `repeat` (RULER's noise sentences, one line each repetition), `essay` (RULER: Paul Graham's essays,
which need a download; here the prose of Python's bundled docs, kvbench.tasks.haystack, ~29K words, started over
when a context needs more) and `needle` (lines of distractor needles with other random keys). Keys and values:
"adjective-noun" words, 7-digit numbers or UUIDs.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from itertools import cycle, islice

from kvbench.tasks.haystack import NOISE, python_docs_prose, split_sentences
from kvbench.tasks.niah import random_value
from kvbench.tasks.ruler_synthetic.draft import CONTEXT, Draft, Layout
from kvbench.tasks.ruler_synthetic.words import key_words

NEEDLE = "One of the special magic {kind} for {key} is: {value}."
TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz "
    "you about the {kind} afterwards.\n{context}\nWhat are all the special magic {kind} for {query} mentioned "
    "in the provided text?"
)
ANSWER_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
NOISE_LINE = " ".join(NOISE)
DEPTHS = tuple(round(100 * i / 39) for i in range(40))  # RULER's essay depths: np.linspace(0, 100, 40), rounded


@dataclass(frozen=True)
class NiahVariant:
    haystack: str  # repeat | essay | needle
    key: str  # words | uuids
    value: str  # numbers | uuids
    n_keys: int = 1  # needles with different keys (one of them queried unless n_queries says otherwise)
    n_values: int = 1  # needles (values) per key
    n_queries: int = 1  # keys asked at once


VARIANTS = {
    "niah_single_1": NiahVariant("repeat", "words", "numbers"),
    "niah_single_2": NiahVariant("essay", "words", "numbers"),
    "niah_single_3": NiahVariant("essay", "words", "uuids"),
    "niah_multikey_1": NiahVariant("essay", "words", "numbers", n_keys=4),
    "niah_multikey_2": NiahVariant("needle", "words", "numbers"),
    "niah_multikey_3": NiahVariant("needle", "uuids", "uuids"),
    "niah_multivalue": NiahVariant("essay", "words", "numbers", n_values=4),
    "niah_multiquery": NiahVariant("essay", "words", "numbers", n_queries=4),
}


def random_item(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return random_value(rng, "digits", 7)
    if kind == "uuids":
        return random_value(rng, "uuid", 0)
    adjectives, nouns = key_words()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def fresh_item(rng: random.Random, kind: str, taken: set[str]) -> str:
    """A random item not in `taken` (then added to it): keys and values never repeat within a sample."""
    while (item := random_item(rng, kind)) in taken:
        pass
    taken.add(item)
    return item


@lru_cache(maxsize=1)
def prose_words() -> tuple[str, ...]:
    return tuple(" ".join(python_docs_prose()).split())


def niah_draft(variant: NiahVariant, rng: random.Random, length: int, params, encode) -> Draft:
    n_keys = max(variant.n_keys, variant.n_queries)  # as RULER: every queried key has its needle
    taken: set[str] = set()
    keys = [fresh_item(rng, variant.key, taken) for _ in range(n_keys)]
    values = [[fresh_item(rng, variant.value, taken) for _ in range(variant.n_values)] for _ in keys]
    needles = [(k, NEEDLE.format(kind=variant.value, key=keys[k], value=v)) for k in range(n_keys) for v in values[k]]
    rng.shuffle(needles)
    queried = rng.sample(range(n_keys), variant.n_queries)
    answers = [v for k in queried for v in values[k]]
    names = [keys[k] for k in queried]
    query = f"{', '.join(names[:-1])}, and {names[-1]}" if len(names) > 1 else names[0]

    template, prefix, kind = TEMPLATE, ANSWER_PREFIX, variant.value
    if len(answers) == 1:  # RULER's singular wording for one answer
        for plural, singular in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(plural, singular), prefix.replace(plural, singular)
        kind = kind[:-1]
    # the queried needle's position is reported when it is the only answer
    target = next(i for i, (k, _) in enumerate(needles) if k == queried[0]) if len(answers) == 1 else None
    texts = [text for _, text in needles]
    seed = rng.getrandbits(64)  # every haystack size lays out the same random stream
    if variant.haystack == "essay":
        layout = partial(essay_haystack, texts, target, prose_words(), seed)
        min_units = 1
    else:
        if variant.haystack == "repeat":

            def line(r: random.Random) -> str:
                return NOISE_LINE
        else:

            def line(r: random.Random) -> str:  # distractors: other keys and values than the sample's
                distinct = set(taken)
                key = fresh_item(r, variant.key, distinct)
                return NEEDLE.format(kind=variant.value, key=key, value=fresh_item(r, variant.value, distinct))

        layout = partial(line_haystack, texts, target, line, seed)
        min_units = len(texts)  # RULER inserts each needle before a different line
    return Draft(
        template=template.format(kind=kind, query=query, context=CONTEXT),
        answer_prefix=prefix.format(kind=kind, query=query),
        answers=answers,
        layout=layout,
        min_units=min_units,
    )


def line_haystack(
    needles: list[str], target: int | None, line: Callable[[random.Random], str], seed: int, n: int
) -> Layout:
    """RULER's repeat/needle haystacks: n lines, each needle inserted as a line before a random line."""
    rng = random.Random(seed)
    lines = [line(rng) for _ in range(n)]
    indexes = sorted(rng.sample(range(n), len(needles)), reverse=True)
    for index, needle in zip(indexes, needles):
        lines.insert(index, needle)
    depth = None if target is None else indexes[target] / n
    return Layout("\n".join(lines), filler="\n" + line(rng), depth=depth)


def essay_haystack(needles: list[str], target: int | None, words: tuple[str, ...], seed: int, n: int) -> Layout:
    """RULER's essay haystack: the first n words, the needles placed between sentences at random depths."""
    rng = random.Random(seed)
    stream = cycle(words)
    sentences = split_sentences(" ".join(islice(stream, n)))
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    cuts = [0] + [int(len(sentences) * d / 100) for d in depths]
    parts = []
    for i, needle in enumerate(needles):
        parts += sentences[cuts[i] : cuts[i + 1]] + [needle]
    parts += sentences[cuts[-1] :]
    depth = None if target is None else depths[target] / 100
    return Layout(" ".join(parts), filler=" " + " ".join(islice(stream, 64)), depth=depth)
