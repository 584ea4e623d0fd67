"""What attention statistics cost over the plain prefill.

    python -m kvbench.bench stats [overrides]        # e.g. dtype=float32

On the task's longest example (default NIAH 4K): the prompt's forward with no statistics, then with each method's
(H2O's column sums over every query, TOVA's last-query row, SnapKV's 32-query window) and with the default sweep's
union, interleaved, best of three; each as a ratio to the plain prefill (the issue's bound: ≤ 1.15 at 4K).
"""

from __future__ import annotations

import time

from kvbench.bench.common import checked, load, longest_prompt, machine

METHODS = ("h2o", "tova", "snapkv", "pyramidkv")
REPEATS = 3


def main(overrides: list[str]) -> None:
    from kvbench.methods import build_method, method_defaults
    from kvbench.model.attention import StatsRequest
    from kvbench.native.engine import Engine

    spec, _ = checked(overrides, "method=full")
    lm = load(spec)
    engine = Engine(lm)
    ids = longest_prompt(spec, lm)
    requests = {"plain": StatsRequest()}
    for name in METHODS:
        requests[name] = build_method(name, method_defaults(name)).stats_request()
    union = StatsRequest()
    for name in ("snapkv", "pyramidkv", "h2o", "streamingllm", "random"):
        union = union | build_method(name, method_defaults(name)).stats_request()
    requests["the default sweep's union"] = union
    best = dict.fromkeys(requests, float("inf"))
    engine.prefill(ids[:256], union)  # warm-up
    for _ in range(REPEATS):
        for label, request in requests.items():
            start = time.perf_counter()
            engine.prefill(ids, request)
            best[label] = min(best[label], time.perf_counter() - start)
    print(
        f"stats benchmark: {lm.name} {str(lm.dtype).removeprefix('torch.')} on {machine(lm.device)}; "
        f"{len(ids)}-token prefill, best of {REPEATS}"
    )
    for label, seconds in best.items():
        print(f"  {label:<28} {seconds:7.2f} s  {seconds / best['plain']:.3f}× plain")
