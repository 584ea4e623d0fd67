"""Throughput sweep, the measured counterpart of `python -m kvbench.plan`: for each configuration at a fixed context,
the largest batch whose decode fits a memory limit and its decode tokens/s, beside the planner's prediction
(kv_bytes exactly; peak memory; largest batch; decode ms/step vs the roofline bound).

    python -m kvbench.bench throughput bench.context=4096 bench.memory_limit_gb=4 bench.lock=/tmp/kvbench-bench.lock
    python -m kvbench.bench throughput bench.context=512 bench.memory_limit_gb=1 bench.new_tokens=8

The configurations are the grid's (default full + snapkv 0.25, kivi, streamingllm 0.25: `grid.method`, `grid.budget`),
labelled `name[:budget[:knob=value,...]]`. Serving model: a request is prefilled alone and compressed; the batch then
decodes together. So a batch of B fits when weights + (what decoding B compressed requests adds to the process's peak
memory) + (what prefilling and compressing one more request adds, measured once) ≤ the limit
(`bench.memory_limit_gb`, default the hardware preset's memory). Memory is measured: CUDA max allocated, or on a CPU
the peak RSS above the RSS before. Every row of a batch decodes the same `bench.context`-token prompt (README.md's
text, repeated): it is prefilled once and its K/V and statistics are broadcast to the B rows as stride-0 views, so
compression runs on the batch and every row's compressed cache and decode state are real tensors of their own. EOS is
ignored: every row decodes `bench.new_tokens` tokens.

Search per configuration: batch 1, then the limit divided by batch 1's measured bytes per request (at most the
planner's largest batch, weights + KV alone ≤ limit); then the limit divided by the last batch's measured bytes per
request, bisected into the bracket (largest fit, smallest misfit); at most `bench.max_tries` batches, none above
`bench.max_batch`. `overhead_ms` = measured decode ms/step minus the roofline bound (hardware preset
`bench.hardware`, `cpu` = calibrated here). Writes `bench.out` (one row per measured batch) and, beside it,
`<out>_summary.csv` and `predicted_vs_measured.csv` (the report's "Predicted vs measured" section reads the latter
from a results dir). `bench.lock=FILE`: flock it around each configuration's measurements.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from kvbench import KvbenchError, conf_dir
from kvbench.bench.common import checked, header, label, load, options

OPTIONS = {
    "hardware": "cpu",
    "context": 4096,
    "new_tokens": 8,
    "memory_limit_gb": None,
    "max_batch": 512,
    "max_tries": 6,
    "lock": None,
    "out": "results/throughput.csv",
}
DEFAULTS = ("grid.method=[snapkv,kivi,streamingllm]", "grid.budget=[0.25]")


def prompt_of(lm, context: int) -> list[int]:
    text = (conf_dir().parent / "README.md").read_text(encoding="utf-8")
    ids = lm.tokenizer(text)["input_ids"]
    while len(ids) < context:
        ids = ids + ids
    return ids[:context]


def broadcast(prefill, batch: int):
    """The one-row prefill as `batch` rows: stride-0 views of its K/V (B, H_kv, T, D), statistics and logits."""
    from kvbench.model.attention import StatsRecorder
    from kvbench.native.engine import Prefill

    stats = StatsRecorder(prefill.stats.request)
    windows = prefill.stats.window.items()
    stats.window = {w: {layer: t.expand(batch, *t.shape[1:]) for layer, t in d.items()} for w, d in windows}
    stats.all_queries = {layer: t.expand(batch, *t.shape[1:]) for layer, t in prefill.stats.all_queries.items()}
    kv = [(k.expand(batch, *k.shape[1:]), v.expand(batch, *v.shape[1:])) for k, v in prefill.kv]
    logits = prefill.last_logits.expand(batch, -1)  # (B, V)
    return Prefill(kv, stats, logits, prefill.seconds, prefill.peak_mem_bytes)


def settle(device: torch.device) -> int:
    """Free what is garbage, reset the peak; the memory in use now (freed heap given back to the OS first)."""
    from kvbench.native.memory import reset_peak

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


@dataclass
class Sweep:
    """What every measurement shares: the model, its engine, the planner's view of it, the limit and the prompt."""

    lm: Any
    engine: Any
    arch: Any
    hw: Any
    limit: int
    weights: int
    shape: Any
    prompt: list[int]
    opts: dict
    rows: list = field(default_factory=list)

    def decode(self, method, budget, one, batch: int):
        """Compress `batch` rows of the one prefill and decode them together."""
        from kvbench.model.cache import cache_nbytes
        from kvbench.native.batched import decode_together

        rows_prefill, device, context = broadcast(one, batch), self.lm.device, self.opts["context"]
        hooks = method.begin(rows_prefill.n_tokens, len(rows_prefill.kv), budget)  # the rows' compression
        cache = hooks.run(rows_prefill.kv, rows_prefill.stats)
        del rows_prefill
        return decode_together(
            self.engine,
            cache,
            one.last_logits.expand(batch, -1),  # (B, V)
            context,
            positions=lambda p, n: torch.full((n, 1), hooks.position(p, cache), device=device),  # (B, 1)
            request=lambda live: hooks.decode_request(),
            after_step=lambda stats, live: hooks.on_decode_step(cache, stats),
            row_bytes=lambda row: cache_nbytes(cache) // batch,
            max_new_tokens=self.opts["new_tokens"],
        )

    def measure(self, spec: str, method, budget, one, prefill_added: int, batch: int, predicted: int) -> dict:
        """Compress `batch` rows of the one prefill, decode them together; memory, speed and the prediction."""
        from kvbench.model.kv_bytes import predict_kv_bytes
        from kvbench.plan.model import plan_point

        before = settle(self.lm.device)
        done = self.decode(method, budget, one, batch)
        added, context = max(0, done.peak - before), self.opts["context"]
        tokens = context + self.opts["new_tokens"] - 1
        bound = plan_point(self.arch, self.hw, method, budget, self.lm.dtype, tokens, batch, 0.0, limits=False)
        steps = done.steps[0]
        step_ms, bound_ms = 1000 * done.decode_s / max(1, steps), 1000 * bound["decode_s_bound"]
        row = {
            "config": spec,
            "context": context,
            "batch": batch,
            "fits": self.weights + added + prefill_added <= self.limit,
            "kv_bytes_measured": sum(done.nbytes),
            "kv_bytes_predicted": batch * predict_kv_bytes(method, budget, self.shape, context, 0, steps).kv_bytes,
            "decode_added_bytes": added,
            "prefill_one_added_bytes": prefill_added,
            "weights_bytes": self.weights,
            "limit_bytes": self.limit,
            "decode_tokens_per_s": done.tokens_per_s,
            "decode_ms_per_step": step_ms,
            "decode_ms_bound": bound_ms,
            "overhead_ms": step_ms - bound_ms,
            "prefill_s": one.seconds,
            "predicted_max_batch": predicted,
        }
        self.rows.append(row)
        print(pd.DataFrame([row]).to_string(index=False, header=len(self.rows) == 1), flush=True)
        return row

    def one_request(self, method, budget):
        """One request's prefill and compression: the prefill, and what admitting it adds to the peak."""
        from kvbench.native.batched import prefill_batch
        from kvbench.native.memory import read_peak

        before = settle(self.lm.device)
        one = prefill_batch(self.engine, [self.prompt], method.stats_request())
        method.bind(self.lm)
        method.compress(one.kv, one.stats, budget)
        return one, max(0, read_peak(self.lm.device) - before)

    def search(self, spec: str, method, budget, predicted: int) -> tuple[int, int | None, dict]:
        """Batch 1, then guesses from the planner and the measured bytes per request, bisected: (largest fit,
        smallest misfit, batch 1's row)."""
        one, prefill_added = self.one_request(method, budget)

        def estimate(row: dict, batch: int) -> int:
            """The batch the limit holds at `row`'s measured decode bytes per request."""
            return (self.limit - self.weights - prefill_added) // max(1, row["decode_added_bytes"] // batch)

        first = self.measure(spec, method, budget, one, prefill_added, 1, predicted)
        lo, hi = (1, None) if first["fits"] else (0, 1)
        # batch 1's measured bytes: the first guess (≤ the planner's); at least 2, the next batch up
        guess, tries = min(predicted, max(2, estimate(first, 1))), 1
        while hi != lo + 1 and tries < self.opts["max_tries"] and lo > 0 and guess > lo:
            row = self.measure(spec, method, budget, one, prefill_added, guess, predicted)
            tries += 1
            if row["fits"]:
                lo = guess
                if guess >= predicted:  # the KV alone would not fit one more: nothing larger can fit
                    hi = guess + 1 if guess < self.opts["max_batch"] else None
                    break
            else:
                hi = guess
            fits = estimate(row, guess)
            guess = fits if lo < fits < (hi or fits + 1) else (lo + (hi or 2 * lo)) // 2
            guess = min(guess, predicted)
        return lo, hi, first

    def largest_batch(self, spec: str, method, budget) -> dict:
        """The configuration's summary row: its largest batch within the limit and what it measured there."""
        from kvbench.model.kv_bytes import predict_kv_bytes
        from kvbench.plan.model import max_batch

        context, new = self.opts["context"], self.opts["new_tokens"]
        kv_request = predict_kv_bytes(method, budget, self.shape, context, 0, new - 1).kv_bytes
        predicted = min(max_batch(self.weights, kv_request, self.limit), self.opts["max_batch"])
        lo, hi, first = self.search(spec, method, budget, predicted)
        best = next((r for r in reversed(self.rows) if r["config"] == spec and r["batch"] == lo), None)
        at = {k: best[k] if best else float("nan") for k in ("decode_ms_per_step", "decode_ms_bound", "overhead_ms")}
        return {
            "config": spec,
            "context": context,
            "largest_batch": lo,
            "smallest_misfit": hi,
            "predicted_max_batch": predicted,
            "tokens_per_s": best["decode_tokens_per_s"] if best else float("nan"),
            "tokens_per_s_batch1": first["decode_tokens_per_s"],
            **at,
            "kv_bytes_per_request_measured": first["kv_bytes_measured"],
            "kv_bytes_per_request_predicted": kv_request,
            "decode_added_per_request": best["decode_added_bytes"] / lo if best else float("nan"),
            "prefill_one_added_bytes": first["prefill_one_added_bytes"],
            "weights_bytes": self.weights,
            "limit_bytes": self.limit,
        }


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


def hardware(name: str):
    from omegaconf import OmegaConf

    from kvbench.plan.hardware import build_hardware

    path = conf_dir() / "hardware" / f"{name}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise KvbenchError(f"bench.hardware={name}: no conf/hardware/{name}.yaml; presets: {names}")
    return build_hardware(OmegaConf.load(path))


def sweep_of(spec, opts: dict) -> Sweep:
    from omegaconf import OmegaConf

    from kvbench.model.kv_bytes import KVShape
    from kvbench.native.engine import Engine
    from kvbench.plan.hardware import GIB
    from kvbench.plan.model import arch_of

    hw = hardware(opts["hardware"])
    lm = load(spec)
    limit = int(opts["memory_limit_gb"] * GIB) if opts["memory_limit_gb"] else hw.memory_bytes
    engine = Engine(lm)
    engine.eos_ids = set()  # every row decodes bench.new_tokens tokens (this engine is the benchmark's own)
    shape = KVShape(lm.n_layers, lm.n_kv_heads, lm.head_dim, lm.dtype)
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    arch = arch_of(OmegaConf.create(spec.model))
    return Sweep(lm, engine, arch, hw, limit, weights, shape, prompt_of(lm, opts["context"]), opts)


def write(sweep: Sweep, summary: list[dict]) -> None:
    from kvbench.plan.hardware import GIB
    from kvbench.store.results import write_csv

    frame, table = pd.DataFrame(sweep.rows), pd.DataFrame(summary)
    full_rate = table.set_index("config")["tokens_per_s"].get("full", float("nan"))
    table["vs_full"] = table["tokens_per_s"] / full_rate
    table["kv_bytes_exact"] = [
        bool((g.kv_bytes_measured == g.kv_bytes_predicted).all()) for _, g in frame.groupby("config", sort=False)
    ]
    out = Path(sweep.opts["out"])
    write_csv(frame, out)
    write_csv(table, out.with_name(out.stem + "_summary.csv"))
    write_csv(predicted_vs_measured(table, sweep.lm.name, sweep.hw.name), out.with_name("predicted_vs_measured.csv"))
    print(
        f"\n{sweep.lm.name} ({sweep.lm.dtype}) on {sweep.hw.name}, context {sweep.opts['context']}, limit "
        f"{sweep.limit / GIB:.2f} GiB, {sweep.opts['new_tokens']} new tokens; ratios measured in this one run"
    )
    shown = table.drop(columns=["context", "weights_bytes", "limit_bytes"])
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"rows: {out}")


def main(overrides: list[str]) -> None:
    opts, overrides = options(overrides, OPTIONS, "throughput")
    spec, confs = checked(overrides, *DEFAULTS)
    sweep = sweep_of(spec, opts)
    header("throughput", sweep.lm, f"hardware preset {sweep.hw.name}")
    summary = []
    for conf in confs:
        with bench_lock(opts["lock"]):  # released between configurations: others' benchmarks run in between
            summary.append(sweep.largest_batch(label(conf), conf.method, conf.budget))
    write(sweep, summary)
