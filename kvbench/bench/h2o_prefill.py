"""H2O's prefill cost: the prefill with every query's attention column sums over the plain prefill, in one run.

    python -m kvbench.bench h2o_prefill [overrides]     # e.g. dtype=bfloat16 'task.context_lengths=[1024]'

Per context length (`task.context_lengths`, default 1K/2K/4K), on one random prompt, interleaved within each repeat:
the plain prefill (no statistics), the prefill recording H2O's statistics with the CPU backend's C kernel
(kvbench/kernels/cpu/csrc/softmax_column_sums.c, the default on CPU), and the same with the torch loop
(KVBENCH_NO_CPU_EXT=1). Best of `bench.repeats`; ratios to the plain prefill of this run, and over all lengths
together (Σ H2O / Σ plain). Threads: KVBENCH_THREADS. Default dtype float32.
"""

from __future__ import annotations

import os
from unittest import mock

import torch

from kvbench.bench.common import checked, header, lengths, load, options, random_ids

OPTIONS = {"repeats": 2}
PATHS = {"plain": None, "h2o, C kernel": "0", "h2o, torch loop": "1"}  # label -> KVBENCH_NO_CPU_EXT


def best_of(engine, ids: list[int], h2o, repeats: int) -> dict[str, float]:
    """Each path's best prefill seconds, the paths interleaved within each repeat."""
    from kvbench.model.attention import StatsRequest

    seconds: dict[str, list[float]] = {label: [] for label in PATHS}
    for _ in range(repeats):
        for label, no_ext in PATHS.items():
            with mock.patch.dict(os.environ, {"KVBENCH_NO_CPU_EXT": no_ext or "0"}):
                seconds[label].append(engine.prefill(ids, StatsRequest() if no_ext is None else h2o).seconds)
    return {label: min(times) for label, times in seconds.items()}


def main(overrides: list[str]) -> None:
    from kvbench.methods import build_method
    from kvbench.native.engine import Engine

    opts, overrides = options(overrides, OPTIONS, "h2o_prefill")
    spec, _ = checked(overrides, "method=h2o", "dtype=float32", "task.context_lengths=[1024,2048,4096]")
    lm = load(spec)
    engine = Engine(lm)
    h2o = build_method("h2o", {}).stats_request()
    header("h2o_prefill", lm)
    generator = torch.Generator().manual_seed(0)
    totals = dict.fromkeys(PATHS, 0.0)
    print("\n| context | plain prefill | H2O, C kernel | H2O, torch loop |\n|---|---|---|---|")
    for length in lengths(spec):
        ids = random_ids(lm, length, generator)
        engine.prefill(ids[:256], h2o)  # warm-up (and the kernel's one-time build)
        best = best_of(engine, ids, h2o, opts["repeats"])
        for label in PATHS:
            totals[label] += best[label]
        cells = [f"{best[label]:.2f} s ×{best[label] / best['plain']:.2f}" for label in PATHS]
        print(f"| {length} | " + " | ".join(cells) + " |", flush=True)
    cells = [f"{totals[label]:.2f} s ×{totals[label] / totals['plain']:.2f}" for label in PATHS]
    print("| all (Σ) | " + " | ".join(cells) + " |")
