"""RULER's aggregation tasks (hsiehjackson/RULER synthetic/common_words_extraction.py, freq_words_extraction.py).

cwe: a numbered list of words where `num_cw` words appear `freq_cw` times and the others `freq_ucw` times; name
the common ones. As RULER, prompts shorter than 4096 tokens use 6 and 1 repetitions instead (and a smaller
solved example), so that the common words do not fill the whole list. RULER shows the solved example as text
before the task; with a chat template it is a user/assistant turn of its own here.

fwe: random 6-letter "coded words" drawn with Zipf frequencies (rank k ∝ k^-alpha); the top rank is the noise
word "..." and the answer is the next three.
"""

from __future__ import annotations

import math
import random
import string
from functools import partial

from kvbench import KvbenchError
from kvbench.tasks.ruler_synthetic.draft import CONTEXT, Draft, Layout
from kvbench.tasks.ruler_synthetic.words import list_words

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
    "ones that appear most often.\n{context}\nQuestion: What are the {num_cw} most common words in the "
    "above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top {num_cw} words that appear most often in the list are:"
CWE_SHORT = 4096  # RULER's threshold for the short-context repetitions

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
FWE_WORD_LETTERS = 6


def numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def word_list(common: list[str], others: list[str], common_times: int, other_times: int, rng: random.Random):
    words = common * common_times + others * other_times
    rng.shuffle(words)
    return words


def cwe_draft(rng: random.Random, length: int, params: dict, encode) -> Draft:
    num_cw, freq_cw, freq_ucw = int(params["num_cw"]), int(params["freq_cw"]), int(params["freq_ucw"])
    if not (num_cw >= 1 and freq_cw > freq_ucw >= 1):
        raise KvbenchError(
            f"task.cwe: need num_cw >= 1 and freq_cw > freq_ucw >= 1 (got num_cw={num_cw}, "
            f"freq_cw={freq_cw}, freq_ucw={freq_ucw})"
        )
    if length < CWE_SHORT:
        freq_cw, freq_ucw, example_words, example_cw, example_ucw = 6, 1, 20, 3, 1
    else:
        example_words, example_cw, example_ucw = 40, 10, 3
    example_words = max(example_words, num_cw + 1)
    # a prediction that echoes the question ("most common words") must not name an answer
    words = [w for w in list_words() if w not in CWE_TEMPLATE + CWE_ANSWER_PREFIX]
    rng.shuffle(words)
    # disjoint: the example's words never add to the task list's counts
    common, example, others = words[:num_cw], words[num_cw : num_cw + example_words], words[num_cw + example_words :]
    example_list = word_list(example[:num_cw], example[num_cw:], example_cw, example_ucw, rng)
    prefix = CWE_ANSWER_PREFIX.format(num_cw=num_cw)
    return Draft(
        template=CWE_TEMPLATE.format(context=CONTEXT, num_cw=num_cw),
        answer_prefix=prefix,
        answers=common,
        layout=partial(cwe_layout, common, others, freq_cw, freq_ucw, rng.getrandbits(64)),
        max_units=len(others),
        runs_out=f"distinct words (kvbench.tasks.ruler_synthetic.words has {len(words)})",
        example=(
            CWE_TEMPLATE.format(context=numbered(example_list), num_cw=num_cw),
            f"{prefix} {numbered(example[:num_cw])}",
        ),
    )


def cwe_layout(common: list[str], others: list[str], freq_cw: int, freq_ucw: int, seed: int, n: int) -> Layout:
    return Layout(numbered(word_list(common, others[:n], freq_cw, freq_ucw, random.Random(seed))))


def zeta(s: float, terms: int = 1000) -> float:
    """Riemann zeta for s > 1 (RULER uses scipy's): a partial sum plus its Euler–Maclaurin tail."""
    head = math.fsum(k**-s for k in range(1, terms))
    return head + terms ** (1 - s) / (s - 1) + terms**-s / 2 + s * terms ** (-s - 1) / 12


def fwe_draft(rng: random.Random, length: int, params: dict, encode) -> Draft:
    alpha = float(params["alpha"])
    if not alpha > 1:
        raise KvbenchError(f"task.fwe.alpha={alpha}: the Zipf exponent must be above 1")
    size = max(length // 50, 5)  # RULER's vocabulary: max_seq_length // 50 coded words
    vocab: set[str] = set()
    while len(vocab) < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LETTERS))
        if word not in FWE_TEMPLATE:  # an answer must not be found in the prompt's own words
            vocab.add(word)
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."  # the top rank is noise, as RULER
    shares = [k**-alpha / zeta(alpha) for k in range(1, size + 1)]
    # enough words that the 4th rank (the last answer) occurs strictly more often than the 5th
    smallest = math.ceil(1 / (shares[3] - shares[4]))
    return Draft(
        template=FWE_TEMPLATE.format(context=CONTEXT),
        answer_prefix=FWE_ANSWER_PREFIX,
        answers=ranked[1:4],
        layout=partial(fwe_layout, ranked, shares, rng.getrandbits(64)),
        min_units=smallest,
    )


def fwe_layout(ranked: list[str], shares: list[float], seed: int, n: int) -> Layout:
    """About n words: rank k occurs int(n * share_k) times (RULER's sampling), in random order."""
    words = [word for word, share in zip(ranked, shares) for _ in range(int(n * share))]
    random.Random(seed).shuffle(words)
    return Layout(" ".join(words))
