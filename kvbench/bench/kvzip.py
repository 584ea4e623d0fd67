"""KVzip's compression time on a real model: the reconstruction forward and its attention scores, with the
attention products in the model's dtype (what methods/kvzip.py does) and in fp32 (the variant it replaced), and,
where kvpress is installed (.venv-kvpress), kvpress's KVzipPress on the same prompt — all in this one run. With
`bench.grid`, a grid of budgets on one prefill (`bench.grid=true`: the leaderboard's six, 0.75 … 1/32; or a list):
one reconstruction shared by every budget (what the runner does) against one per budget, and the prefill_s each row
is charged either way.

    python -m kvbench.bench kvzip [overrides]      # e.g. 'task.context_lengths=[2048]' bench.repeats=1 bench.grid=true

The prompt: the task's first example per context length (default NIAH 2K at depth 0.5, its context only). Prints
seconds per compression (best of `bench.repeats`), the share spent in the reconstruction attention, and the ratios
measured here (quote them with the CPU; machines differ).
"""

from __future__ import annotations

import importlib.util
import time

from kvbench.bench.common import checked, header, lengths, load, options

OPTIONS = {"repeats": 2, "grid": None}
LEADERBOARD = [0.75, 0.5, 0.25, 0.125, 0.0625, 0.03125]


def compress_seconds(engine, ids, upcast: bool) -> tuple[float, float]:
    """(whole compression, of it the reconstruction attention) for kvbench's kvzip at budget 0.25."""
    from kvbench.methods import Budget, build_method
    from kvbench.methods import kvzip as kvzip_module

    method, spent = build_method("kvzip"), [0.0]
    original = kvzip_module.max_attention

    def timed(query, keys, scaling, span):
        start = time.perf_counter()
        query, keys = (query.float(), keys.float()) if upcast else (query, keys)
        out = original(query, keys, scaling, span)
        spent[0] += time.perf_counter() - start
        return out

    prefill = engine.prefill(list(ids), method.stats_request())
    kvzip_module.max_attention = timed
    try:
        start = time.perf_counter()
        method.compress(prefill.kv, prefill.stats, Budget.parse(0.25))
        return time.perf_counter() - start, spent[0]
    finally:
        kvzip_module.max_attention = original


def grid_seconds(engine, ids, budgets: list[float], share: bool) -> tuple[float, float]:
    """(wall seconds to compress every budget on one prefill, the mean prefill_s a row is charged); share=False
    drops the prefill's reconstruction before each budget, as when each configuration derived its own."""
    from kvbench.methods import Budget, build_method
    from kvbench.model.attention import StatsRequest

    prefill = engine.prefill(list(ids), StatsRequest())
    start, charged = time.perf_counter(), []
    for budget in budgets:
        if not share:
            prefill.stats.prompt.derived.clear()
        charged.append(engine.compressed(prefill, build_method("kvzip"), Budget.parse(budget), []).prefill_s)
    return time.perf_counter() - start, sum(charged) / len(charged)


def press_seconds(engine, ids) -> float:
    """KVzipPress's hooked prefill minus a plain prefill of the same prompt (its compression's own time)."""
    from transformers import DynamicCache

    from kvbench.methods import Budget, build_method

    method, positions = build_method("kvpress", {"press": "KVzipPress"}), list(range(len(ids)))
    start = time.perf_counter()
    with method.hooked_prefill(engine.lm, len(ids), Budget.parse(0.25)):
        engine.forward(list(ids), positions, DynamicCache())
    hooked = time.perf_counter() - start
    start = time.perf_counter()
    engine.forward(list(ids), positions, DynamicCache())
    return hooked - (time.perf_counter() - start)


def prompts(spec, lm) -> list[list[int]]:
    """The context of the task's first example at each context length."""
    from kvbench.tasks import build_task

    out = []
    for length in lengths(spec):
        task = dict(spec.task, context_lengths=[length])
        out.append(build_task(task, lm.tokenizer, spec.seed, lm.max_context).examples()[0].split(True)[0])
    return out


def main(overrides: list[str]) -> None:
    from kvbench.native.engine import Engine

    opts, overrides = options(overrides, OPTIONS, "kvzip")
    spec, _ = checked(overrides, "method=kvzip", "dtype=bfloat16", "task.context_lengths=[2048]", "task.depths=[0.5]")
    lm = load(spec)
    engine, has_kvpress, repeats = Engine(lm), importlib.util.find_spec("kvpress") is not None, opts["repeats"]
    header("kvzip", lm)
    columns = ["T", "model-dtype products s (attention s)", "fp32 products s (attention s)", "fp32 / model dtype"]
    print("| " + " | ".join([*columns, "KVzipPress s"]) + " |\n|---|---|---|---|---|")
    for ids in prompts(spec, lm):
        ours = min((compress_seconds(engine, ids, False) for _ in range(repeats)), key=lambda r: r[0])
        fp32 = min((compress_seconds(engine, ids, True) for _ in range(repeats)), key=lambda r: r[0])
        press = f"{min(press_seconds(engine, ids) for _ in range(repeats)):.1f}" if has_kvpress else "(not installed)"
        print(
            f"| {len(ids)} | {ours[0]:.1f} ({ours[1]:.1f}) | {fp32[0]:.1f} ({fp32[1]:.1f}) | "
            f"{fp32[0] / ours[0]:.2f} | {press} |"
        )
    if opts["grid"] is None or opts["grid"] is False:
        return
    budgets = [float(b) for b in opts["grid"]] if isinstance(opts["grid"], list) and opts["grid"] else LEADERBOARD
    print(f"\nkvzip grid of {len(budgets)} budgets on one prefill")
    print("| T | one reconstruction per budget s (row prefill_s) | one shared s (row prefill_s) | speed-up |")
    print("|---|---|---|---|")
    for ids in prompts(spec, lm):
        each = grid_seconds(engine, ids, budgets, share=False)
        shared = grid_seconds(engine, ids, budgets, share=True)
        cells = [f"{each[0]:.1f} ({each[1]:.1f})", f"{shared[0]:.1f} ({shared[1]:.1f})", f"{each[0] / shared[0]:.2f}"]
        print(f"| {len(ids)} | " + " | ".join(cells) + " |")
