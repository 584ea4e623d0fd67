"""A grid decode step of B rows against one row's, and each one's share of the bandwidth bound.

    python -m kvbench.bench decode [overrides]       # e.g. dtype=float32 'task.context_lengths=[8192]'

On the task's longest example (default NIAH 4K), B copies of the full cache decode together
(kvbench.native.grid_decode; B = 1 decodes alone, as a single configuration's row does). Per B: the step time, its
ratio to one row's, the issue's target (1 + 0.1·B), the bandwidth bound's own ratio — (weights + B × one row's K/V)
over (weights + one row's K/V): what a step that only streams its bytes would cost — and the step's bandwidth share
(kvbench.native.bandwidth). A step far above the bound's ratio is overhead or compute; at it, the K/V read per row
is the cost, and only holding fewer bytes (compression) makes it cheaper. On CUDA it also prints one row's step in
steady state eager and captured as a CUDA graph (`decode_graph=true`, kvbench.native.graph_decode), each against the
bandwidth bound (weights + one row's K/V over the bandwidth).
"""

from __future__ import annotations

import time

from kvbench.bench.common import checked, load, longest_prompt, machine

ROWS = (1, 2, 4, 8, 11, 16)
STEPS = 12


def step_seconds(engine, prefill, rows: int) -> float:
    """One step of `rows` full-cache rows decoded together (alone for 1), best of two."""
    from kvbench.methods import build_method
    from kvbench.native.grid_decode import decode_grid

    full, best = build_method("full"), float("inf")
    for _ in range(2):
        starts = [engine.compressed(prefill, full, None, [], STEPS + 1) for _ in range(rows)]
        start = time.perf_counter()
        if rows == 1:
            steps = engine.decode(starts[0], full, STEPS + 1).decode_steps
        else:
            steps = decode_grid(engine, starts, STEPS + 1, ())[0].decode_steps
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def steady_step(engine, prefill) -> float:
    """One row's step in steady state: two decodes of different lengths, their time difference over their steps'
    (what a step costs once warm: a captured graph's warm-up steps and capture drop out), best of two."""
    from kvbench.methods import build_method

    full, best = build_method("full"), float("inf")
    for _ in range(2):
        gens = [
            engine.decode(engine.compressed(prefill, full, None, [], n), full, n) for n in (STEPS + 1, 4 * STEPS + 1)
        ]
        best = min(best, (gens[1].decode_s - gens[0].decode_s) / (gens[1].decode_steps - gens[0].decode_steps))
    return best


def main(overrides: list[str]) -> None:
    from kvbench.model.attention import StatsRequest
    from kvbench.native.bandwidth import memory_bandwidth
    from kvbench.native.engine import Engine

    spec, _ = checked(overrides, "method=full")
    lm = load(spec)
    engine = Engine(lm)
    prefill = engine.prefill(longest_prompt(spec, lm), StatsRequest())
    kv = engine.baselines(prefill.n_tokens)["kv_bytes_full"]
    weights, bandwidth = engine.weight_bytes, memory_bandwidth(lm.device)
    print(
        f"decode benchmark: {lm.name} {str(lm.dtype).removeprefix('torch.')} on {machine(lm.device)}; "
        f"{prefill.n_tokens} tokens: weights {weights / 1e6:.0f} MB, one row's K/V {kv / 1e6:.0f} MB; "
        f"memory bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print(f"{'rows':>4} {'ms/step':>8} {'× one row':>9} {'target':>6} {'bound':>6} {'bandwidth share':>15}")
    one = step_seconds(engine, prefill, 1)
    for rows in ROWS:
        seconds = one if rows == 1 else step_seconds(engine, prefill, rows)
        step_bytes = weights + rows * kv
        print(
            f"{rows:>4} {1000 * seconds:>8.1f} {seconds / one:>9.2f} {1 + 0.1 * rows:>6.2f} "
            f"{step_bytes / (weights + kv):>6.2f} {step_bytes / seconds / bandwidth:>15.2f}"
        )
    if lm.device.type == "cuda":  # decode_graph=true: the step captured once and replayed (native/graph_decode.py)
        bound = (weights + kv) / bandwidth  # one row's bytes at the bandwidth: the step's floor
        engines = Engine(lm), Engine(lm, graphs=True)
        for own in engines:
            own.eos_ids = set()  # fixed lengths: random weights may emit EOS anywhere
        eager, graphed = (steady_step(own, prefill) for own in engines)
        print(
            f"one row in steady state: eager {1000 * eager:.2f} ms ({eager / bound:.2f}× the bound), CUDA graph "
            f"{1000 * graphed:.2f} ms ({graphed / bound:.2f}× the bound; {eager / graphed:.2f}× faster than eager); "
            f"bound {1000 * bound:.2f} ms"
        )
