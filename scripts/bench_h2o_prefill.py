"""H2O's prefill cost: the prefill with every query's attention column sums over the plain prefill, in one run.

    python scripts/bench_h2o_prefill.py [--model smollm2-135m] [--lengths 1024 2048 4096] [--dtype float32]
                                        [--repeats 2]

Per context length, on one random prompt, interleaved within each repeat: the plain prefill (no statistics), the
prefill recording H2O's statistics with the C kernel (kvbench/kernels/csrc/softmax_column_sums.c, the default on CPU), and
the same with the torch loop it replaced (KVBENCH_NO_CPU_EXT=1). Best of `repeats`; ratios to the plain prefill of
this run, and over all lengths together (Σ H2O / Σ plain: the issue's "mean on 1K–4K"). Threads: KVBENCH_THREADS.
"""

from __future__ import annotations

import argparse
import os

import torch
from omegaconf import OmegaConf

from kvbench import conf_dir
from kvbench.engine.engine import Engine
from kvbench.methods import build_method
from kvbench.model.attention import StatsRequest
from kvbench.model.load import load_model
from kvbench.store.results import device_name

PATHS = {"plain": None, "h2o, C kernel": "0", "h2o, torch loop": "1"}  # label -> KVBENCH_NO_CPU_EXT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    lm = load_model(OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml"), "cpu", args.dtype)
    engine = Engine(lm)
    h2o = build_method("h2o", {}).stats_request()
    print(f"{args.model} {args.dtype} on {device_name(lm.device)}, {torch.get_num_threads()} torch thread(s)")
    vocab = min(lm.config.vocab_size, len(lm.tokenizer))
    generator = torch.Generator().manual_seed(0)
    totals = dict.fromkeys(PATHS, 0.0)
    print("\n| context | plain prefill | H2O, C kernel | H2O, torch loop |\n|---|---|---|---|")
    for length in args.lengths:
        ids = torch.randint(vocab, (length,), generator=generator).tolist()
        engine.prefill(ids[:256], h2o)  # warm-up (and the kernel's one-time build)
        seconds: dict[str, list[float]] = {label: [] for label in PATHS}
        for _ in range(args.repeats):
            for label, no_ext in PATHS.items():
                os.environ["KVBENCH_NO_CPU_EXT"] = no_ext or "0"
                seconds[label].append(engine.prefill(ids, StatsRequest() if no_ext is None else h2o).seconds)
        best = {label: min(times) for label, times in seconds.items()}
        for label in PATHS:
            totals[label] += best[label]
        cells = [f"{best[label]:.2f} s ×{best[label] / best['plain']:.2f}" for label in PATHS]
        print(f"| {length} | " + " | ".join(cells) + " |", flush=True)
    cells = [f"{totals[label]:.2f} s ×{totals[label] / totals['plain']:.2f}" for label in PATHS]
    print("| all (Σ) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
