"""Each C kernel's end-to-end effect on the model: one example's prefill + compression + decode with every C kernel
on, with all off (KVBENCH_NO_CPU_EXT=1), and with every kernel on but one, in one run.

    python -m kvbench.bench cpu_kernels [overrides]   # e.g. bench.dtypes=[float32] bench.clock=cpu

Per dtype (`bench.dtypes`, default float32 and bfloat16; `dtype=X`: that one) and context (`task.context_lengths`,
default 1K and 4K), one random prompt, and per workload (`bench.workloads`) the kernels it is here to measure: the
full cache (the decode step's kernels), SnapKV (its window's column sums, compression's gather), H2O (per-step
eviction: column sums over all queries, compaction in place), KIVI-4 (quantization, decode attention on the packed
groups), each with its default knobs, budget 0.5; and the default sweep's grid (snapkv, h2o, streamingllm,
pyramidkv × 0.25, 0.5) on one shared prefill, decoded as the runner's grid_batch=auto does. "−kernel": that one
kernel's loader answers None, as where it did not build (patched by name: the CPU backend, kvbench.kernels.cpu, is
optional; without it this benchmark refuses). Paths interleaved within each repeat, the best of `bench.repeats` per
figure; ratios to "on" of this run. A path that cannot change the prompt's forward pass reuses that repeat's "on"
prefill. `bench.decode_tokens` (24: NIAH's max_new_tokens); decoding never stops at EOS.

bench.clock=cpu: the process's CPU time instead of wall time, with KVBENCH_THREADS=1 — on a machine shared with other
work, a single-threaded run's CPU time is what the work costs whatever else runs.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import subprocess
import time
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from kvbench import KvbenchError
from kvbench.bench.common import checked, header, lengths, load, options, random_ids

WORKLOADS = {  # label -> (method, budget, the kernels it is here to measure)
    "full": ("full", None, ["decode_linear", "decode_attention"]),
    "snapkv 0.5": ("snapkv", 0.5, ["softmax_column_sums", "compact_tokens"]),
    "h2o 0.5": ("h2o", 0.5, ["softmax_column_sums", "bf16 dot products", "compact_tokens"]),
    "kivi-4": ("kivi", None, ["kivi_decode_attention"]),
    "grid": (None, None, ["decode_linear", "decode_attention", "compact_tokens"]),
}
GRID = [(name, budget) for name in ("snapkv", "h2o", "streamingllm", "pyramidkv") for budget in (0.25, 0.5)]
PROMPT_PATHS = {"off", "−softmax_column_sums", "−bf16 dot products"}  # change the prompt's pass
BF16_ONLY = {"−bf16 dot products"}
OPTIONS = {
    "dtypes": ["float32", "bfloat16"],
    "decode_tokens": 24,
    "repeats": 2,
    "clock": "wall",
    "workloads": list(WORKLOADS),
}
CPU = "kvbench.kernels.cpu"  # the optional backend, patched by name (kvbench.kernels.backend loads it by name too)


def path_context(path: str):
    """ "on": every kernel; "off": KVBENCH_NO_CPU_EXT=1; "−name": all but that kernel (its loader answers None)."""
    if path == "on":
        return contextlib.nullcontext()
    if path == "off":
        return mock.patch.dict(os.environ, {"KVBENCH_NO_CPU_EXT": "1"})
    if path == "−bf16 dot products":  # bf16 column sums widened for sgemm instead
        return mock.patch(f"{CPU}.column_sums._causal_column_sums_bf16", lambda *a: False)
    name, load_kernel = path.removeprefix("−"), __import__(f"{CPU}.build", fromlist=["load"]).load
    return mock.patch(f"{CPU}.build.load", lambda kernel: None if kernel == name else load_kernel(kernel))


@dataclass
class Bench:
    lm: Any
    engine: Any
    clock_kind: str  # "wall" | "cpu"

    def clock(self) -> float:
        return time.process_time() if self.clock_kind == "cpu" else time.perf_counter()

    @functools.cached_property
    def grid(self) -> list:
        from kvbench.methods import Budget, build_method

        return [(build_method(name, {}), Budget.parse(budget)) for name, budget in GRID]

    def prefilled(self, ids: list[int], method, path: str, prefills: dict):
        """The prompt's prefill with the statistics the workload asks for, once per request and prompt path."""
        requests = [method.stats_request()] if method else [m.stats_request() for m, _ in self.grid]
        key = (functools.reduce(operator.or_, requests), path if path in PROMPT_PATHS else "on")
        if key not in prefills:
            start = self.clock()
            prefills[key] = (self.engine.prefill(ids, key[0]), self.clock() - start)
        return prefills[key]

    def grid_ms(self, prefill, n_decode: int) -> float:
        """The whole grid's compression + decode in ms per decode step, as the runner decodes it (grid_batch=auto)."""
        from kvbench.native.grid_decode import generate_grid
        from kvbench.rows.config_hash import grid_rows_as_alone

        start = self.clock()
        if grid_rows_as_alone(self.lm):
            gens = generate_grid(self.engine, prefill, self.grid, [], n_decode + 1)
        else:
            gens = [self.engine.generate(prefill, m, b, [], n_decode + 1) for m, b in self.grid]
        assert all(gen.decode_steps == n_decode for gen in gens)
        return 1000 * (self.clock() - start) / n_decode

    def example(self, ids: list[int], workload: str, path: str, prefills: dict, n_decode: int) -> tuple[float, float]:
        """(prefill + compression seconds, decode ms/token) of one example on `path`; for the grid, the prefill's
        seconds and the whole grid's compression + decode in ms per decode step."""
        from kvbench.methods import Budget, build_method

        name, budget, _ = WORKLOADS[workload]
        method = build_method(name, {}) if name else None
        with path_context(path):
            prefill, prefill_s = self.prefilled(ids, method, path, prefills)
            if method is None:
                return prefill_s, self.grid_ms(prefill, n_decode)
            start = self.clock()
            compressed = self.engine.compressed(prefill, method, Budget.parse(budget) if budget else None, [])
            middle = self.clock()
            gen = self.engine.decode(compressed, method, n_decode + 1)
            end = self.clock()
        assert gen.decode_steps == n_decode
        return prefill_s + middle - start, 1000 * (end - middle) / n_decode


def one_length(bench: Bench, dtype: str, length: int, ids: list[int], opts: dict, table: list) -> None:
    """Every workload × path on one prompt, best of the repeats, printed and added to `table`."""
    runs = [(w, p) for w in opts["workloads"] for p in ["on", "off", *(f"−{k}" for k in WORKLOADS[w][2])]]
    runs = [(w, p) for w, p in runs if dtype == "bfloat16" or p not in BF16_ONLY]
    times: dict[tuple[str, str], list[tuple[float, float]]] = {run: [] for run in runs}
    n = opts["decode_tokens"]
    for _ in range(opts["repeats"]):
        prefills: dict = {}  # one prompt forward per request and prompt path, this repeat
        for workload, path in runs:
            times[workload, path].append(bench.example(ids, workload, path, prefills, n))
        del prefills
    for workload, path in runs:
        prefill, decode = (min(t[i] for t in times[workload, path]) for i in (0, 1))
        on_prefill, on_decode = (min(t[i] for t in times[workload, "on"]) for i in (0, 1))
        total = prefill + decode * n / 1000
        ratio = total / (on_prefill + on_decode * n / 1000)
        table.append((dtype, length, workload, path, prefill, decode, total, ratio))
        print(
            f"  {length:>5} {workload:<10} {path:<24} prefill+compress {prefill:6.2f} s  decode "
            f"{decode:6.1f} ms/token  example {total:6.2f} s  ×{ratio:.3f}",
            flush=True,
        )


def one_dtype(spec, opts: dict, table: list) -> None:
    from kvbench.native.engine import Engine

    lm = load(spec)
    bench = Bench(lm, Engine(lm), opts["clock"])
    bench.engine.eos_ids = set()  # always the same number of decode steps
    header("cpu_kernels", lm, f"clock: {opts['clock']}")
    generator = torch.Generator().manual_seed(0)
    for workload in opts["workloads"]:  # warm-up, every kernel on: builds, one-time checks, allocator
        bench.example(random_ids(lm, 256, generator), workload, "on", {}, 2)
    for length in lengths(spec):
        one_length(bench, spec.dtype, length, random_ids(lm, length, generator), opts, table)


def check(opts: dict, overrides: list[str]) -> list:
    """Each dtype's spec, the options checked, before a model loads."""
    from kvbench.kernels.backend import backend

    unknown = [w for w in opts["workloads"] if w not in WORKLOADS]
    if unknown or opts["clock"] not in ("wall", "cpu"):
        raise KvbenchError(
            f"bench.workloads among {list(WORKLOADS)} and bench.clock=wall|cpu, not {unknown or opts['clock']}"
        )
    if backend("cpu") is None:
        raise KvbenchError("the CPU kernels are off (KVBENCH_NO_CPU_EXT=1) or not installed: nothing to compare")
    if any(o.startswith("dtype=") for o in overrides):
        return [checked(overrides, "method=full", "device=cpu", "task.context_lengths=[1024,4096]")[0]]
    defaults = ("method=full", "device=cpu", "task.context_lengths=[1024,4096]")
    return [checked([*overrides, f"dtype={d}"], *defaults)[0] for d in opts["dtypes"]]


def main(overrides: list[str]) -> None:
    opts, overrides = options(overrides, OPTIONS, "cpu_kernels")
    specs = check(opts, overrides)
    if opts["clock"] == "cpu":
        os.environ["KVBENCH_THREADS"] = "1"  # read by load_model
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(uptime)
    table: list = []
    for spec in specs:
        one_dtype(spec, opts, table)
    print(f"\n{opts['clock']} time, {opts['decode_tokens']} decode tokens an example, best of {opts['repeats']}")
    print("| dtype | context | workload | kernels | prefill + compress s | decode ms/token | example s | vs on |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, length, workload, path, prefill, decode, total, ratio in table:
        cells = f"{prefill:.2f} | {decode:.1f} | {total:.2f} | ×{ratio:.3f}"
        print(f"| {dtype} | {length} | {workload} | {path} | {cells} |")
    print(f"\n{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
