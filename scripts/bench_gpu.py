"""Latency and memory of compression methods on a real architecture with random weights (GPU benchmark).

    python scripts/bench_gpu.py [--model llama-3.1-8b-arch] [--lengths 4096 16384 32768]
                                [--methods full snapkv streamingllm h2o pyramidkv] [--budget 0.25]
                                [--decode-tokens 64] [--device cuda] [--out results.csv]

Per context length: one shared prefill (with the statistics every method needs), then per method: prefill_s
(shared prefill + compression), decode ms/token over a fixed number of greedy steps (EOS ignored), kv_bytes
held at the end, peak device memory. Random weights: the timings are real, the generated text is not. `kivi` in
--methods decodes on the packed groups with the Triton kernel (kvbench/kernels/triton/kivi.py) on CUDA.
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from kvbench import conf_dir
from kvbench.engine.engine import Engine
from kvbench.engine.memory import read_peak, reset_peak, synchronize
from kvbench.methods import Budget, build_method
from kvbench.model.attention import StatsRequest
from kvbench.model.load import load_model
from kvbench.run.configuration import method_config

CONF = conf_dir()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b-arch")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--methods", nargs="+", default=["full", "snapkv", "streamingllm", "h2o", "pyramidkv"])
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()

    start = time.perf_counter()
    lm = load_model(OmegaConf.load(CONF / "model" / f"{args.model}.yaml"), args.device, args.dtype)
    print(
        f"loaded {args.model} ({sum(p.numel() for p in lm.model.parameters()) / 1e9:.2f} B params) on "
        f"{lm.device} in {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    engine = Engine(lm)
    engine.eos_ids = set()  # fixed-length decodes: random weights may emit EOS anywhere
    methods = [build_method(n, {k: v for k, v in method_config(n).items() if k != "name"}) for n in args.methods]
    request = StatsRequest()
    for m in methods:
        request = request | m.stats_request()
    gen = torch.Generator().manual_seed(0)
    engine.prefill(torch.randint(256, (256,), generator=gen).tolist(), request)  # warm-up (kernels, allocator)

    rows = []
    for length in args.lengths:
        ids = torch.randint(min(lm.config.vocab_size, 32000), (length,), generator=gen).tolist()
        plain = DynamicCache()  # prefill without statistics, to show what recording them costs
        reset_peak(lm.device)
        synchronize(lm.device)
        t0 = time.perf_counter()
        engine.forward(ids, list(range(length)), plain)
        synchronize(lm.device)
        plain_s, plain_peak = time.perf_counter() - t0, read_peak(lm.device)
        del plain
        prefill = engine.prefill(ids, request)
        for method in methods:
            budget = Budget.parse(args.budget) if method.caps.has_budget else None
            out = engine.generate(prefill, method, budget, [], args.decode_tokens)
            rows.append(
                dict(
                    model=args.model,
                    context=length,
                    method=method.name,
                    budget=budget.value if budget else 1.0,
                    prefill_plain_s=plain_s,
                    prefill_with_stats_s=prefill.seconds,
                    prefill_s=out.prefill_s,
                    decode_ms_per_token=out.decode_ms_per_token,
                    kv_bytes=out.kv_bytes,
                    kv_ratio=out.kv_ratio,
                    peak_mem_gib=out.peak_mem_bytes / 2**30,
                    plain_prefill_peak_gib=plain_peak / 2**30,
                )
            )
            print(
                f"{length:>6} {method.name:>12}: prefill {out.prefill_s:6.3f} s (plain {plain_s:.3f}, with stats "
                f"{prefill.seconds:.3f}), decode {out.decode_ms_per_token:6.2f} ms/token, kv {out.kv_bytes / 2**20:8.1f}"
                f" MiB (ratio {out.kv_ratio:.3f}), peak {out.peak_mem_bytes / 2**30:6.2f} GiB",
                flush=True,
            )
        del prefill
        torch.cuda.empty_cache() if lm.device.type == "cuda" else None
    frame = pd.DataFrame(rows)
    print(frame.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if args.out:
        frame.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
