"""Shared-prefill sweep: separate runs vs one shared prefill vs shared prefill + the grid decoded as one batch.

    python scripts/bench_sweep.py [--model smollm2-135m] [--lengths 1024 2048 4096] [--depth 0.5]
                                  [--methods snapkv h2o streamingllm pyramidkv] [--budgets 0.1 0.25 0.5]
                                  [--no-separate] [--dtype float32] [--baseline FILE.json]
    # the baseline, from a checkout of an older commit with this script copied in:
    python bench_sweep.py --no-separate --save-baseline FILE.json

Separate = what separate runs do: prefill + compress + decode for each (method, budget). Shared = one prefill per
example with the union of the statistics, then compress + decode per configuration, one at a time
(grid_batch=false). Grid = shared prefill, each configuration compressed alone, then decoded together as one
batch (grid_batch=true, kvbench.engine.grid_decode). Same examples, one process; checks the outputs are identical and
prints the wall times and speed-ups. --baseline: the same shared sweep timed on an older commit (its outputs and
seconds as JSON); prints today's default path (grid in float32, where grid_batch=auto batches; else one by one)
against it.
"""

from __future__ import annotations

import argparse
import json
import time

from omegaconf import OmegaConf

from kvbench import conf_dir
from kvbench.engine.engine import Engine
from kvbench.methods import Budget, build_method
from kvbench.model.attention import StatsRequest
from kvbench.model.load import load_model
from kvbench.run.configuration import method_config
from kvbench.tasks import build_task

CONF = conf_dir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--depth", type=float, default=0.5)
    parser.add_argument("--methods", nargs="+", default=["snapkv", "h2o", "streamingllm", "pyramidkv"])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="grid_batch=auto decodes together in float32 only")
    parser.add_argument("--no-separate", action="store_true", help="skip the separate-runs pass (the slowest)")
    parser.add_argument(
        "--save-baseline",
        default=None,
        help="time only the shared sweep one by one and write it as a --baseline JSON (run this script, copied, in a "
        "checkout of the older commit: it imports nothing newer there)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help='JSON {"label", "seconds", "outputs", settings} of an older commit\'s shared sweep (same examples and '
        "order): print today's times against it and how many outputs are identical; refused when its settings "
        "(model, dtype, lengths, depth, methods, budgets) differ from this run's",
    )
    args = parser.parse_args()

    lm = load_model(OmegaConf.load(CONF / "model" / f"{args.model}.yaml"), args.device, args.dtype)
    # what the outputs depend on: a baseline is compared only with a run of the same settings
    settings = {
        "model": args.model,
        "dtype": str(lm.dtype),
        "lengths": args.lengths,
        "depth": args.depth,
        "methods": args.methods,
        "budgets": args.budgets,
    }
    base = None
    if args.baseline:
        with open(args.baseline) as f:
            base = json.load(f)
        differ = [f"{k} {base.get(k)} ≠ {v}" for k, v in settings.items() if base.get(k) != v]
        if differ:
            raise SystemExit(f"--baseline {args.baseline} was timed with other settings: {'; '.join(differ)}")
    engine = Engine(lm)
    task_cfg = OmegaConf.load(CONF / "task" / "niah.yaml")
    task_cfg.update({"context_lengths": args.lengths, "depths": [args.depth]})
    examples = build_task(task_cfg, lm.tokenizer, 0, lm.max_context).examples()

    def configs():
        out = []
        for name in args.methods:
            params = {k: v for k, v in method_config(name).items() if k != "name"}
            out += [(build_method(name, params), Budget.parse(b)) for b in args.budgets]
        return out

    engine.run(build_method("full"), None, examples[0].split(True)[0][:64], max_new_tokens=2)  # warm-up
    start, alone = time.perf_counter(), []
    if not (args.no_separate or args.save_baseline):
        for ex in examples:
            for method, budget in configs():
                alone.append(engine.run(method, budget, *ex.split(True), max_new_tokens=ex.max_new_tokens).text)
    t_alone = time.perf_counter() - start

    prefill_s = {"shared": 0.0, "grid": 0.0}

    def shared_prefill(ex, todo, mode: str):
        request = StatsRequest()
        for method, _ in todo:
            request = request | method.stats_request()
        prompt, suffix = ex.split(True)
        prefill = engine.prefill(prompt, request)
        prefill_s[mode] += prefill.seconds  # the prompt's forward pass
        return prefill, suffix

    start, shared = time.perf_counter(), []
    for ex in examples:
        todo = configs()
        prefill, suffix = shared_prefill(ex, todo, "shared")
        for method, budget in todo:
            shared.append(engine.generate(prefill, method, budget, suffix, ex.max_new_tokens).text)
    t_shared = time.perf_counter() - start
    if args.save_baseline:
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.save_baseline, "w") as f:
            label = f"{commit} (shared prefill, one by one)"
            json.dump({"label": label, "seconds": t_shared, "outputs": shared, **settings}, f)
        print(
            f"shared prefill, one by one: {t_shared:.1f} s ({len(shared)} outputs, {lm.dtype}) -> {args.save_baseline}"
        )
        return

    from kvbench.engine.grid_decode import generate_grid
    from kvbench.run.config_hash import grid_rows_as_alone

    start, grid, batched = time.perf_counter(), [], 0
    for ex in examples:
        todo = configs()
        prefill, suffix = shared_prefill(ex, todo, "grid")
        gens = generate_grid(engine, prefill, todo, suffix, ex.max_new_tokens)
        grid += [g.text for g in gens]
        batched += sum(getattr(g, "batch_size", 1) > 1 for g in gens)
    t_grid = time.perf_counter() - start

    n = len(shared)
    print(
        f"{len(examples)} examples × {n // len(examples)} configurations ({args.model}, {lm.dtype}, {lm.device}); "
        f"{batched}/{n} decoded in a grid batch"
    )
    if alone:
        print(f"separate runs:                 {t_alone:7.1f} s")
    print(
        f"shared prefill, one by one:    {t_shared:7.1f} s (prefill {prefill_s['shared']:.1f} s, "
        f"compress + decode {t_shared - prefill_s['shared']:.1f} s)"
    )
    print(
        f"shared prefill, grid batched:  {t_grid:7.1f} s (prefill {prefill_s['grid']:.1f} s, "
        f"compress + decode {t_grid - prefill_s['grid']:.1f} s)"
    )
    after = (t_shared - prefill_s["shared"]) / max(1e-9, t_grid - prefill_s["grid"])
    print(
        f"grid vs one by one: {t_grid / t_shared:.2f} of the time ({t_shared / t_grid:.2f}× faster; "
        f"compress + decode {after:.2f}× faster)"
        + (f"; vs separate runs {t_alone / t_grid:.2f}× faster" if alone else "")
    )
    if base is not None:
        auto = grid_rows_as_alone(lm)  # what a default sweep runs: grid_batch=auto batches in float32 only
        default, t_default = (grid, t_grid) if auto else (shared, t_shared)
        print(
            f"vs {base['label']}: {base['seconds']:.1f} s → {t_default:.1f} s, "
            f"{t_default / base['seconds']:.2f} of the time ({base['seconds'] / t_default:.2f}× faster); "
            f"identical outputs {sum(a == b for a, b in zip(base['outputs'], default))}/{len(base['outputs'])}"
        )
    same = sum(a == b for a, b in zip(shared, grid))
    print(
        f"identical outputs, grid vs one by one: {same}/{n}"
        + (f"; one by one vs separate: {sum(a == b for a, b in zip(alone, shared))}/{n}" if alone else "")
    )


if __name__ == "__main__":
    main()
