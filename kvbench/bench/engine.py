"""Prefill throughput and decode latency of the full cache at several context lengths, per dtype.

    python -m kvbench.bench engine [overrides]     # e.g. bench.dtypes=[bfloat16] 'task.context_lengths=[1024]'

On random prompts of each `task.context_lengths` (default 1K/2K/4K): the whole prompt through the model with its
own DynamicCache, then `bench.decode_tokens` greedy steps (never stopping at EOS); prefill tokens/s and decode
ms/token, the best of `bench.repeats` each, per dtype of `bench.dtypes` (default bfloat16 and float32; `dtype=X`
runs that one only), and the bf16/fp32 ratios measured in this one run (compare ratios, not absolute numbers
across runs).
"""

from __future__ import annotations

import time

import torch

from kvbench.bench.common import checked, header, lengths, load, options, random_ids

OPTIONS = {"dtypes": ["bfloat16", "float32"], "decode_tokens": 32, "repeats": 2}


def time_once(engine, ids: list[int], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token) of one prompt through the model's own cache."""
    from transformers import DynamicCache

    from kvbench.native.memory import synchronize

    device = engine.lm.device
    cache = DynamicCache()
    synchronize(device)
    start = time.perf_counter()
    logits = engine.forward(ids, list(range(len(ids))), cache)
    synchronize(device)
    prefill = time.perf_counter() - start
    token, start = int(logits[-1].argmax()), time.perf_counter()
    for step in range(decode_tokens):  # no EOS stop: always the same number of steps
        token = int(engine.forward([token], [len(ids) + step], cache)[-1].argmax())
    synchronize(device)
    return prefill, (time.perf_counter() - start) / decode_tokens


def dtype_specs(overrides: list[str], dtypes: list[str]) -> dict:
    """One checked spec per dtype (`dtype=` among the overrides: that one only)."""
    if any(o.startswith("dtype=") for o in overrides):
        spec, _ = checked(overrides, "method=full")
        return {spec.dtype: spec}
    return {dtype: checked([*overrides, f"dtype={dtype}"], "method=full")[0] for dtype in dtypes}


def measure(spec, opts: dict, results: dict) -> None:
    from kvbench.native.engine import Engine

    lm = load(spec)
    engine = Engine(lm)
    header("engine", lm)
    generator = torch.Generator().manual_seed(0)
    time_once(engine, random_ids(lm, 64, generator), 2)  # warm-up
    for length in lengths(spec):
        ids = random_ids(lm, length, generator)
        runs = [time_once(engine, ids, opts["decode_tokens"]) for _ in range(opts["repeats"])]
        prefill, decode = min(r[0] for r in runs), min(r[1] for r in runs)
        results[spec.dtype, length] = (length / prefill, 1000 * decode)
        print(
            f"{lm.name} {spec.dtype:>8} {length:>6} tokens: prefill {length / prefill:8.0f} tok/s "
            f"({prefill:6.2f} s), decode {1000 * decode:7.1f} ms/token",
            flush=True,
        )


def table(dtypes: list[str], sizes: list[int], results: dict) -> None:
    prefill = " | ".join(f"prefill tok/s {d}" for d in dtypes)
    print(f"\n| context | {prefill} | " + " | ".join(f"decode ms/token {d}" for d in dtypes) + " |")
    print("|---" * (1 + 2 * len(dtypes)) + "|")
    for length in sizes:
        cells = [f"{results[d, length][0]:.0f}" for d in dtypes] + [f"{results[d, length][1]:.1f}" for d in dtypes]
        print(f"| {length} | " + " | ".join(cells) + " |")
    if {"bfloat16", "float32"} <= set(dtypes):
        for length in sizes:
            (pb, db), (pf, df) = results["bfloat16", length], results["float32", length]
            print(f"{length}: bf16 prefill {pb / pf:.2f}× fp32 throughput; bf16 decode {df / db:.2f}× faster")


def main(overrides: list[str]) -> None:
    opts, overrides = options(overrides, OPTIONS, "engine")
    specs = dtype_specs(overrides, opts["dtypes"])  # every dtype checked before a model loads
    results: dict = {}
    for spec in specs.values():
        measure(spec, opts, results)
    table(list(specs), lengths(next(iter(specs.values()))), results)
