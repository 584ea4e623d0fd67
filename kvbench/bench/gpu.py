"""Latency and memory of compression methods on a real architecture with random weights (a GPU benchmark).

    python -m kvbench.bench gpu [overrides]     # default: model=llama-3.1-8b-arch device=cuda dtype=bfloat16

Per context length (`task.context_lengths`, default 4K/16K/32K), on a random prompt: the plain prefill (no
statistics: what recording them costs), one shared prefill with the statistics every method needs, then per
configuration (the grid's: default full + snapkv, streamingllm, h2o, pyramidkv at `budget` 0.25): prefill_s (shared
prefill + compression), decode ms/token over `bench.decode_tokens` (64) greedy steps (EOS ignored), kv_bytes held at
the end, peak device memory. Random weights: the timings are real, the generated text is not. `grid.method=[kivi]`
decodes on the packed groups with the Triton kernel (kvbench/kernels/triton/kivi.py) on CUDA. `bench.out=FILE.csv`
writes the rows. Without a CUDA device `device=cuda` is refused in one line (`device=cpu` runs it on the CPU).
"""

from __future__ import annotations

import time

import pandas as pd
import torch

from kvbench.bench.common import checked, header, lengths, load, options, requested

OPTIONS = {"decode_tokens": 64, "out": None}
DEFAULTS = (
    "model=llama-3.1-8b-arch",
    "device=cuda",
    "dtype=bfloat16",
    "task.context_lengths=[4096,16384,32768]",
    "grid.method=[full,snapkv,streamingllm,h2o,pyramidkv]",
    "budget=0.25",
)


def plain_prefill(engine, ids: list[int]) -> tuple[float, int]:
    """Seconds and peak bytes of the prompt's forward without statistics."""
    from transformers import DynamicCache

    from kvbench.native.memory import read_peak, reset_peak, synchronize

    device = engine.lm.device
    reset_peak(device)
    synchronize(device)
    start = time.perf_counter()
    engine.forward(ids, list(range(len(ids))), DynamicCache())
    synchronize(device)
    return time.perf_counter() - start, read_peak(device)


def one_length(engine, length: int, ids: list[int], confs: list, request, opts: dict) -> list[dict]:
    plain_s, plain_peak = plain_prefill(engine, ids)
    prefill, rows = engine.prefill(ids, request), []
    for conf in confs:
        out = engine.generate(prefill, conf.method, conf.budget, [], opts["decode_tokens"])
        rows.append(
            dict(
                model=engine.lm.name,
                context=length,
                method=conf.method.name,
                budget=conf.budget_value,
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
            f"{length:>6} {conf.method.name:>12}: prefill {out.prefill_s:6.3f} s (plain {plain_s:.3f}, with stats "
            f"{prefill.seconds:.3f}), decode {out.decode_ms_per_token:6.2f} ms/token, kv {out.kv_bytes / 2**20:8.1f}"
            f" MiB (ratio {out.kv_ratio:.3f}), peak {out.peak_mem_bytes / 2**30:6.2f} GiB",
            flush=True,
        )
    return rows


def main(overrides: list[str]) -> None:
    from kvbench.model.attention import StatsRequest
    from kvbench.model.device import resolve_device
    from kvbench.native.engine import Engine
    from kvbench.native.graph_decode import check_setting

    opts, overrides = options(overrides, OPTIONS, "gpu")
    spec, confs = checked(overrides, *DEFAULTS)
    confs = requested(spec, confs)
    check_setting(spec.decode_graph, resolve_device(spec.device))
    start = time.perf_counter()
    lm = load(spec)
    params = sum(p.numel() for p in lm.model.parameters()) / 1e9
    header("gpu", lm, f"{params:.2f} B params, loaded in {time.perf_counter() - start:.1f} s")
    engine = Engine(lm, graphs=spec.decode_graph)  # decode_graph=true: steps replayed as a CUDA graph
    engine.eos_ids = set()  # fixed-length decodes: random weights may emit EOS anywhere
    request = StatsRequest()
    for conf in confs:
        request = request | conf.method.stats_request()
    gen = torch.Generator().manual_seed(0)
    engine.prefill(torch.randint(256, (256,), generator=gen).tolist(), request)  # warm-up (kernels, allocator)
    rows = []
    for length in lengths(spec):
        ids = torch.randint(min(lm.config.vocab_size, 32000), (length,), generator=gen).tolist()
        rows += one_length(engine, length, ids, confs, request, opts)
        if lm.device.type == "cuda":
            torch.cuda.empty_cache()
    frame = pd.DataFrame(rows)
    print(frame.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if opts["out"]:
        frame.to_csv(opts["out"], index=False)
