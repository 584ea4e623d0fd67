"""Each C kernel's end-to-end effect on the bundled model: one example's prefill + compression + decode with every
C kernel on, with all off (KVBENCH_NO_CPU_EXT=1), and with every kernel on but one, in one run.

    python scripts/bench_cpu_kernels.py [--model smollm2-135m] [--lengths 1024 4096] [--dtypes float32 bfloat16]
                                        [--decode-tokens 24] [--repeats 2] [--clock wall|cpu] [--workloads ...]

Per dtype and context, one random prompt, and per workload the kernels it is here to measure: the full cache (the
decode step's kernels), SnapKV (its window's column sums, compression's gather), H2O (per-step eviction: column sums
over all queries, compaction in place), KIVI-4 (quantization, decode attention on the packed groups), each with its
default knobs, budget 0.5; and the default sweep's grid (snapkv, h2o, streamingllm, pyramidkv × 0.25, 0.5) on one
shared prefill, decoded as the runner's grid_batch=auto does (one batch where rows come out as alone, else one by
one). "−kernel": that one kernel's loader answers None, as where it did not build. Paths interleaved within each
repeat, the best of `repeats` per figure; ratios to "on" of this run. A path that cannot change the prompt's forward
pass reuses that repeat's "on" prefill (and its time). 24 decode tokens: NIAH's max_new_tokens; decoding never
stops at EOS.

--clock cpu: the process's CPU time instead of wall time, with KVBENCH_THREADS=1 — on a machine shared with other
work, a single-threaded run's CPU time is what the work costs whatever else runs (wall time is not, nor are several
threads' barriers).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import operator
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from omegaconf import OmegaConf

from kvbench import conf_dir
from kvbench.engine.engine import Engine
from kvbench.engine.grid_decode import generate_grid
from kvbench.kernels.cpu import build, column_sums
from kvbench.methods import Budget, Method, build_method
from kvbench.model.load import LoadedModel, load_model
from kvbench.run.config_hash import grid_rows_as_alone
from kvbench.store.results import device_name

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


def path_context(path: str):
    """ "on": every kernel; "off": KVBENCH_NO_CPU_EXT=1; "−name": all but that kernel (its loader answers None)."""
    if path == "on":
        return contextlib.nullcontext()
    if path == "off":
        return mock.patch.dict(os.environ, {"KVBENCH_NO_CPU_EXT": "1"})
    if path == "−bf16 dot products":  # bf16 column sums widened for sgemm instead
        return mock.patch.object(column_sums, "_causal_column_sums_bf16", lambda *a: False)
    name, load = path.removeprefix("−"), build.load
    return mock.patch.object(build, "load", lambda kernel: None if kernel == name else load(kernel))


@dataclass
class Bench:
    lm: LoadedModel
    engine: Engine
    clock_kind: str  # "wall" | "cpu"

    def clock(self) -> float:
        return time.process_time() if self.clock_kind == "cpu" else time.perf_counter()

    @functools.cached_property
    def grid(self) -> list[tuple[Method, Budget]]:
        return [(build_method(name, {}), Budget.parse(budget)) for name, budget in GRID]

    def example(self, ids: list[int], workload: str, path: str, prefills: dict, n_decode: int) -> tuple[float, float]:
        """(prefill + compression seconds, decode ms/token) of one example on `path`; for the grid, the prefill's
        seconds and the whole grid's compression + decode in ms per decode step."""
        name, budget, _ = WORKLOADS[workload]
        method = build_method(name, {}) if name else None
        requests = [method.stats_request()] if method else [m.stats_request() for m, _ in self.grid]
        request = functools.reduce(operator.or_, requests)
        key = (request, path if path in PROMPT_PATHS else "on")
        with path_context(path):
            if key not in prefills:
                start = self.clock()
                prefills[key] = (self.engine.prefill(ids, request), self.clock() - start)
            prefill, prefill_s = prefills[key]
            start = self.clock()
            if method is None:  # the grid, as the runner decodes it with grid_batch=auto
                if grid_rows_as_alone(self.lm):
                    gens = generate_grid(self.engine, prefill, self.grid, [], n_decode + 1)
                else:
                    gens = [self.engine.generate(prefill, m, b, [], n_decode + 1) for m, b in self.grid]
                assert all(gen.decode_steps == n_decode for gen in gens)
                return prefill_s, 1000 * (self.clock() - start) / n_decode
            compressed = self.engine.compressed(prefill, method, Budget.parse(budget) if budget else None, [])
            middle = self.clock()
            gen = self.engine.decode(compressed, method, n_decode + 1)
            end = self.clock()
        assert gen.decode_steps == n_decode
        return prefill_s + middle - start, 1000 * (end - middle) / n_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = parser.parse_args()
    if args.clock == "cpu":
        os.environ["KVBENCH_THREADS"] = "1"  # read by load_model
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"{uptime}\navx512_bf16: {'yes' if 'avx512_bf16' in cpuinfo else 'no'}; clock: {args.clock}")
    table = []
    for dtype in args.dtypes:
        lm = load_model(OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml"), "cpu", dtype)
        bench = Bench(lm, Engine(lm), args.clock)
        bench.engine.eos_ids = set()  # always the same number of decode steps
        print(f"\n{args.model} {dtype} on {device_name(lm.device)}, {torch.get_num_threads()} torch thread(s)")
        vocab = min(lm.config.vocab_size, len(lm.tokenizer))
        generator = torch.Generator().manual_seed(0)
        for workload in args.workloads:  # warm-up, every kernel on: builds, one-time checks, allocator
            bench.example(torch.randint(vocab, (256,), generator=generator).tolist(), workload, "on", {}, 2)
        for length in args.lengths:
            ids = torch.randint(vocab, (length,), generator=generator).tolist()
            runs = [(w, p) for w in args.workloads for p in ["on", "off", *(f"−{k}" for k in WORKLOADS[w][2])]]
            runs = [(w, p) for w, p in runs if dtype == "bfloat16" or p not in BF16_ONLY]
            times: dict[tuple[str, str], list[tuple[float, float]]] = {run: [] for run in runs}
            for _ in range(args.repeats):
                prefills: dict = {}  # one prompt forward per request and prompt path, this repeat
                for workload, path in runs:
                    times[workload, path].append(bench.example(ids, workload, path, prefills, args.decode_tokens))
                del prefills
            for workload, path in runs:
                prefill, decode = (min(t[i] for t in times[workload, path]) for i in (0, 1))
                on_prefill, on_decode = (min(t[i] for t in times[workload, "on"]) for i in (0, 1))
                total = prefill + decode * args.decode_tokens / 1000
                ratio = total / (on_prefill + on_decode * args.decode_tokens / 1000)
                table.append((dtype, length, workload, path, prefill, decode, total, ratio))
                print(
                    f"  {length:>5} {workload:<10} {path:<24} prefill+compress {prefill:6.2f} s  decode "
                    f"{decode:6.1f} ms/token  example {total:6.2f} s  ×{ratio:.3f}",
                    flush=True,
                )
    print(f"\n{args.clock} time, {args.decode_tokens} decode tokens an example, best of {args.repeats}")
    print("| dtype | context | workload | kernels | prefill + compress s | decode ms/token | example s | vs on |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, length, workload, path, prefill, decode, total, ratio in table:
        cells = f"{prefill:.2f} | {decode:.1f} | {total:.2f} | ×{ratio:.3f}"
        print(f"| {dtype} | {length} | {workload} | {path} | {cells} |")
    print(f"\n{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
