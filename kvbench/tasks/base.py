"""Task interface: a task turns its config into `Example`s (token ids) and scores predictions."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvbench import KvbenchError
from kvbench.config.registry import Registry
from kvbench.tasks.facts import TaskFacts

TASKS = Registry("task")
MAX_PROMPT_TOKENS = 1 << 24  # the longest prompt a task config may ask for (16M tokens), whatever the model


@dataclass(frozen=True)
class LengthRequest:
    """The longest prompt a task config asks for: `prompt` tokens from its knob `key`, + `new` generated ones."""

    key: str
    prompt: int
    new: int

    @property
    def tokens(self) -> int:
        return self.prompt + self.new


KINDS = ("generate", "stream", "workload", "external")


@dataclass
class Example:
    """One prompt, split where query-aware and context-only compression differ.

    `context_ids`: everything up to the end of the context (always compressed);
    `question_ids`: the question and generation prompt (compressed with the context when query_aware=true,
    appended uncompressed after compression when query_aware=false).
    """

    example_id: str
    context_ids: list[int]
    question_ids: list[int]
    answers: list[str]
    max_new_tokens: int
    subset: str = ""
    stop: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)  # task-specific columns (e.g. NIAH depth)
    # strings in the prompt the answer depends on (NIAH: the needle's value); kvbench.guide.diagnose locates their
    # tokens. Empty where the task does not know its evidence (LongBench, RULER's aggregation tasks)
    evidence: tuple[str, ...] = ()

    @property
    def n_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)

    def split(self, query_aware: bool) -> tuple[list[int], list[int]]:
        """(ids to prefill and compress, ids appended uncompressed afterwards)."""
        if query_aware:
            return self.context_ids + self.question_ids, []
        return self.context_ids, self.question_ids


class Task(abc.ABC):
    """Subclasses are registered with `@TASKS.register(name)` and built from conf/task/<name>.yaml."""

    name: str
    metric: str
    # task keys that select examples rather than change them (a grid of lengths, subsets): left out of config_hash,
    # so rows are reused across runs that select differently; every other key is part of the hash
    selection_keys: ClassVar[frozenset[str]] = frozenset()
    knobs: ClassVar[dict] = {}  # task.<key> → kvbench.config.rules.Rule, where the yaml default's type is not enough
    # how the runner turns an example into rows (kvbench.run.example_work dispatches on it; lm-eval's `output_type`):
    # "generate" a prompt answered by greedy decoding; "stream" a text streamed through the cache (perplexity);
    # "workload" requests sharing prefixes, run in order (kvbench.run.requests); "external" the task drives the
    # engine itself and scores what it gets (lm-eval), through `compute_rows(ctx, todo, example)`
    kind: ClassVar[str] = "generate"
    facts = TaskFacts()  # metric direction, score range, extra plots: read by the report (kvbench/tasks/facts.py)

    def __init__(self, cfg, tokenizer, seed: int, max_context: int | None = None):
        # max_context: the model's context window in tokens (prompt + generation), when the task needs it
        self.cfg, self.tokenizer, self.seed, self.max_context = cfg, tokenizer, seed, max_context

    @classmethod
    def longest_request(cls, cfg: dict) -> LengthRequest | None:
        """The longest prompt + generation the config asks for, from its length knob (`context_lengths`, a list,
        or `context_length`, `length`) and `max_new_tokens`; None where the task has no such knob."""
        new = cfg.get("max_new_tokens")
        new = new if isinstance(new, int) and not isinstance(new, bool) else 0
        for key in ("context_lengths", "context_length", "length"):
            value = cfg.get(key)
            lengths = [v for v in (value if isinstance(value, list) else [value]) if type(v) is int]
            if lengths:
                return LengthRequest(f"task.{key}", max(lengths), new)
        return None

    @classmethod
    def check_length(cls, cfg: dict, max_context: int | None = None) -> None:
        """Refuse a length no prompt should be built for: above MAX_PROMPT_TOKENS, or (given the model's context
        window `max_context`) above the model's context, before any prompt is tokenized. A streamed text may run
        past the window: that is what it measures."""
        want = cls.longest_request(cfg)
        if want is None:
            return
        if want.tokens > MAX_PROMPT_TOKENS:
            raise KvbenchError(
                f"{want.key}: {want.prompt:,} tokens is above the {MAX_PROMPT_TOKENS:,} kvbench builds a prompt of; "
                f"use lengths within the model's context"
            )
        if max_context and cls.kind != "stream" and want.tokens > max_context:
            raise KvbenchError(
                f"{want.key}: {want.prompt:,} prompt + {want.new} new tokens is more than the model's context of "
                f"{max_context:,} (max_position_embeddings); use lengths ≤ {max_context - want.new:,}"
            )

    @classmethod
    def check(cls, cfg: dict) -> None:
        """Checks of the task's config that need no tokenizer or model (run before the model loads); knob types
        and ranges come from `knobs` and the yaml defaults (kvbench.preflight.entrance), this adds the rest."""
        return  # nothing more by default: a task with cross-knob rules overrides it

    @abc.abstractmethod
    def examples(self) -> list[Example]:
        """The task's examples, in order."""

    def iter_examples(self) -> Iterator[Example]:
        """The task's examples in order, each built as it is taken: a run's `limit` builds only the first ones
        (tasks whose counts multiply — facts, samples, documents — override it; `examples` lists it)."""
        yield from self.examples()

    def data_files(self) -> list[Path]:
        """Every file whose content shapes this task's examples, whatever the selection keys pick (they are
        outside config_hash): their sha256 goes into config_hash, so an edited file is never answered with old
        rows. Tasks reading files (haystacks, LongBench's JSONL) override it."""
        return []

    def row_ids(self, example: Example) -> list[str]:
        """The `example_id`s of the rows one configuration produces for this example."""
        return [example.example_id]

    def metric_of(self, example: Example) -> str:
        """The metric's name for this example's row (tasks mixing metrics, e.g. LongBench, override it)."""
        return self.metric

    @abc.abstractmethod
    def score(self, prediction: str, example: Example) -> dict[str, float]:
        """{'score': ..., and any extra score columns}."""

    def compute_rows(self, ctx, todo: list, example: Example) -> list[dict]:
        """Kind "external" only: the rows of configurations `todo` on `example`, the task driving the engine itself
        (ctx: kvbench.rows.build.RowContext); the runner computes every other kind's rows."""
        raise KvbenchError(f"task {self.name} is of kind {self.kind!r}: its rows are the runner's to compute")


def build_task(cfg, tokenizer, seed: int, max_context: int | None = None) -> Task:
    """The task, its lengths checked against the model's context first (no prompt is built for a length that
    cannot run)."""
    from omegaconf import OmegaConf

    from kvbench.config.rules import plain

    cfg = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg  # tasks read their knobs as attributes
    cls = TASKS.get(cfg.name)
    cls.check_length(plain(cfg), max_context)
    return cls(cfg, tokenizer, seed, max_context)


def check_fits(examples: list[Example], max_context: int) -> None:
    for ex in examples:
        if ex.n_tokens + ex.max_new_tokens > max_context:
            raise KvbenchError(
                f"example {ex.example_id} needs {ex.n_tokens} prompt + {ex.max_new_tokens} new tokens, more than the "
                f"model's context of {max_context}; use shorter task lengths (e.g. task.context_lengths=[...])"
            )
