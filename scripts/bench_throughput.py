"""Throughput sweep, the measured counterpart of `python -m kvbench.plan`: for each configuration at a fixed context,
the largest batch whose decode fits a memory limit and its decode tokens/s, beside the planner's prediction
(kv_bytes exactly; peak memory; largest batch; decode ms/step vs the roofline bound).

    python scripts/bench_throughput.py --context 4096 --memory-limit-gb 4 \
        --methods full snapkv:0.25 kivi streamingllm:0.25 --lock /tmp/kvbench-bench.lock
    python scripts/bench_throughput.py --context 512 --memory-limit-gb 1 --new-tokens 8

Serving model: a request is prefilled alone and compressed; the batch then decodes together. So a batch of B fits
when weights + (what decoding B compressed requests adds to the process's peak memory) + (what prefilling and
compressing one more request adds, measured once) ≤ the limit. Memory is measured: CUDA max allocated, or on a CPU
the peak RSS above the RSS before (after returning freed memory to the OS). Every row of a batch decodes the same
`--context`-token prompt: it is prefilled once and its K/V and statistics are broadcast to the B rows as stride-0
views, so compression runs on the batch and every row's compressed cache and decode state are real tensors of
their own (decode time and memory do not depend on which tokens a row holds). EOS is ignored: every row decodes
`--new-tokens` tokens.

Search per configuration: batch 1, then the limit divided by batch 1's measured bytes per request (at most the
planner's largest batch, weights + KV alone ≤ limit); then the limit divided by the last batch's measured bytes per
request, bisected into the bracket (largest fit, smallest misfit); at most --max-tries batches. On a CPU, decode of
a 135M model is dominated by per-step overhead (framework, 30 layers of small kernels), not by bytes:
`overhead_ms` = measured decode ms/step minus the roofline bound (hardware preset `--hardware`, `cpu` = calibrated
here), reported, not fitted away. Writes --out (one row per measured batch) and, beside it, `<out>_summary.csv` and
`predicted_vs_measured.csv` (the report's "Predicted vs measured" section reads the latter from a results dir).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import sys
from pathlib import Path

import pandas as pd
import torch

from kvbench.engine.batched import decode_together, prefill_batch
from kvbench.engine.engine import Engine, Prefill
from kvbench.engine.memory import read_peak, reset_peak
from kvbench.methods import Budget, build_method, method_defaults
from kvbench.model.attention import StatsRecorder
from kvbench.model.cache import cache_nbytes
from kvbench.model.kv_bytes import KVShape, predict_kv_bytes
from kvbench.model.load import load_model
from kvbench.plan.hardware import GIB, build_hardware
from kvbench.plan.model import arch_of, max_batch, plan_point
from kvbench.store.results import write_csv


def configuration(spec: str):
    """`name`, `name:budget` or `name:budget:knob=value,...` → (spec, method, budget)."""
    name, _, rest = spec.partition(":")
    budget, _, knobs = rest.partition(":")
    params = dict(method_defaults(name))
    for item in filter(None, knobs.split(",")):
        key, value = item.split("=")
        params[key] = int(value) if value.isdigit() else value
    method = build_method(name, params)
    return spec, method, (Budget.parse(budget) if method.caps.has_budget and budget else None)


def prompt_of(lm, context: int) -> list[int]:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    ids = lm.tokenizer(text)["input_ids"]
    while len(ids) < context:
        ids = ids + ids
    return ids[:context]


def broadcast(prefill: Prefill, batch: int) -> Prefill:
    """The one-row prefill as `batch` rows: stride-0 views of its K/V (B, H_kv, T, D), statistics and logits."""
    stats = StatsRecorder(prefill.stats.request)
    windows = prefill.stats.window.items()
    stats.window = {w: {layer: t.expand(batch, *t.shape[1:]) for layer, t in d.items()} for w, d in windows}
    stats.all_queries = {layer: t.expand(batch, *t.shape[1:]) for layer, t in prefill.stats.all_queries.items()}
    kv = [(k.expand(batch, *k.shape[1:]), v.expand(batch, *v.shape[1:])) for k, v in prefill.kv]
    logits = prefill.last_logits.expand(batch, -1)  # (B, V)
    return Prefill(kv, stats, logits, prefill.seconds, prefill.peak_mem_bytes)


def settle(device: torch.device) -> int:
    """Free what is garbage, reset the peak; the memory in use now (freed heap given back to the OS first)."""
    gc.collect()
    return reset_peak(device)


@contextlib.contextmanager
def bench_lock(path: str | None):
    """Hold `path` (flock) while measuring, so other benchmarks on a shared machine never run at the same time."""
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--hardware", default="cpu", help="conf/hardware preset for the prediction")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=["full", "snapkv:0.25", "kivi", "streamingllm:0.25"])
    parser.add_argument("--memory-limit-gb", type=float, default=None, help="GiB; default: the device's memory")
    parser.add_argument("--max-batch", type=int, default=512, help="never try a larger batch")
    parser.add_argument("--max-tries", type=int, default=6, help="batches measured per configuration, batch 1 incl.")
    parser.add_argument("--lock", default=None, help="flock this file around each configuration's measurements")
    parser.add_argument("--out", default="results/throughput.csv")
    args = parser.parse_args(argv)

    from omegaconf import OmegaConf

    from kvbench import conf_dir

    model_cfg = OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml")
    hw = build_hardware(OmegaConf.load(conf_dir() / "hardware" / f"{args.hardware}.yaml"))
    lm = load_model(model_cfg, args.device, args.dtype)
    arch, device = arch_of(model_cfg), lm.device
    limit = int(args.memory_limit_gb * GIB) if args.memory_limit_gb else hw.memory_bytes
    engine = Engine(lm)
    engine.eos_ids = set()  # every row decodes --new-tokens tokens (this engine is the script's own)
    shape = KVShape(lm.n_layers, lm.n_kv_heads, lm.head_dim, lm.dtype)
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    prompt = prompt_of(lm, args.context)
    rows, summary = [], []

    def measure(spec: str, method, budget, one: Prefill, prefill_added: int, batch: int, predicted: int) -> dict:
        """Compress `batch` rows of the one prefill, decode them together; memory, speed and the prediction."""
        before = settle(device)
        rows_prefill = broadcast(one, batch)
        hooks = method.begin(rows_prefill.n_tokens, len(rows_prefill.kv), budget)  # the rows' compression
        cache = hooks.run(rows_prefill.kv, rows_prefill.stats)
        del rows_prefill
        done = decode_together(
            engine,
            cache,
            one.last_logits.expand(batch, -1),  # (B, V)
            args.context,
            positions=lambda p, n: torch.full((n, 1), hooks.position(p, cache), device=device),  # (B, 1)
            request=lambda live: hooks.decode_request(),
            after_step=lambda stats, live: hooks.on_decode_step(cache, stats),
            row_bytes=lambda row: cache_nbytes(cache) // batch,
            max_new_tokens=args.new_tokens,
        )
        cache = None  # freed before the next measurement (the lambdas above close over the name)
        added = max(0, done.peak - before)
        tokens = args.context + args.new_tokens - 1
        bound = plan_point(arch, hw, method, budget, lm.dtype, tokens, batch, 0.0, limits=False)["decode_s_bound"]
        steps = done.steps[0]
        step_ms = 1000 * done.decode_s / max(1, steps)
        row = {
            "config": spec,
            "context": args.context,
            "batch": batch,
            "fits": weights + added + prefill_added <= limit,
            "kv_bytes_measured": sum(done.nbytes),
            "kv_bytes_predicted": batch * predict_kv_bytes(method, budget, shape, args.context, 0, steps).kv_bytes,
            "decode_added_bytes": added,
            "prefill_one_added_bytes": prefill_added,
            "weights_bytes": weights,
            "limit_bytes": limit,
            "decode_tokens_per_s": done.tokens_per_s,
            "decode_ms_per_step": step_ms,
            "decode_ms_bound": 1000 * bound,
            "overhead_ms": step_ms - 1000 * bound,
            "prefill_s": one.seconds,
            "predicted_max_batch": predicted,
        }
        rows.append(row)
        print(pd.DataFrame([row]).to_string(index=False, header=len(rows) == 1), flush=True)
        return row

    def largest_batch(spec: str, method, budget) -> dict:
        """Batch 1, then guesses from the planner and the measured bytes per request, bisected."""
        kv_request = predict_kv_bytes(method, budget, shape, args.context, 0, args.new_tokens - 1).kv_bytes
        predicted = min(max_batch(weights, kv_request, limit), args.max_batch)
        before = settle(device)  # one request: prefill + compression, what admitting it adds
        one = prefill_batch(engine, [prompt], method.stats_request())
        method.bind(lm)
        method.compress(one.kv, one.stats, budget)
        prefill_added = max(0, read_peak(device) - before)

        def estimate(row: dict, batch: int) -> int:
            """The batch the limit holds at `row`'s measured decode bytes per request."""
            return (limit - weights - prefill_added) // max(1, row["decode_added_bytes"] // batch)

        first = measure(spec, method, budget, one, prefill_added, 1, predicted)
        lo, hi = (1, None) if first["fits"] else (0, 1)
        # batch 1's measured bytes: the first guess (≤ the planner's); at least 2, the next batch up
        guess, tries = min(predicted, max(2, estimate(first, 1))), 1
        while hi != lo + 1 and tries < args.max_tries and lo > 0 and guess > lo:
            row = measure(spec, method, budget, one, prefill_added, guess, predicted)
            tries += 1
            if row["fits"]:
                lo = guess
                if guess >= predicted:  # the KV alone would not fit one more: nothing larger can fit
                    hi = guess + 1 if guess < args.max_batch else None
                    break
            else:
                hi = guess
            fits = estimate(row, guess)
            guess = fits if lo < fits < (hi or fits + 1) else (lo + (hi or 2 * lo)) // 2
            guess = min(guess, predicted)
        best = next((r for r in reversed(rows) if r["config"] == spec and r["batch"] == lo), None)
        nan = float("nan")
        return {
            "config": spec,
            "context": args.context,
            "largest_batch": lo,
            "smallest_misfit": hi,
            "predicted_max_batch": predicted,
            "tokens_per_s": best["decode_tokens_per_s"] if best else nan,
            "tokens_per_s_batch1": first["decode_tokens_per_s"],
            "decode_ms_per_step": best["decode_ms_per_step"] if best else nan,
            "decode_ms_bound": best["decode_ms_bound"] if best else nan,
            "overhead_ms": best["overhead_ms"] if best else nan,
            "kv_bytes_per_request_measured": first["kv_bytes_measured"],
            "kv_bytes_per_request_predicted": kv_request,
            "decode_added_per_request": best["decode_added_bytes"] / lo if best else nan,
            "prefill_one_added_bytes": prefill_added,
            "weights_bytes": weights,
            "limit_bytes": limit,
        }

    for spec, method, budget in map(configuration, args.methods):
        with bench_lock(args.lock):  # released between configurations: others' benchmarks run in between
            summary.append(largest_batch(spec, method, budget))
    frame, table = pd.DataFrame(rows), pd.DataFrame(summary)
    full_rate = table.set_index("config")["tokens_per_s"].get("full", float("nan"))
    table["vs_full"] = table["tokens_per_s"] / full_rate
    table["kv_bytes_exact"] = [
        bool((g.kv_bytes_measured == g.kv_bytes_predicted).all()) for _, g in frame.groupby("config", sort=False)
    ]
    out = Path(args.out)
    write_csv(frame, out)
    write_csv(table, out.with_name(out.stem + "_summary.csv"))
    write_csv(predicted_vs_measured(table, lm.name, hw.name), out.with_name("predicted_vs_measured.csv"))
    print(
        f"\n{lm.name} ({lm.dtype}) on {hw.name}, context {args.context}, limit {limit / GIB:.2f} GiB, "
        f"{args.new_tokens} new tokens; ratios measured in this one run"
    )
    shown = table.drop(columns=["context", "weights_bytes", "limit_bytes"])
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"rows: {out}")
    return 0


def predicted_vs_measured(table: pd.DataFrame, model: str, hardware: str) -> pd.DataFrame:
    """Long format for the report (kvbench.report.sections.predicted): one row per configuration × quantity."""
    out = []
    for r in table.to_dict("records"):
        for quantity, predicted, measured, unit in [
            ("kv_bytes per request", r["kv_bytes_per_request_predicted"], r["kv_bytes_per_request_measured"], "B"),
            ("memory per request in decode", r["kv_bytes_per_request_predicted"], r["decode_added_per_request"], "B"),
            ("largest batch within the limit", r["predicted_max_batch"], r["largest_batch"], "requests"),
            ("decode ms per step at that batch", r["decode_ms_bound"], r["decode_ms_per_step"], "ms"),
        ]:
            out.append(
                {
                    "model": model,
                    "hardware": hardware,
                    "config": r["config"],
                    "context": r["context"],
                    "limit_bytes": r["limit_bytes"],
                    "quantity": quantity,
                    "predicted": predicted,
                    "measured": measured,
                    "unit": unit,
                }
            )
    return pd.DataFrame(out)


if __name__ == "__main__":
    sys.exit(main())
