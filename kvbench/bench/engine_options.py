"""Parity of a serving engine with kvbench's own engine on the same token ids, and the engine's options.

    python -m kvbench.bench engine_options engine=NAME [overrides]   # e.g. engine=openvino 'grid.method=[u8,u4,sum]'

The engine's venv must be built (`make engine-<name>`): without it the run is refused in one line. The task's prompts
(default task=niah: 1K/2K/4K × depths 10/50/90 %, seed 0; `limit=N`: the first N), built in kvbench's venv, run
through kvbench's full cache and the engine's `full`: identical greedy tokens, or the first divergence with kvbench's
top-1 − top-2 logit gap at that step (a gap near 0 is a near-tie that rounding in another dtype or kernel flips; a
large gap points at the weights or a bug). Then each option of the engine (`grid.method`; default every option but
full that runs here) on the same prompts: eviction options at budget 1.0 (nothing to evict) must equal the engine's
full run; every option's kv_ratio, bytes per token and score; `budget=0.25` also runs them at that budget. Default
dtype float32 (kvbench's and the engine's).
"""

from __future__ import annotations

import subprocess
import time

import torch

from kvbench.bench.common import checked, header, load, options
from kvbench.bench.engine_parity import engine_of


def divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (a shorter one differs where it ends); None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def parity(be, lm, examples, ours: dict, stop: list[int]) -> dict:
    """The engine's `full` on each prompt against kvbench's: the engine's generations by example id."""
    from kvbench.engines import EngineRequest

    print("\nparity, full: example | tokens | first divergence | kvbench's logit gap there | answer (kvbench / engine)")
    engine_full = {}
    for ex in examples:
        ids = ex.context_ids + ex.question_ids
        got = be.generate(EngineRequest(ids, ex.max_new_tokens, "full", stop_ids=stop))
        engine_full[ex.example_id] = got
        mine = ours[ex.example_id]
        at = divergence(mine.token_ids, got.token_ids)
        gap = ""
        if at is not None and at < len(mine.logits):
            top = torch.topk(mine.logits[at].float(), 2).values  # (2,)
            gap = f"{float(top[0] - top[1]):.3f}"
        same = "identical" if at is None else f"differ at {at}"
        a, b = lm.tokenizer.decode(mine.token_ids[:10]), lm.tokenizer.decode(got.token_ids[:10])
        print(f"{ex.example_id} | {len(ids)} | {same} | {gap} | {a!r} / {b!r}")
        print(f"    bytes/token {got.kv_bytes_full / (len(ids) + got.decode_steps):.0f} full, extra {got.extra}")
    return engine_full


def option_line(be, task, lm, examples, option: str, engine_full: dict, stop: list[int], budget: float) -> str:
    """One option on every prompt: equal to the engine's full run, kv_ratio, bytes per token, score, notes."""
    from kvbench.engines import EngineRequest

    equal, ratios, per_token, scores, notes = 0, [], [], [], set()
    for ex in examples:
        ids = ex.context_ids + ex.question_ids
        request = EngineRequest(ids, ex.max_new_tokens, option, budget=budget, stop_ids=stop)
        try:
            got = be.generate(request)
        except Exception as error:  # the engine's one-line failure (KvbenchError)
            notes.add(f"failed: {error}")
            break
        equal += got.token_ids == engine_full[ex.example_id].token_ids
        ratios.append(got.kv_bytes / got.kv_bytes_full)
        per_token.append(got.kv_bytes / (len(ids) + got.decode_steps))
        scores.append(task.score(lm.tokenizer.decode(got.token_ids, skip_special_tokens=True), ex)["score"])
        if got.invalid:
            notes.add(f"garbage, not averaged (match_full {got.extra['match_full']})")
    n, note = len(ratios), "; ".join(sorted(notes))
    if not n:
        return f"{option} | - | - | - | - | {note}"
    return f"{option} | {equal}/{n} | {sum(ratios) / n:.3f} | {sum(per_token) / n:.0f} | {sum(scores) / n:.2f} | {note}"


def main(overrides: list[str]) -> None:
    from kvbench.methods import build_method
    from kvbench.native.engine import Engine
    from kvbench.tasks import build_task

    _, overrides = options(overrides, {}, "engine_options")  # no options of its own: a bench. key is refused
    spec, _ = checked(overrides, "method=full", "dtype=float32", "device=cpu")  # the venv, the options: one line
    be = engine_of(spec)
    entries = spec.grid.get("method")
    every = [o for o in be.options if not be.unavailable(spec.model, o)]  # what runs here
    chosen = [e["name"] if isinstance(e, dict) else e for e in entries] if entries else every
    chosen = [o for o in chosen if o != "full"]
    lm = load(spec)
    engine, full = Engine(lm), build_method("full")
    task = build_task(spec.task, lm.tokenizer, spec.seed, lm.max_context)
    examples = task.examples()[: spec.limit]
    stop: list[int] = sorted(engine.eos_ids)  # type: ignore[arg-type]  # token ids
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name'"], capture_output=True, text=True).stdout
    header("engine_options", lm, f"engine={spec.engine_name} vs kvbench, {cpu.split(':')[-1].strip()}")
    ours = {}
    for ex in examples:
        ids = ex.context_ids + ex.question_ids
        ours[ex.example_id] = engine.run(full, None, ids, max_new_tokens=ex.max_new_tokens, keep_logits=True)
    started = time.perf_counter()
    be.start(spec.model, spec.dtype if spec.dtype != "auto" else str(lm.dtype).removeprefix("torch."))
    try:
        print(f"engine started in {time.perf_counter() - started:.1f} s")
        scores = [task.score(ours[ex.example_id].text, ex)["score"] for ex in examples]
        print(f"kvbench full score {sum(scores) / len(scores):.2f}")
        engine_full = parity(be, lm, examples, ours, stop)
        for budget in [1.0] + ([spec.budget] if spec.budget is not None else []):
            print(
                f"\noptions at budget {budget} (eviction options only; others hold every token): option | equal to "
                "the engine's full | kv_ratio | bytes/token | score | notes"
            )
            for option in chosen:
                print(option_line(be, task, lm, examples, option, engine_full, stop, budget))
    finally:
        be.close()
