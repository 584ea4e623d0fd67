"""A RULER sample whose haystack size is still open, and fitting it to a prompt of an exact length in tokens.

RULER grows each haystack in steps until the prompt would pass the length; here the largest haystack that fits
is found by bisection on the final tokenized prompt (chat template included), then the few tokens still missing
are taken from the start of one more haystack unit, so noise, prose and needle haystacks hit the length exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvbench import KvbenchError
from kvbench.tasks.prompts import chat_text
from kvbench.tasks.prompts import encode as encode_text

CONTEXT = "{context}"  # where the haystack goes in a template
_MARK = "\x00CONTEXT\x00"


@dataclass
class Layout:
    text: str  # the haystack with the needles, chains or words placed in it
    filler: str = ""  # one more haystack unit: its first tokens top the prompt up to the length ("" = none)
    depth: float | None = None  # where the one queried needle sits (0 = start, 1 = end), when there is one


@dataclass
class Draft:
    template: str  # the task's user turn, CONTEXT marking the haystack
    answer_prefix: str  # appended after the generation prompt so that the answer comes first (RULER's)
    answers: list[str]
    layout: Callable[[int], Layout]  # n haystack units (lines, words, list entries) -> the haystack
    min_units: int = 1
    max_units: int | None = None  # None: the haystack never runs out (repeated noise, generated needles)
    runs_out: str = ""  # what bounds max_units, for the error message
    example: tuple[str, str] | None = None  # a solved (user, assistant) turn before the task (cwe's few-shot)


def largest_fitting(smallest: int, fits: Callable[[int], bool]) -> int:
    """The largest n >= smallest with fits(n), by doubling then bisection (`smallest` when nothing fits)."""
    lo, hi = smallest, smallest + 1
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def render(tokenizer, draft: Draft) -> tuple[str, str]:
    """The prompt's text before and after the haystack: chat template, answer prefix appended."""
    user = draft.template.replace(CONTEXT, _MARK)
    turns = []
    if draft.example:
        turns = [
            {"role": "user", "content": draft.example[0]},
            {"role": "assistant", "content": draft.example[1].strip()},
        ]
    # without a chat template, RULER's "base" template: the bare task text, after a solved example on the line before
    plain = (f"{draft.example[0]}{draft.example[1]}\n" if draft.example else "") + user
    text = chat_text(tokenizer, turns + [{"role": "user", "content": user}], plain)
    head, tail = (text + draft.answer_prefix).split(_MARK)
    return head, tail


def fit(draft: Draft, tokenizer, length: int, name: str) -> tuple[list[int], list[int], Layout]:
    """(context ids, question ids, layout) of a prompt of at most `length` tokens, as close to it as the units
    allow (exactly `length` when the layout has a filler)."""

    encode = partial(encode_text, tokenizer)

    head_text, tail_text = render(tokenizer, draft)
    head, tail = encode(head_text), encode(tail_text)

    def fits(n: int) -> bool:
        if draft.max_units is not None and n > draft.max_units:
            return False
        return len(head) + len(encode(draft.layout(n).text)) + len(tail) <= length

    if not fits(draft.min_units):
        shortest = len(head) + len(encode(draft.layout(draft.min_units).text)) + len(tail)
        raise KvbenchError(
            f"task.context_lengths: {length} tokens is too short for RULER's {name} "
            f"(at least {shortest} with this tokenizer)"
        )
    n = largest_fitting(draft.min_units, fits)
    layout = draft.layout(n)
    haystack = encode(layout.text)
    gap = length - len(head) - len(haystack) - len(tail)
    if layout.filler:
        haystack += encode(layout.filler)[:gap]
    total = len(head) + len(haystack) + len(tail)
    if n == draft.max_units and total < 0.98 * length:
        raise KvbenchError(
            f"RULER's {name} runs out of {draft.runs_out} at {total} tokens, short of the {length} "
            f"asked; use shorter task.context_lengths or leave {name} out of task.tasks"
        )
    return head + haystack, tail, layout
