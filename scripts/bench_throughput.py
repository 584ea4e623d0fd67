"""Throughput sweep, the measured counterpart of `python -m kvbench.plan`: batch sizes × configurations at a fixed
context, up to a memory limit; the largest batch that fits per configuration and its decode tokens/s, beside the
planner's prediction (kv_bytes exactly; peak memory; largest batch; decode ms/step vs the roofline bound).

    python scripts/bench_throughput.py --context 4096 --memory-limit-gb 4 --methods full snapkv:0.25 kivi
    python scripts/bench_throughput.py --context 512 --batches 1 2 4 8 16 --memory-limit-gb 0.5 --new-tokens 16

Memory: a batch fits when weights + what the batch adds to the process's peak memory (CUDA: max allocated;
CPU: peak RSS above the RSS before its prefill) stays within the limit; batches stop doubling once the planner
predicts weights + KV alone exceed it. Prompts are exactly `--context` tokens (rows differ); EOS is ignored so
every row decodes `--new-tokens` tokens. Rows decode together (kvbench.batched), so tokens/s is the batch's.
On a CPU, decode of a 135M model is dominated by per-step overhead (framework, 30 layers of small kernels), not
by bytes: the `overhead_ms` column is measured decode ms/step minus the roofline bound, reported, not fitted away.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import pandas as pd

from kvbench.batched import run_batch
from kvbench.engine import Engine
from kvbench.kv_bytes import KVShape, predict_kv_bytes
from kvbench.memory import read_peak, reset_peak
from kvbench.methods import Budget, build_method, method_defaults
from kvbench.models import load_model
from kvbench.plan_hardware import GIB, build_hardware
from kvbench.plan_model import arch_of, max_batch, plan_point
from kvbench.results import write_csv


def configuration(spec: str):
    """`name`, `name:budget` or `name:budget:knob=value,...` → (method, budget)."""
    name, _, rest = spec.partition(":")
    budget, _, knobs = rest.partition(":")
    params = dict(method_defaults(name))
    for item in filter(None, knobs.split(",")):
        key, value = item.split("=")
        params[key] = int(value) if value.isdigit() else value
    method = build_method(name, params)
    return spec, method, (Budget.parse(budget) if method.has_budget and budget else None)


def prompts_of(lm, context: int, n: int) -> list[list[int]]:
    text = open(Path(__file__).resolve().parent.parent / "README.md", encoding="utf-8").read()
    ids = lm.tokenizer(text)["input_ids"]
    while len(ids) < context + n * 97:
        ids = ids + ids
    return [ids[i * 97 : i * 97 + context] for i in range(n)]  # exactly `context` tokens, different rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--hardware", default="cpu", help="conf/hardware preset for the prediction")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--methods", nargs="+", default=["full", "snapkv:0.25", "kivi"])
    parser.add_argument("--memory-limit-gb", type=float, default=None, help="GiB; default: the device's memory")
    parser.add_argument("--out", default="results/throughput.csv")
    args = parser.parse_args(argv)

    from omegaconf import OmegaConf

    from kvbench import conf_dir

    model_cfg = OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml")
    hw = build_hardware(OmegaConf.load(conf_dir() / "hardware" / f"{args.hardware}.yaml"))
    lm = load_model(model_cfg, args.device, args.dtype)
    arch = arch_of(model_cfg)
    limit = int(args.memory_limit_gb * GIB) if args.memory_limit_gb else hw.memory_bytes
    engine = copy.copy(Engine(lm))
    engine.eos_ids = set()  # every row decodes --new-tokens tokens
    shape = KVShape(lm.n_layers, lm.n_kv_heads, lm.head_dim, lm.dtype)
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    rows = []
    for spec, method, budget in map(configuration, args.methods):
        for batch in args.batches:
            kv_request = predict_kv_bytes(method, budget, shape, args.context, 0, args.new_tokens - 1).kv_bytes
            if weights + batch * kv_request > limit:
                break  # the planner says it cannot fit: do not try
            prompts = prompts_of(lm, args.context, batch)
            reset_peak(lm.device)
            before = read_peak(lm.device)
            gens = run_batch(engine, method, budget, prompts, max_new_tokens=args.new_tokens)
            added = max(0, max(g.peak_mem_bytes for g in gens) - before)  # RSS freed since `before`: 0
            point = plan_point(arch, hw, method, budget, lm.dtype, args.context + args.new_tokens - 1, batch, 0.0,
                               limits=False)
            measured_ms = 1000 * gens[0].decode_s / max(1, gens[0].decode_steps)
            rows.append({
                "config": spec, "context": args.context, "batch": batch, "fits": weights + added <= limit,
                "kv_bytes_measured": sum(g.kv_bytes for g in gens), "kv_bytes_predicted": batch * kv_request,
                "peak_added_bytes": added, "weights_bytes": weights, "decode_tokens_per_s": gens[0].decode_tokens_per_s,
                "decode_ms_per_step": measured_ms, "decode_ms_bound": 1000 * point["decode_s_bound"],
                "overhead_ms": measured_ms - 1000 * point["decode_s_bound"], "prefill_s": gens[0].prefill_s,
                "predicted_max_batch": max_batch(weights, kv_request, limit),
            })
            print(pd.DataFrame(rows[-1:]).to_string(index=False, header=len(rows) == 1), flush=True)
    frame = pd.DataFrame(rows)
    write_csv(frame, Path(args.out))
    fitting = frame[frame.fits]
    best = fitting.loc[fitting.groupby("config")["batch"].idxmax()].set_index("config")
    full_rate = best.loc["full", "decode_tokens_per_s"] if "full" in best.index else float("nan")
    summary = pd.DataFrame({
        "largest_batch": best["batch"], "predicted_max_batch": best["predicted_max_batch"],
        "tokens_per_s": best["decode_tokens_per_s"], "vs_full": best["decode_tokens_per_s"] / full_rate,
        "kv_bytes_exact": (frame.groupby("config").apply(
            lambda g: bool((g.kv_bytes_measured == g.kv_bytes_predicted).all()), include_groups=False)),
    })
    print(f"\n{lm.name} on {hw.name}, context {args.context}, limit {limit / GIB:.2f} GiB "
          f"(largest batch tried: {max(args.batches)}; ratios measured in this one run)")
    print(summary.to_string(float_format=lambda v: f"{v:.2f}"))
    print(f"rows: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
