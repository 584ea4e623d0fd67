"""RULER's variable tracking (hsiehjackson/RULER synthetic/variable_tracking.py): chains of `VAR X = Y`
assignments hidden in noise lines; the answer is every variable that ends up holding the queried value.

As RULER, the task is preceded by one solved example of about 500 tokens (3-letter variables), in the same user
turn, with RULER's quirk of collapsing that example's whitespace and dropping its template's last word.
"""

from __future__ import annotations

import random
import string
from functools import partial

from kvbench import KvbenchError
from kvbench.tasks.haystack import NOISE
from kvbench.tasks.ruler_synthetic.draft import CONTEXT, Draft, Layout, largest_fitting

TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
# "assgined" is RULER's spelling: kept, the prompt is the benchmark's
ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
    "are assgined the value {query}, they are: "
)
NOISE_LINE = " ".join(NOISE) + "\n"
EXAMPLE_TOKENS = 470  # RULER sizes its solved example to 500 tokens, 30 of them for the generated answer
PROMPT_TEXT = (TEMPLATE + ANSWER_PREFIX + NOISE_LINE).lower()


def chains_of(variables: list[str], values: list[int], hops: int) -> list[list[str]]:
    """One chain per value: `VAR A = 12345`, then `VAR B = VAR A ` ... (RULER's trailing space included)."""
    chains = []
    for c, value in enumerate(values):
        names = variables[c * (hops + 1) : (c + 1) * (hops + 1)]
        chains.append([f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)])
    return chains


def noise_with_chains(chains: list[list[str]], seed: int, n: int) -> Layout:
    """n noise lines, each chain's statements inserted in order at random lines (RULER's layout)."""
    rng = random.Random(seed)
    lines = [NOISE_LINE] * n
    for chain in chains:
        positions = sorted(rng.sample(range(len(lines)), len(chain)))
        for j, (position, statement) in enumerate(zip(positions, chain)):
            lines.insert(position + j, statement)
    return Layout(" ".join(lines).replace(". \n", ".\n"), filler=" " + NOISE_LINE)


def solved_example(rng: random.Random, num_chains: int, hops: int, taken: set[str], encode) -> str:
    """RULER's in-context example: 3-letter variables, at most 10 hops, about EXAMPLE_TOKENS long."""
    hops = min(10, hops)
    variables = [fresh_variable(rng, 3, taken) for _ in range(num_chains * (hops + 1))]
    values = fresh_values(rng, num_chains, taken)
    layout = partial(noise_with_chains, chains_of(variables, values, hops), rng.getrandbits(64))
    template = " ".join(TEMPLATE.split()[:-1]) + ANSWER_PREFIX  # RULER: collapsed, last word ("above.") dropped
    answer = " ".join(variables[: hops + 1])

    def text(n: int) -> str:
        return template.format(context=layout(n).text, query=values[0], num_v=hops + 1) + " " + answer + "\n\n"

    return text(largest_fitting(hops + 1, lambda n: len(encode(text(n))) <= EXAMPLE_TOKENS))


def fresh_variable(rng: random.Random, letters: int, taken: set[str]) -> str:
    """Upper-case letters, not yet used and not a word of the prompt (answers are matched case-insensitively)."""
    while (name := "".join(rng.choices(string.ascii_uppercase, k=letters))) in taken or name.lower() in PROMPT_TEXT:
        pass
    taken.add(name)
    return name


def fresh_values(rng: random.Random, count: int, taken: set[str]) -> list[int]:
    values: list[int] = []
    while len(values) < count:
        value = rng.randint(10000, 99998)  # RULER: np.random.randint(10000, 99999), high end exclusive
        if str(value) not in taken:
            taken.add(str(value))
            values.append(value)
    return values


def vt_draft(rng: random.Random, length: int, params: dict, encode) -> Draft:
    num_chains, hops = int(params["num_chains"]), int(params["num_hops"])
    if num_chains < 1 or hops < 1:
        raise KvbenchError(f"task.vt: num_chains={num_chains} and num_hops={hops} must both be at least 1")
    taken: set[str] = set()
    variables = [fresh_variable(rng, 5, taken) for _ in range(num_chains * (hops + 1))]
    values = fresh_values(rng, num_chains, taken)
    example = solved_example(rng, num_chains, hops, taken, encode)
    return Draft(
        template=example + "\n\n" + TEMPLATE.format(context=CONTEXT, query=values[0]),
        answer_prefix=ANSWER_PREFIX.format(num_v=hops + 1, query=values[0]),
        answers=variables[: hops + 1],
        layout=partial(noise_with_chains, chains_of(variables, values, hops), rng.getrandbits(64)),
        min_units=hops + 1,
    )
