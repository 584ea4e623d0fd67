"""Peak memory per method and prefill mode, measured in one run: shared vs inline vs inline + chunked.

    python -m kvbench.bench peak_memory [overrides]   # e.g. bench.context=8192 'grid.method=[full,snapkv,h2o]'

Options: bench.context (8192 prompt tokens), bench.chunk (1024), bench.modes ([shared,inline,chunked]),
bench.new_tokens (8), bench.cap_mib (a cap over the loaded model, MiB), bench.csv (a path for the rows). The
methods are the grid's (`grid.method`, default full, snapkv, streamingllm, h2o, pyramidkv, kivi) at `budget`
(default 0.25).

`task=ppl` streams `bench.context` tokens through a bounded cache in chunks of `bench.chunk` as task=ppl does
(kvbench.native.streaming; the budget is a fraction of the whole text), modes `shared` (every layer bounded after each
chunk's forward) and `inline` (each layer bounded right after its attention); a row's peak is its largest window's,
its delta that peak over the memory in use when the stream started (the loaded model: the bounded cache counts).

Otherwise each configuration prefills the same prompt (seeded random token ids: memory does not depend on the text)
and decodes `bench.new_tokens` greedily through the engine the runner uses; `shared` is the whole-prompt prefill then
compression (what a grid shares), `inline` compresses each layer inside the forward pass, `chunked` is inline with
`bench.chunk`-token chunks. Peak memory as kvbench.native.memory measures it: CPU peak RSS (VmHWM reset per
configuration, after malloc_trim) and its delta over the memory in use when the configuration started; CUDA max
allocated. glibc's mmap threshold is fixed at 128 KiB here (KVBENCH_MMAP_THRESHOLD, see kvbench/native/memory.py), so
freed tensors leave the resident set at once and the peak follows live memory.
"""

from __future__ import annotations

import gc
import os

import torch

from kvbench import KvbenchError
from kvbench.bench.common import checked, header, load, options, random_ids, requested

MIB = 2**20
OPTIONS = {
    "context": 8192,
    "chunk": 1024,
    "modes": ["shared", "inline", "chunked"],
    "new_tokens": 8,
    "cap_mib": None,
    "csv": None,
}
DEFAULTS = ("grid.method=[full,snapkv,streamingllm,h2o,pyramidkv,kivi]", "budget=0.25")


def measure(engine, conf, mode: str, chunk: int, ids: list[int], new_tokens: int) -> dict:
    """One configuration's prefill (shared, inline or chunked) and decode: its peak and the bytes it holds."""
    from kvbench.native import inline

    method, budget = conf.method, conf.budget
    gc.collect()
    if mode == "shared":
        prefill = engine.prefill(ids, method.stats_request())
    else:
        prefill = inline.prefill(engine, method, budget, ids, chunk if mode == "chunked" else None)
    gen = engine.generate(prefill, method, budget, [], new_tokens)
    del prefill
    return {
        "method": method.name,
        "budget": str(conf.budget_value),
        "mode": mode if mode != "chunked" else f"chunked {chunk}",
        "peak_MiB": gen.peak_mem_bytes / MIB,
        "delta_MiB": (gen.peak_mem_delta_bytes or 0) / MIB,
        "kv_MiB": gen.kv_bytes / MIB,
        "prefill_s": gen.prefill_s,
    }


def measure_stream(engine, conf, mode: str, chunk: int, ids: list[int]) -> dict:
    """task=ppl: the text streamed `chunk` tokens at a time; the peak of the stream is its largest window's."""
    from kvbench.native.streaming import stream_budget, stream_perplexity

    gc.collect()
    bound = stream_budget(conf.budget, len(ids))
    windows = stream_perplexity(engine, conf.method, bound, ids, chunk, inline=mode == "inline")
    start = windows[0].peak_mem_bytes - windows[0].peak_mem_delta_bytes  # in use when the stream started: the model
    peak = max(windows, key=lambda w: w.peak_mem_bytes)
    return {
        "method": conf.method.name,
        "budget": str(conf.budget_value),
        "mode": mode,
        "peak_MiB": peak.peak_mem_bytes / MIB,
        "delta_MiB": (peak.peak_mem_bytes - start) / MIB,  # the stream's peak over the loaded model (cache included)
        "peak_window": peak.index,
        "max_window_delta_MiB": max(w.peak_mem_delta_bytes for w in windows) / MIB,  # over each window's start
        "kv_MiB": windows[-1].kv_bytes / MIB,
        "stream_s": sum(w.seconds for w in windows),
    }


def one(engine, conf, mode: str, ids: list[int], opts: dict, stream: bool, chunk: int | None = None) -> dict:
    chunk = opts["chunk"] if chunk is None else chunk
    if stream:
        return measure_stream(engine, conf, mode, chunk, ids)
    return measure(engine, conf, mode, chunk, ids, opts["new_tokens"])


def table(rows: list[dict], confs: list, opts: dict, budget) -> None:
    import pandas as pd

    from kvbench.guide.selection import markdown

    by = {(r["method"], r["budget"], r["mode"].split()[0]): r for r in rows}
    print(f"\npeak memory over the loaded model (MiB), {opts['context']} tokens, budget {budget}")
    out = []
    for conf in confs:
        key = (conf.method.name, str(conf.budget_value))
        cells = [f"{by[(*key, m)]['delta_MiB']:.0f}" if (*key, m) in by else "" for m in opts["modes"]]
        kv = next(r["kv_MiB"] for r in rows if (r["method"], r["budget"]) == key)
        out.append([conf.method.name, *cells, f"{kv:.1f}"])
    print(markdown(pd.DataFrame(out, columns=["method", *opts["modes"], "kv_MiB"])))
    if opts["csv"]:
        pd.DataFrame(rows).to_csv(opts["csv"], index=False)


def main(overrides: list[str]) -> None:
    from kvbench.native.engine import Engine
    from kvbench.native.memory import fix_mmap_threshold, in_use

    opts, overrides = options(overrides, OPTIONS, "peak_memory")
    spec, confs = checked(overrides, *DEFAULTS)
    stream = spec.task_name == "ppl"
    if stream and not set(opts["modes"]) <= {"shared", "inline"}:
        raise KvbenchError("task=ppl streams in bench.chunk tokens: give bench.modes among [shared,inline]")
    if not set(opts["modes"]) <= {"shared", "inline", "chunked"}:
        raise KvbenchError(f"bench.modes={opts['modes']}: use shared, inline and/or chunked")
    fix_mmap_threshold(int(os.environ.setdefault("KVBENCH_MMAP_THRESHOLD", "131072")))  # peaks = live memory
    lm = load(spec)
    engine, full, confs = Engine(lm), confs[0], requested(spec, confs)  # confs[0]: the full cache
    ids = random_ids(lm, opts["context"], torch.Generator().manual_seed(0))
    for mode in opts["modes"]:  # warm-up: one-time allocations (kernels, thread pools) are not any method's
        one(engine, full, mode, ids[:256], {**opts, "new_tokens": 2}, stream, min(opts["chunk"], 128))
    what = f"streamed in chunks of {opts['chunk']} (task=ppl)" if stream else f"+ {opts['new_tokens']} new tokens"
    header("peak_memory", lm, f"{opts['context']} tokens {what}; {in_use(lm.device) / MIB:.0f} MiB with the model")
    rows = []
    for conf in confs:
        for mode in opts["modes"]:
            row = one(engine, conf, mode, ids, opts, stream)
            if opts["cap_mib"] is not None:
                row["fits_cap"] = row["delta_MiB"] <= opts["cap_mib"]
            rows.append(row)
            print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    table(rows, confs, opts, spec.budget)
