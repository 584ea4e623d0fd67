"""Decode ms/token of bounded caches against the full cache, and H2O's prefill cost, measured in one run.

    python -m kvbench.bench decode_methods [overrides]   # e.g. dtype=float32 'task.context_lengths=[1024]'

Per context length (`task.context_lengths`, default 1K and 4K), on one random prompt: the prefill time with H2O's
statistics (every query's attention column sums) over the plain prefill's, and the decode ms/token of the full cache,
StreamingLLM 0.5 and H2O 0.5 (per-step eviction, evict_every=1, the originals; and in blocks, evict_every=K with
K = `bench.evict_every`; StreamingLLM also in a ring buffer, ring=true: per-step eviction's tokens, no per-step copy)
and KIVI-4 (group_size = residual_length = `bench.kivi_group`: dequantize-then-attend, the path before packed
attention, and attention on the packed groups: by the torch version, and by the dispatcher's choice — the C kernel
on the CPU); and the full cache with torch's products and sdpa in the decode step instead of the C decode kernels.
Each figure is the best of `bench.repeats`, the configurations interleaved within each repeat; ratios are to the
full cache measured in this run. Decoding never stops at EOS. `bench.only=[kivi]`: only the rows whose label
contains one of these (full always runs).
"""

from __future__ import annotations

import os
from contextlib import ExitStack, nullcontext
from unittest import mock

import torch

from kvbench.bench.common import checked, header, lengths, load, options, random_ids

OPTIONS = {"decode_tokens": 16, "repeats": 2, "evict_every": 32, "kivi_group": 64, "only": None}
DEFAULTS = ("method=full", "dtype=bfloat16", "task.context_lengths=[1024,4096]")


def bench_rows(evict_every: int, kivi_group: int) -> list[tuple[str, str, dict, float | None, str]]:
    """(label, method, knobs, budget, KIVI attention path: kivi_path) per row; a label's "=K" is shown as
    evict_every."""
    block = {"evict_every": evict_every}
    kivi = {"bits": 4, "group_size": kivi_group, "residual_length": kivi_group}
    return [
        ("full", "full", {}, None, "packed"),
        ("full, torch products + sdpa", "full", {}, None, "torch-decode"),
        ("streamingllm 0.5, evict_every=1", "streamingllm", {"evict_every": 1}, 0.5, "packed"),
        ("streamingllm 0.5, evict_every=K", "streamingllm", block, 0.5, "packed"),
        ("streamingllm 0.5, ring", "streamingllm", {"ring": True}, 0.5, "packed"),
        ("h2o 0.5, evict_every=1", "h2o", {"evict_every": 1}, 0.5, "packed"),
        ("h2o 0.5, evict_every=K", "h2o", block, 0.5, "packed"),
        ("kivi-4, dequantize then attend", "kivi", kivi, None, "dense"),
        ("kivi-4, packed attention, torch", "kivi", kivi, None, "torch"),
        ("kivi-4, packed attention", "kivi", kivi, None, "packed"),
    ]


def kivi_path(path: str):
    """KIVI's attention on the packed groups by the dispatcher's choice (path="packed": the C kernel on the CPU), by
    the torch version (path="torch": C kernels off), or the dense path they replaced (path="dense": dequantize, then
    sdpa); path="torch-decode": the decode step's linear layers and attention by torch (nn.Linear, sdpa) instead of
    the CPU backend's decode kernels (kvbench/kernels/cpu/decode_linear.py, single_query.py; patched by name: the
    backend is optional, kvbench.kernels.backend)."""
    from kvbench.kernels.backend import backend
    from kvbench.methods.kivi import KiviLayer

    if path == "torch-decode":
        stack = ExitStack()
        for module in ("decode_linear", "single_query") if backend("cpu") is not None else ():
            stack.enter_context(mock.patch(f"kvbench.kernels.cpu.{module}.applies", lambda *a: False))
        return stack
    if path == "dense":
        return mock.patch.object(KiviLayer, "attend", lambda *a: None)  # None: the attention function's dense path
    return mock.patch.dict(os.environ, {"KVBENCH_NO_CPU_EXT": "1"}) if path == "torch" else nullcontext()


def one_length(engine, ids: list[int], rows: list, requests: dict, opts: dict) -> tuple[dict, dict]:
    """Per distinct statistics request its prefill seconds, per row its decode ms/token (lists over repeats)."""
    from kvbench.methods import Budget, build_method

    prefill_s: dict = {request: [] for request in dict.fromkeys(requests.values())}
    decode_ms: dict[str, list[float]] = {row[0]: [] for row in rows}
    for _ in range(opts["repeats"]):
        prefills = {request: engine.prefill(ids, request) for request in prefill_s}
        for request, prefill in prefills.items():
            prefill_s[request].append(prefill.seconds)
        for label, name, knobs, budget, path in rows:
            method, prefill = build_method(name, knobs), prefills[requests[label]]
            with kivi_path(path):
                new = opts["decode_tokens"] + 1
                gen = engine.generate(prefill, method, Budget.parse(budget) if budget else None, [], new)
            decode_ms[label].append(gen.decode_ms_per_token)
        del prefills
    return prefill_s, decode_ms


def report(length: int, rows: list, requests: dict, times: tuple[dict, dict], opts: dict, table: list) -> None:
    from kvbench.model.attention import StatsRequest

    prefill_s, decode_ms = times
    plain = min(prefill_s[StatsRequest()])
    h2o = next((requests[label] for label, name, *_ in rows if name == "h2o"), None)  # its ratio when an H2O row runs
    full, line, ratio = min(decode_ms["full"]), f"\n{length} tokens: prefill {plain:.2f} s plain", None
    if h2o is not None:
        ratio = min(prefill_s[h2o]) / plain
        line += f", {min(prefill_s[h2o]):.2f} s with H2O's statistics: ×{ratio:.2f}"
    print(line, flush=True)
    for label, *_ in rows:
        best = min(decode_ms[label])
        shown = label.replace("=K", f"={opts['evict_every']}")
        print(f"  {shown:<36} {best:7.1f} ms/token  ×{best / full:.2f} of full", flush=True)
        table.append((length, shown, best, best / full))
    if ratio is not None:
        table.append((length, "H2O prefill / plain prefill", ratio, None))


def main(overrides: list[str]) -> None:
    from kvbench.methods import build_method
    from kvbench.model.attention import StatsRequest
    from kvbench.native.engine import Engine

    opts, overrides = options(overrides, OPTIONS, "decode_methods")
    spec, _ = checked(overrides, *DEFAULTS)
    rows = bench_rows(opts["evict_every"], opts["kivi_group"])
    only = opts["only"] if opts["only"] is None or isinstance(opts["only"], list) else [opts["only"]]
    rows = [r for r in rows if r[0] == "full" or only is None or any(str(o) in r[0] for o in only)]
    # each row's prefill records what its method asks for; rows asking the same share one prefill per repeat
    requests = {"plain": StatsRequest()} | {label: build_method(n, k).stats_request() for label, n, k, *_ in rows}
    lm = load(spec)
    engine = Engine(lm)
    engine.eos_ids = set()  # always the same number of decode steps
    header("decode_methods", lm, "shared machine: compare ratios")
    generator = torch.Generator().manual_seed(0)
    table: list[tuple] = []
    for length in lengths(spec):
        ids = random_ids(lm, length, generator)
        report(length, rows, requests, one_length(engine, ids, rows, requests, opts), opts, table)
    print("\n| context | configuration | decode ms/token | vs full |\n|---|---|---|---|")
    for length, label, value, vs_full in table:
        if vs_full is None:
            print(f"| {length} | {label} | ×{value:.2f} (prefill time) | |")
        else:
            print(f"| {length} | {label} | {value:.1f} | ×{vs_full:.2f} |")
