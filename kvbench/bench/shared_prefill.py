"""Shared-prefill sweep: separate runs vs one shared prefill vs shared prefill + the grid decoded as one batch.

    python -m kvbench.bench shared_prefill [overrides]   # e.g. bench.separate=false dtype=float32
    python -m kvbench.bench shared_prefill bench.separate=false bench.save_baseline=FILE.json   # on an older checkout
    python -m kvbench.bench shared_prefill bench.baseline=FILE.json                             # today's against it

The examples are the task's (default NIAH 1K/2K/4K at depth 0.5: `task.context_lengths`, `task.depths`), the
configurations the grid's (default snapkv, h2o, streamingllm, pyramidkv × 0.1 / 0.25 / 0.5: `grid.method`,
`grid.budget`). Separate = what separate runs do: prefill + compress + decode for each (method, budget)
(`bench.separate=false` skips it, the slowest). Shared = one prefill per example with the union of the statistics,
then compress + decode per configuration, one at a time (grid_batch=false). Grid = shared prefill, each
configuration compressed alone, then decoded together as one batch (grid_batch=true, kvbench.native.grid_decode).
Same examples, one process; checks the outputs are identical and prints the wall times and speed-ups.
`bench.save_baseline=FILE`: time only the shared sweep one by one and write it (outputs, seconds, settings) as JSON;
`bench.baseline=FILE`: print today's default path (grid where grid_batch=auto batches; else one by one) against it,
refused when its settings (model, dtype, lengths, depths, configurations) differ from this run's.
"""

from __future__ import annotations

import json
import time

from kvbench import KvbenchError
from kvbench.bench.common import checked, header, label, load, options, requested

OPTIONS = {"separate": True, "save_baseline": None, "baseline": None}
DEFAULTS = (
    "task.depths=[0.5]",
    "grid.method=[snapkv,h2o,streamingllm,pyramidkv]",
    "grid.budget=[0.1,0.25,0.5]",
)


def shared_prefill(engine, ex, todo: list, prefill_s: dict, mode: str):
    """One prefill of the example's prompt with the union of the configurations' statistics; its suffix."""
    from kvbench.model.attention import StatsRequest

    request = StatsRequest()
    for method, _ in todo:
        request = request | method.stats_request()
    prompt, suffix = ex.split(True)
    prefill = engine.prefill(prompt, request)
    prefill_s[mode] += prefill.seconds  # the prompt's forward pass
    return prefill, suffix


def passes(engine, examples, todo: list, opts: dict) -> dict:
    """Each pass's outputs and seconds (separate, shared one by one, grid) and the prefills' seconds."""
    from kvbench.native.grid_decode import generate_grid

    out: dict = {"prefill_s": {"shared": 0.0, "grid": 0.0}, "separate": [], "shared": [], "grid": [], "batched": 0}
    start = time.perf_counter()
    if opts["separate"] and not opts["save_baseline"]:
        for ex in examples:
            for method, budget in todo:
                out["separate"].append(
                    engine.run(method, budget, *ex.split(True), max_new_tokens=ex.max_new_tokens).text
                )
    out["t_separate"], start = time.perf_counter() - start, time.perf_counter()
    for ex in examples:
        prefill, suffix = shared_prefill(engine, ex, todo, out["prefill_s"], "shared")
        for method, budget in todo:
            out["shared"].append(engine.generate(prefill, method, budget, suffix, ex.max_new_tokens).text)
    out["t_shared"], start = time.perf_counter() - start, time.perf_counter()
    if opts["save_baseline"]:
        return out
    for ex in examples:
        prefill, suffix = shared_prefill(engine, ex, todo, out["prefill_s"], "grid")
        gens = generate_grid(engine, prefill, todo, suffix, ex.max_new_tokens)
        out["grid"] += [g.text for g in gens]
        out["batched"] += sum(getattr(g, "batch_size", 1) > 1 for g in gens)
    out["t_grid"] = time.perf_counter() - start
    return out


def report(out: dict, n_examples: int) -> None:
    alone, shared, grid, prefill_s = out["separate"], out["shared"], out["grid"], out["prefill_s"]
    t_alone, t_shared, t_grid, n = out["t_separate"], out["t_shared"], out["t_grid"], len(shared)
    print(f"{n_examples} examples × {n // n_examples} configurations; {out['batched']}/{n} decoded in a grid batch")
    if alone:
        print(f"separate runs:                 {t_alone:7.1f} s")
    for name, seconds, key in (("one by one:  ", t_shared, "shared"), ("grid batched:", t_grid, "grid")):
        print(
            f"shared prefill, {name}  {seconds:7.1f} s (prefill {prefill_s[key]:.1f} s, "
            f"compress + decode {seconds - prefill_s[key]:.1f} s)"
        )
    after = (t_shared - prefill_s["shared"]) / max(1e-9, t_grid - prefill_s["grid"])
    print(
        f"grid vs one by one: {t_grid / t_shared:.2f} of the time ({t_shared / t_grid:.2f}× faster; "
        f"compress + decode {after:.2f}× faster)"
        + (f"; vs separate runs {t_alone / t_grid:.2f}× faster" if alone else "")
    )
    same = sum(a == b for a, b in zip(shared, grid))
    print(
        f"identical outputs, grid vs one by one: {same}/{n}"
        + (f"; one by one vs separate: {sum(a == b for a, b in zip(alone, shared))}/{n}" if alone else "")
    )


def read_baseline(path: str, settings: dict) -> dict:
    try:
        with open(path) as f:
            base = json.load(f)
    except (OSError, ValueError) as error:
        raise KvbenchError(f"bench.baseline={path}: {error}") from None
    differ = [f"{k} {base.get(k)} ≠ {v}" for k, v in settings.items() if base.get(k) != v]
    if differ:
        raise KvbenchError(f"bench.baseline={path} was timed with other settings: {'; '.join(differ)}")
    return base


def against(base: dict, out: dict, lm) -> None:
    from kvbench.rows.config_hash import grid_rows_as_alone

    auto = grid_rows_as_alone(lm)  # what a default sweep runs: grid_batch=auto batches where rows come out as alone
    default, t_default = (out["grid"], out["t_grid"]) if auto else (out["shared"], out["t_shared"])
    print(
        f"vs {base['label']}: {base['seconds']:.1f} s → {t_default:.1f} s, "
        f"{t_default / base['seconds']:.2f} of the time ({base['seconds'] / t_default:.2f}× faster); "
        f"identical outputs {sum(a == b for a, b in zip(base['outputs'], default))}/{len(base['outputs'])}"
    )


def save(path: str, out: dict, settings: dict) -> None:
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(path, "w") as f:
        label = f"{commit} (shared prefill, one by one)"
        json.dump({"label": label, "seconds": out["t_shared"], "outputs": out["shared"], **settings}, f)
    print(f"shared prefill, one by one: {out['t_shared']:.1f} s ({len(out['shared'])} outputs) -> {path}")


def main(overrides: list[str]) -> None:
    from kvbench.methods import build_method
    from kvbench.native.engine import Engine
    from kvbench.tasks import build_task

    opts, overrides = options(overrides, OPTIONS, "shared_prefill")
    spec, confs = checked(overrides, *DEFAULTS)
    confs = [c for c in requested(spec, confs)]
    lm = load(spec)
    settings = {
        "model": lm.name,
        "dtype": str(lm.dtype),
        "lengths": list(spec.task.get("context_lengths") or []),
        "depths": list(spec.task.get("depths") or []),
        "configurations": [label(c) for c in confs],
    }  # what the outputs depend on: a baseline is compared only with a run of the same settings
    base = read_baseline(opts["baseline"], settings) if opts["baseline"] else None
    engine = Engine(lm)
    examples = build_task(spec.task, lm.tokenizer, spec.seed, lm.max_context).examples()
    header("shared_prefill", lm)
    engine.run(build_method("full"), None, examples[0].split(True)[0][:64], max_new_tokens=2)  # warm-up
    out = passes(engine, examples, [(c.method, c.budget) for c in confs], opts)
    if opts["save_baseline"]:
        save(opts["save_baseline"], out, settings)
        return
    report(out, len(examples))
    if base is not None:
        against(base, out, lm)
