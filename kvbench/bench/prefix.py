"""Prefix caching: time to first token and bytes held with vs without it, measured in one process.

    python -m kvbench.bench prefix [overrides]        # shared_doc, shared_doc_qa (20 questions), multiturn (10 turns)
    python -m kvbench.bench prefix 'bench.workloads=[shared_doc_qa]' bench.questions=5 bench.context=1024

For each workload (`bench.workloads`) it runs the full cache over the same requests without, then with, the prefix
cache (`python -m kvbench method=full task=<workload>` with and without prefix_cache=true, a fresh store) and prints
the total time to first token (Σ prefill_s), the bytes held after the last request (held_bytes: the store's pages
once + every request's own cache, as if all stayed resident) and whether every output is the same token string
(exit 1 when one is not). Options: bench.context (shared_doc's and shared_doc_qa's document tokens, 2048),
bench.chat_context (multiturn's, 1024), bench.questions (20), bench.turns (10), bench.max_new_tokens (12: a 7-digit
answer is ~9 tokens), bench.qa_max_new_tokens (shared_doc_qa's, LongBench's 64). Other overrides (model=, dtype=,
...) go to every run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from kvbench import KvbenchError
from kvbench.bench.common import compose, options

WORKLOADS = ("shared_doc", "shared_doc_qa", "multiturn")
OPTIONS = {
    "workloads": list(WORKLOADS),
    "context": 2048,
    "chat_context": 1024,
    "questions": 20,
    "turns": 10,
    "max_new_tokens": 12,
    "qa_max_new_tokens": 64,
}


def workload_overrides(name: str, opts: dict) -> list[str]:
    tasks = {
        "shared_doc": [f"task.max_new_tokens={opts['max_new_tokens']}", f"task.questions={opts['questions']}"],
        "shared_doc_qa": [f"task.max_new_tokens={opts['qa_max_new_tokens']}", f"task.questions={opts['questions']}"],
        "multiturn": [f"task.max_new_tokens={opts['max_new_tokens']}", f"task.turns={opts['turns']}"],
    }
    length = opts["chat_context"] if name == "multiturn" else opts["context"]
    return [f"task={name}", f"task.context_length={length}", *tasks[name]]


def rows(tmp: Path, name: str, overrides: list[str]):
    from kvbench.run.runner import run

    return run(compose(overrides, f"results_dir={tmp / 'store'}", "method=full"), output_dir=tmp / name)


def compare(tmp: Path, label: str, overrides: list[str]) -> dict:
    without = rows(tmp, f"{label}-without", overrides)
    with_cache = rows(tmp, f"{label}-with", [*overrides, "prefix_cache=true"])
    return {
        "workload": label,
        "requests": len(without),
        "ttft_without_s": without.prefill_s.sum(),
        "ttft_with_s": with_cache.prefill_s.sum(),
        "ttft_ratio": with_cache.prefill_s.sum() / without.prefill_s.sum(),
        "held_without_MB": without.held_bytes.iloc[-1] / 1e6,
        "held_with_MB": with_cache.held_bytes.iloc[-1] / 1e6,
        "held_ratio": with_cache.held_bytes.iloc[-1] / without.held_bytes.iloc[-1],
        "hit_rate": with_cache.reused_tokens.sum() / (with_cache.reused_tokens + with_cache.prefill_tokens).sum(),
        "identical": list(without.prediction) == list(with_cache.prediction),
        "score": without.score.mean(),
    }


def main(overrides: list[str]) -> int:
    import pandas as pd

    from kvbench.preflight.entrance import check_run

    opts, overrides = options(overrides, OPTIONS, "prefix")
    unknown = [w for w in opts["workloads"] if w not in WORKLOADS]
    if unknown:
        raise KvbenchError(f"bench.workloads: no workload {unknown[0]!r}; choose among {', '.join(WORKLOADS)}")
    jobs = {w: [*workload_overrides(w, opts), *overrides] for w in opts["workloads"]}
    for job in jobs.values():  # every run's configuration checked before the first model loads
        check_run(compose([*job, "prefix_cache=true"], "method=full"))
    print("prefix benchmark: the full cache without and with prefix caching, same requests, one process")
    with tempfile.TemporaryDirectory() as tmp:
        table = pd.DataFrame([compare(Path(tmp), w, job) for w, job in jobs.items()])
    print()
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0 if table.identical.all() else 1
