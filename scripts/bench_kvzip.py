"""KVzip's compression time on a real model: the reconstruction forward and its attention scores, with the
attention products in the model's dtype (what methods/kvzip.py does) and in fp32 (the variant it replaced), and,
where kvpress is installed, kvpress's KVzipPress on the same prompt — all in this one run. With --grid, a grid of
budgets on one prefill (the leaderboard's six by default): one reconstruction shared by every budget (what the runner
does) against one per budget, and the prefill_s each row is charged either way.

    python scripts/bench_kvzip.py [--model smollm2-135m] [--lengths 2048] [--dtype bfloat16] [--grid [B ...]]

Prints seconds per compression (best of `repeats`), the share spent in the reconstruction attention, and the ratios
measured here (quote them with the CPU from lscpu; machines differ).
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from kvbench import conf_dir
from kvbench.engine.engine import Engine
from kvbench.methods import Budget, build_method
from kvbench.methods import kvzip as kvzip_module
from kvbench.model.attention import StatsRequest
from kvbench.model.load import load_model
from kvbench.tasks import build_task


def compress_seconds(engine, ids, upcast: bool) -> tuple[float, float]:
    """(whole compression, of it the reconstruction attention) for kvbench's kvzip at budget 0.25."""
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
    prefill = engine.prefill(list(ids), StatsRequest())
    start, charged = time.perf_counter(), []
    for budget in budgets:
        if not share:
            prefill.stats.prompt.derived.clear()
        charged.append(engine.compressed(prefill, build_method("kvzip"), Budget.parse(budget), []).prefill_s)
    return time.perf_counter() - start, sum(charged) / len(charged)


def press_seconds(lm, ids) -> float:
    """KVzipPress's hooked prefill minus a plain prefill of the same prompt (its compression's own time)."""
    method = build_method("kvpress", {"press": "KVzipPress"})
    start = time.perf_counter()
    with method.hooked_prefill(lm, len(ids), Budget.parse(0.25)):
        lm.forward(list(ids), list(range(len(ids))), DynamicCache())
    hooked = time.perf_counter() - start
    start = time.perf_counter()
    lm.forward(list(ids), list(range(len(ids))), DynamicCache())
    return hooked - (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--grid", type=float, nargs="*", help="budgets (none given: 0.75 0.5 0.25 0.125 1/16 1/32)")
    args = parser.parse_args()
    lm = load_model(OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml"), "cpu", args.dtype)
    engine, has_kvpress = Engine(lm), importlib.util.find_spec("kvpress") is not None
    print(f"{args.model} {args.dtype}, torch threads {torch.get_num_threads()}")
    columns = ["T", "model-dtype products s (attention s)", "fp32 products s (attention s)", "fp32 / model dtype"]
    print("| " + " | ".join([*columns, "KVzipPress s"]) + " |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        cfg = OmegaConf.load(conf_dir() / "task" / "niah.yaml")
        cfg.update({"context_lengths": [length], "depths": [0.5]})
        ids, _ = build_task(cfg, lm.tokenizer, 0).examples()[0].split(True)
        ours = min((compress_seconds(engine, ids, False) for _ in range(args.repeats)), key=lambda r: r[0])
        fp32 = min((compress_seconds(engine, ids, True) for _ in range(args.repeats)), key=lambda r: r[0])
        press = f"{min(press_seconds(lm, ids) for _ in range(args.repeats)):.1f}" if has_kvpress else "(not installed)"
        print(
            f"| {len(ids)} | {ours[0]:.1f} ({ours[1]:.1f}) | {fp32[0]:.1f} ({fp32[1]:.1f}) | "
            f"{fp32[0] / ours[0]:.2f} | {press} |"
        )
    if args.grid is None:
        return
    budgets = args.grid or [0.75, 0.5, 0.25, 0.125, 0.0625, 0.03125]
    print(f"\nkvzip grid of {len(budgets)} budgets on one prefill")
    print("| T | one reconstruction per budget s (row prefill_s) | one shared s (row prefill_s) | speed-up |")
    print("|---|---|---|---|")
    for length in args.lengths:
        cfg = OmegaConf.load(conf_dir() / "task" / "niah.yaml")
        cfg.update({"context_lengths": [length], "depths": [0.5]})
        ids, _ = build_task(cfg, lm.tokenizer, 0).examples()[0].split(True)
        each = grid_seconds(engine, ids, budgets, share=False)
        shared = grid_seconds(engine, ids, budgets, share=True)
        cells = [f"{each[0]:.1f} ({each[1]:.1f})", f"{shared[0]:.1f} ({shared[1]:.1f})", f"{each[0] / shared[0]:.2f}"]
        print(f"| {len(ids)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
