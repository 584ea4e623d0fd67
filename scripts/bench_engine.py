"""Prefill throughput and decode latency of a model at several context lengths, per dtype.

    python scripts/bench_engine.py [--model smollm2-135m] [--lengths 1024 2048 4096] [--dtypes bfloat16 float32]
                                   [--decode-tokens 32] [--repeats 2] [--device auto]

Prints prefill tokens/s and decode ms/token (full cache), the best of `repeats` runs each, and the bf16/fp32
ratios measured in this one run (machines here are shared: compare ratios, not absolute numbers across runs).
"""

from __future__ import annotations

import argparse
import time

import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from kvbench import conf_dir
from kvbench.engine.engine import Engine
from kvbench.engine.memory import synchronize
from kvbench.model.load import load_model

CONF = conf_dir() / "model"


def time_once(engine: Engine, ids: list[int], decode_tokens: int) -> tuple[float, float]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    results = {}
    for dtype in args.dtypes:
        lm = load_model(OmegaConf.load(CONF / f"{args.model}.yaml"), args.device, dtype)
        engine = Engine(lm)
        vocab = min(lm.config.vocab_size, len(lm.tokenizer))
        generator = torch.Generator().manual_seed(0)
        time_once(engine, torch.randint(vocab, (64,), generator=generator).tolist(), 2)  # warm-up
        for length in args.lengths:
            ids = torch.randint(vocab, (length,), generator=generator).tolist()
            runs = [time_once(engine, ids, args.decode_tokens) for _ in range(args.repeats)]
            prefill, decode = min(r[0] for r in runs), min(r[1] for r in runs)
            results[dtype, length] = (length / prefill, 1000 * decode)
            print(
                f"{args.model} {dtype:>8} {length:>6} tokens: prefill {length / prefill:8.0f} tok/s "
                f"({prefill:6.2f} s), decode {1000 * decode:7.1f} ms/token",
                flush=True,
            )
    print(
        "\n| context | "
        + " | ".join(f"prefill tok/s {d}" for d in args.dtypes)
        + " | "
        + " | ".join(f"decode ms/token {d}" for d in args.dtypes)
        + " |"
    )
    print("|---" * (1 + 2 * len(args.dtypes)) + "|")
    for length in args.lengths:
        cells = [f"{results[d, length][0]:.0f}" for d in args.dtypes] + [
            f"{results[d, length][1]:.1f}" for d in args.dtypes
        ]
        print(f"| {length} | " + " | ".join(cells) + " |")
    if {"bfloat16", "float32"} <= set(args.dtypes):
        for length in args.lengths:
            (pb, db), (pf, df) = results["bfloat16", length], results["float32", length]
            print(f"{length}: bf16 prefill {pb / pf:.2f}× fp32 throughput; bf16 decode {df / db:.2f}× faster")


if __name__ == "__main__":
    main()
