"""A request trace: prompts (a task's examples, scoreable, or random tokens of drawn lengths), output lengths and
arrival times (all at once, or a seeded Poisson process at a rate). Torch-free."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Request:
    request_id: int
    arrival_s: float  # seconds after the trace starts
    prompt_ids: list[int]  # prefilled and compressed
    suffix_ids: list[int]  # appended uncompressed after compression (query_aware=false), else empty
    max_new_tokens: int
    prefix_tokens: int = 0  # leading tokens every request of the trace shares (shared_prefix)
    example: Any = None  # the task's Example (scored), None for random prompts
    stop: tuple[str, ...] = ()

    @property
    def example_id(self) -> str:
        return self.example.example_id if self.example is not None else f"random-{self.request_id}"

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.suffix_ids)


@dataclass(frozen=True)
class TraceSpec:
    """The `serving:` keys that shape the trace (kvbench.serving.inputs checks them)."""

    requests: int
    arrival: str = "burst"  # burst: every request at t=0 | poisson: exponential gaps at `rate`
    rate: float = 1.0  # requests per second (poisson)
    prompts: str = "task"  # task: the task's examples, cycled | random: random tokens, lengths from prompt_tokens
    prompt_tokens: tuple[int, int] = (256, 512)  # prompts=random: uniform in [min, max]
    output_tokens: tuple[int, int] | None = None  # None: the task's max_new_tokens; (lo, hi): uniform per request
    shared_prefix: float = 0.0  # prompts=random: share of each prompt that is the same tokens in every request
    seed: int = 0
    extra: dict = field(default_factory=dict)


def arrivals(n: int, arrival: str, rate: float, seed: int) -> list[float]:
    """n arrival times: all 0 (burst), or a Poisson process at `rate` per second starting at 0 (seeded)."""
    if arrival == "burst":
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)  # the next gap: exponential with mean 1 / rate
    return times


def output_lengths(n: int, spec: TraceSpec, default: int) -> list[int]:
    if spec.output_tokens is None:
        return [default] * n
    lo, hi = spec.output_tokens
    rng = random.Random(spec.seed + 1)  # apart from the arrivals' stream
    return [rng.randint(lo, hi) for _ in range(n)]


def task_trace(spec: TraceSpec, examples: list, query_aware: bool) -> list[Request]:
    """Requests from a task's examples in order, cycled when the trace asks for more (scored as the task does)."""
    times = arrivals(spec.requests, spec.arrival, spec.rate, spec.seed)
    picked = [examples[i % len(examples)] for i in range(spec.requests)]
    lengths = (
        [ex.max_new_tokens for ex in picked]
        if spec.output_tokens is None
        else output_lengths(spec.requests, spec, picked[0].max_new_tokens)
    )
    out = []
    for i, (ex, t, new) in enumerate(zip(picked, times, lengths)):
        prompt, suffix = ex.split(query_aware)
        out.append(Request(i, t, list(prompt), list(suffix), new, example=ex, stop=tuple(ex.stop)))
    return out


def random_trace(spec: TraceSpec, vocab: list[int], default_new: int = 16) -> list[Request]:
    """Random token prompts of drawn lengths (no answer, no score); the first `shared_prefix` share of each prompt
    is the same tokens in every request (a system prompt). `vocab`: ids to draw from (no special tokens)."""
    rng = random.Random(spec.seed + 2)
    times = arrivals(spec.requests, spec.arrival, spec.rate, spec.seed)
    lengths = output_lengths(spec.requests, spec, default_new)
    lo, hi = spec.prompt_tokens
    prefix_len = int(spec.shared_prefix * lo)  # a share of the shortest prompt, so every prompt holds all of it
    prefix = [rng.choice(vocab) for _ in range(prefix_len)]
    out = []
    for i, (t, new) in enumerate(zip(times, lengths)):
        n = rng.randint(lo, hi)
        ids = prefix + [rng.choice(vocab) for _ in range(n - prefix_len)]
        out.append(Request(i, t, ids, [], new, prefix_tokens=prefix_len))
    return out


def shared_prefix_tokens(requests: list[Request]) -> int:
    """The longest prefix of prompt tokens every request shares (what a prefix cache could reuse)."""
    if not requests:
        return 0
    first = requests[0].prompt_ids
    n = len(first)
    for r in requests[1:]:
        k = 0
        for a, b in zip(first, r.prompt_ids):
            if a != b:
                break
            k += 1
        n = min(n, k)
    return n
