"""A grid's price: the default sweep against the full cache alone and against plain transformers, same prompts.

    python -m kvbench.bench sweep [overrides]        # e.g. dtype=float32, task.context_lengths=[1024]

Three passes in one process, each on the run's examples (default: NIAH 1K/2K/4K × 3 depths, 24 new tokens):
- plain: transformers alone — the whole prompt through the model with its own DynamicCache, then a greedy loop
  (the last position's logits, argmax, one token per forward), stopped where kvbench stops;
- full: `python -m kvbench method=full`'s run (`runner.run`, a fresh store: nothing reused);
- sweep: the default grid — full + SnapKV, PyramidKV, H2O, StreamingLLM, random × 0.25 / 0.5 — fidelity on.
Prints each pass's seconds (the examples' work: the model loaded), sweep/full and full/plain, whether full's
predictions are plain's, and where the sweep's time goes from its rows: fidelity's share and the grid's decode.
`bench.pairs=N` runs full and the sweep N times, interleaved (full, sweep, full, sweep, …), and prints each pair's
ratio and their median: on a machine whose speed drifts between minutes (a shared VM) one pair's ratio can move by
10 % or more. Each pass goes one context length at a time (`bench.by_length`, default null: where the task has
context lengths; true: required; false: the examples whole) — that length's full run, then its sweep — so the two
halves of a ratio are at most a minute apart; the rows and seconds are the lengths' summed.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import pandas as pd
import torch

from kvbench import KvbenchError
from kvbench.bench.common import compose, machine, options

GRID = ["grid.method=[snapkv,pyramidkv,h2o,streamingllm,random]", "grid.budget=[0.25,0.5]"]
OPTIONS = {"pairs": 1, "by_length": None}  # interleaved (full, sweep) runs; each length's full beside its sweep


def plain_answers(lm, engine, examples) -> tuple[float, list[str]]:
    """transformers on its own: prefill + greedy loop with its DynamicCache; seconds and each example's answer."""
    from transformers import DynamicCache

    answers, start = [], time.perf_counter()
    with torch.inference_mode():
        for ex in examples:
            prompt, suffix = ex.split(True)
            ids = torch.tensor([prompt + suffix], device=lm.device)  # (1, T)
            cache = DynamicCache()
            logits = lm.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            token = int(logits[0, -1].argmax())
            out = [token]
            while len(out) < ex.max_new_tokens and token not in engine.eos_ids:
                if ex.stop and any(s in lm.tokenizer.decode(out, skip_special_tokens=True) for s in ex.stop):
                    break
                step = torch.tensor([[token]], device=lm.device)  # (1, 1)
                token = int(lm.model(input_ids=step, past_key_values=cache, use_cache=True).logits[0, -1].argmax())
                out.append(token)
            answers.append(engine.answer_text(out, ex.stop))
    return time.perf_counter() - start, answers


def timed_run(overrides: list[str], *extra: str):
    """runner.run of the configuration in a fresh store: its rows (attrs["work_s"]: the examples' seconds)."""
    from kvbench.run.runner import run

    with tempfile.TemporaryDirectory() as tmp:
        return run(compose(overrides, f"results_dir={tmp}/store", *extra), output_dir=f"{tmp}/out")


def timed_pair(overrides: list[str], lengths: list[int] | None):
    """(full, sweep) runs on the examples: whole, or one context length at a time, each length's full run beside
    its sweep (a drift of the machine's speed between minutes then falls on both), rows joined, work_s summed."""
    if not lengths:
        return timed_run(overrides, "method=full"), timed_run(overrides, *GRID)
    own = [o for o in overrides if not o.startswith("task.context_lengths=")]
    runs = [
        (
            timed_run(own, f"task.context_lengths=[{n}]", "method=full"),
            timed_run(own, f"task.context_lengths=[{n}]", *GRID),
        )
        for n in lengths
    ]
    joined = []
    for side in zip(*runs):
        frame = pd.concat(side, ignore_index=True)
        frame.attrs["work_s"] = sum(f.attrs["work_s"] for f in side)
        joined.append(frame)
    return joined[0], joined[1]


def main(overrides: list[str]) -> None:
    from kvbench.model.load import load_model
    from kvbench.native.engine import Engine
    from kvbench.preflight.entrance import check_run
    from kvbench.tasks import build_task

    opts, overrides = options(overrides, OPTIONS, "sweep")
    if opts["pairs"] < 1:
        raise KvbenchError(f"bench.pairs={opts['pairs']}: give 1 or more (full, sweep) pairs")
    spec, _ = check_run(compose(overrides, "method=full"))  # every override checked before anything loads
    if not any(opts["by_length"] is value for value in (None, True, False)):  # 1 == True: compared by identity
        raise KvbenchError(f"bench.by_length={opts['by_length']}: give true, false or null (by length where it can)")
    lengths = spec.task.get("context_lengths") if opts["by_length"] is not False else None  # null: where it can
    if opts["by_length"] is True and not lengths:
        raise KvbenchError(f"bench.by_length=true needs a task with context_lengths; task={spec.task_name} has none")
    lm = load_model(spec.model, spec.device, spec.dtype)
    task = build_task(spec.task, lm.tokenizer, spec.seed, lm.max_context)
    examples = task.examples()[: spec.limit] if spec.limit else task.examples()
    engine = Engine(lm)
    print(f"sweep benchmark: {lm.name} {str(lm.dtype).removeprefix('torch.')} on {machine(lm.device)}")
    plain_s, plain = plain_answers(lm, engine, examples)
    del engine, lm
    pairs = [timed_pair(overrides, lengths) for _ in range(opts["pairs"])]
    full, sweep = pairs[0]
    full_s, sweep_s = full.attrs["work_s"], sweep.attrs["work_s"]
    by_id = dict(zip(full.example_id, full.prediction))
    same = sum(by_id.get(ex.example_id) == answer for ex, answer in zip(examples, plain))
    grid_rows = sweep[sweep.batch_size > 1]
    print(f"{len(examples)} examples, {sweep.config_hash.nunique()} configurations in the sweep ({len(sweep)} rows)")
    print(f"plain transformers   {plain_s:7.1f} s")
    equal = f"predictions equal: {same}/{len(plain)}"
    print(f"method=full          {full_s:7.1f} s   {full_s / plain_s:.3f}× plain; {equal}")
    print(f"sweep, fidelity on   {sweep_s:7.1f} s   {sweep_s / full_s:.3f}× full")
    fidelity_s = float(sweep.fidelity_s.sum()) if "fidelity_s" in sweep else 0.0
    print(f"  fidelity columns   {fidelity_s:7.1f} s   {fidelity_s / sweep_s:.1%} of the sweep")
    if len(grid_rows):
        step = grid_rows.groupby("example_id").decode_ms_per_token.first()
        alone = full.set_index("example_id").decode_ms_per_token.reindex(step.index)
        print(
            f"  grid decode        {len(grid_rows)} rows in batches of {int(grid_rows.batch_size.max())}: a step "
            f"{(step / alone).mean():.2f}× the full cache's alone (mean over examples); bandwidth share "
            f"{grid_rows.bandwidth_share.mean():.2f} (full alone {full.bandwidth_share.mean():.2f})"
        )
    if len(pairs) > 1:
        ratios = [s.attrs["work_s"] / f.attrs["work_s"] for f, s in pairs]  # each pair's sweep / full
        listed = " / ".join(f"{r:.3f}" for r in ratios)
        print(f"sweep / full, {len(ratios)} interleaved pairs: {listed}; median {statistics.median(ratios):.3f}×")
