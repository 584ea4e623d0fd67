"""Peak memory per method and prefill mode, measured in one run: shared vs inline vs inline + chunked.

    flock /tmp/kvbench-bench.lock python scripts/bench_peak_memory.py [--model smollm2-135m] [--context 8192]
        [--methods full snapkv streamingllm h2o pyramidkv kivi] [--budget 0.25] [--chunk 1024]
        [--modes shared inline chunked] [--new-tokens 8] [--cap-mib N] [--csv PATH] [--task prompt|ppl]

`--task ppl` streams `context` tokens through a bounded cache in chunks of `chunk` as task=ppl does
(kvbench.engine.streaming; the budget is a fraction of the whole text), modes `shared` (every layer bounded after each
chunk's forward) and `inline` (each layer bounded right after its attention); a row's peak is its largest window's,
its delta that peak over the memory in use when the stream started (the loaded model: the bounded cache counts).

Each configuration prefills the same prompt (seeded random token ids: memory does not depend on the text) and
decodes `new-tokens` greedily through the engine the runner uses; `shared` is the whole-prompt prefill then
compression (what a grid shares), `inline` compresses each layer inside the forward pass, `chunked` is inline with
`prefill_chunk`. Peak memory as kvbench.engine.memory measures it: CPU peak RSS (VmHWM reset per configuration, after
malloc_trim) and its delta over the memory in use when the configuration started (the loaded model); CUDA max
allocated. glibc's mmap threshold is fixed at 128 KiB here (KVBENCH_MMAP_THRESHOLD, see kvbench/engine/memory.py), so
freed tensors leave the resident set at once and the peak follows live memory. With --cap-mib each row says
whether its delta fits the cap.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

os.environ.setdefault(
    "KVBENCH_MMAP_THRESHOLD", "131072"
)  # before kvbench.engine.memory is imported: peaks = live memory

import pandas as pd
import torch
from omegaconf import OmegaConf

from kvbench import conf_dir
from kvbench.engine import inline
from kvbench.engine.engine import Engine
from kvbench.engine.memory import in_use
from kvbench.engine.streaming import stream_budget, stream_perplexity
from kvbench.guide.selection import markdown
from kvbench.methods import Budget, build_method
from kvbench.model.load import load_model

MIB = 2**20


def measure(engine: Engine, name: str, budget: float, mode: str, chunk: int, ids: list[int], new_tokens: int) -> dict:
    method = build_method(name)
    value = Budget.parse(budget) if method.caps.has_budget else None
    gc.collect()
    if mode == "shared":
        prefill = engine.prefill(ids, method.stats_request())
    else:
        prefill = inline.prefill(engine, method, value, ids, chunk if mode == "chunked" else None)
    gen = engine.generate(prefill, method, value, [], new_tokens)
    del prefill
    return {
        "method": name,
        "budget": str(budget if method.caps.has_budget else 1.0),
        "mode": mode if mode != "chunked" else f"chunked {chunk}",
        "peak_MiB": gen.peak_mem_bytes / MIB,
        "delta_MiB": (gen.peak_mem_delta_bytes or 0) / MIB,
        "kv_MiB": gen.kv_bytes / MIB,
        "prefill_s": gen.prefill_s,
    }


def measure_stream(engine: Engine, name: str, budget: float, mode: str, chunk: int, ids: list[int]) -> dict:
    """task=ppl: the text streamed `chunk` tokens at a time; the peak of the stream is its largest window's."""
    method = build_method(name)
    bound = stream_budget(Budget.parse(budget), len(ids)) if method.caps.has_budget else None
    gc.collect()
    windows = stream_perplexity(engine, method, bound, ids, chunk, inline=mode == "inline")
    start = windows[0].peak_mem_bytes - windows[0].peak_mem_delta_bytes  # in use when the stream started: the model
    peak = max(windows, key=lambda w: w.peak_mem_bytes)
    return {
        "method": name,
        "budget": str(budget if method.caps.has_budget else 1.0),
        "mode": mode,
        "peak_MiB": peak.peak_mem_bytes / MIB,
        "delta_MiB": (peak.peak_mem_bytes - start) / MIB,  # the stream's peak over the loaded model (cache included)
        "peak_window": peak.index,
        "max_window_delta_MiB": max(w.peak_mem_delta_bytes for w in windows) / MIB,  # over each window's start
        "kv_MiB": windows[-1].kv_bytes / MIB,
        "stream_s": sum(w.seconds for w in windows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--methods", nargs="+", default=["full", "snapkv", "streamingllm", "h2o", "pyramidkv", "kivi"])
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--modes", nargs="+", default=["shared", "inline", "chunked"])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--cap-mib", type=float, default=None, help="a memory cap over the loaded model (MiB)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--task", choices=["prompt", "ppl"], default="prompt", help="ppl: stream the text (task=ppl)")
    args = parser.parse_args()
    if args.task == "ppl" and not set(args.modes) <= {"shared", "inline"}:
        parser.error("--task ppl streams in --chunk tokens: give --modes among shared inline")

    lm = load_model(OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml"), args.device, args.dtype)
    engine = Engine(lm)
    vocab = min(lm.config.vocab_size, len(lm.tokenizer))
    ids = torch.randint(vocab, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    for mode in args.modes:  # warm-up: one-time allocations (kernels, thread pools) are not any method's
        if args.task == "ppl":
            measure_stream(engine, "full", 1.0, mode, min(args.chunk, 128), ids[:256])
        else:
            measure(engine, "full", 1.0, mode, min(args.chunk, 128), ids[:256], 2)  # chunked: 256 ids in chunks
    loaded = in_use(lm.device)
    what = (
        f"{args.context} text tokens streamed in chunks of {args.chunk} (task=ppl)"
        if args.task == "ppl"
        else f"{args.context} prompt tokens, {args.new_tokens} new tokens"
    )
    print(
        f"{args.model} ({lm.dtype}, {lm.device}), {what}; "
        f"{loaded / MIB:.0f} MiB in use with the model loaded; threads={torch.get_num_threads()}, "
        f"KVBENCH_MMAP_THRESHOLD={os.environ.get('KVBENCH_MMAP_THRESHOLD')}",
        flush=True,
    )
    rows = []
    for name in args.methods:
        for mode in args.modes:
            if args.task == "ppl":
                row = measure_stream(engine, name, args.budget, mode, args.chunk, ids)
            else:
                row = measure(engine, name, args.budget, mode, args.chunk, ids, args.new_tokens)
            if args.cap_mib is not None:
                row["fits_cap"] = row["delta_MiB"] <= args.cap_mib
            rows.append(row)
            print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    by = {(r["method"], r["mode"].split()[0]): r for r in rows}
    print(f"\npeak memory over the loaded model (MiB), {args.context} tokens, budget {args.budget}")
    table = [
        [name]
        + [f"{by[(name, m)]['delta_MiB']:.0f}" if (name, m) in by else "" for m in args.modes]
        + [f"{next(r['kv_MiB'] for r in rows if r['method'] == name):.1f}"]
        for name in args.methods
    ]
    print(markdown(pd.DataFrame(table, columns=["method", *args.modes, "kv_MiB"])))
    if args.csv:
        pd.DataFrame(rows).to_csv(args.csv, index=False)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
