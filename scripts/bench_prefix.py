"""Prefix caching on the bundled model: TTFT and bytes held with vs without it, measured in one process.

    python scripts/bench_prefix.py                      # shared_doc, shared_doc_qa (20 questions), multiturn (10 turns)
    python scripts/bench_prefix.py --workloads shared_doc_qa --questions 5 --context 1024

For each workload it runs the full cache over the same requests without, then with, the prefix cache, and prints
the total time to first token (Σ prefill_s), the bytes held after the last request (held_bytes: the store's pages
once + every request's own cache, as if all stayed resident) and whether every output is the same token string.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from kvbench.run.runner import run

CONF = Path(__file__).resolve().parent.parent / "conf"
WORKLOADS = ("shared_doc", "shared_doc_qa", "multiturn")


def rows(tmp: Path, name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp / 'store'}", "report=false", "method=full", *overrides])
    return run(cfg, output_dir=tmp / name)


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--context", type=int, default=2048, help="shared_doc's and shared_doc_qa's document tokens")
    parser.add_argument("--chat-context", type=int, default=1024, help="multiturn's document tokens")
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=12, help="a 7-digit answer is ~9 tokens")
    parser.add_argument("--qa-max-new-tokens", type=int, default=64, help="shared_doc_qa's (LongBench's 64)")
    args = parser.parse_args(argv)
    import pandas as pd

    with tempfile.TemporaryDirectory() as tmp:
        model = f"model={args.model}"
        tasks = {
            "shared_doc": [f"task.max_new_tokens={args.max_new_tokens}", f"task.questions={args.questions}"],
            "shared_doc_qa": [f"task.max_new_tokens={args.qa_max_new_tokens}", f"task.questions={args.questions}"],
            "multiturn": [f"task.max_new_tokens={args.max_new_tokens}", f"task.turns={args.turns}"],
        }
        lengths = {"shared_doc": args.context, "shared_doc_qa": args.context, "multiturn": args.chat_context}
        table = pd.DataFrame(
            [
                compare(Path(tmp), w, [model, f"task={w}", f"task.context_length={lengths[w]}", *tasks[w]])
                for w in args.workloads
            ]
        )
    print()
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0 if table.identical.all() else 1


if __name__ == "__main__":
    sys.exit(main())
