"""Parity of a serving engine with kvbench's own engine on the same token ids, and the engine's options.

The 9 default NIAH prompts (task=niah: 1K/2K/4K x depths 10/50/90 %, seed 0), built in kvbench's venv, run through
kvbench's full cache and the engine's `full`: identical greedy tokens, or the first divergence with kvbench's
top-1 - top-2 logit gap at that step (a gap near 0 is a near-tie that rounding in another dtype or kernel flips; a
large gap points at the weights or a bug). Then each option of the engine on the same prompts: eviction options at
budget 1.0 (nothing to evict) must equal the engine's full run; every option's bytes per token.

    python scripts/engine_options_parity.py --engine openvino [--dtype float32] [--options u8,u4,sum] [--limit 9]
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch
from omegaconf import OmegaConf

from kvbench import conf_dir
from kvbench.backends.base import EngineRequest
from kvbench.engine.engine import Engine
from kvbench.methods import build_method
from kvbench.model.load import load_model
from kvbench.tasks.base import build_task


def backend(name: str):
    if name == "vllm":
        from kvbench.backends.vllm import VllmBackend

        return VllmBackend()
    if name == "openvino":
        from kvbench.backends.openvino import OpenvinoBackend

        return OpenvinoBackend()
    raise SystemExit(f"--engine vllm or openvino, not {name}")


def divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (a shorter one differs where it ends); None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", help="kvbench's and the engine's dtype")
    parser.add_argument("--options", default="", help="comma-separated; default: every option but full")
    parser.add_argument("--limit", type=int, default=9)
    parser.add_argument("--budget", type=float, default=None, help="also run the options at this budget")
    args = parser.parse_args()
    model_cfg = OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml")
    lm = load_model(model_cfg, "cpu", args.dtype)
    engine, full = Engine(lm), build_method("full")
    task = build_task(OmegaConf.load(conf_dir() / "task" / "niah.yaml"), lm.tokenizer, seed=0, max_context=8192)
    examples = task.examples()[: args.limit]
    stop = sorted(engine.eos_ids)
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name'"], capture_output=True, text=True).stdout
    print(f"{args.engine} vs kvbench, {args.model} {args.dtype}, {cpu.split(':')[-1].strip()}")

    ours = {}
    for ex in examples:
        ids = ex.context_ids + ex.question_ids
        gen = engine.run(full, None, ids, max_new_tokens=ex.max_new_tokens, keep_logits=True)
        ours[ex.example_id] = gen

    be = backend(args.engine)
    every = [o for o in be.options if not be.unavailable(OmegaConf.to_container(model_cfg), o)]  # runs here
    options = [o for o in (args.options.split(",") if args.options else every) if o and o != "full"]
    for option in ["full", *options]:
        why = be.unavailable(OmegaConf.to_container(model_cfg), option)
        if why:
            raise SystemExit(why)
    started = time.perf_counter()
    be.start(OmegaConf.to_container(model_cfg), args.dtype)
    print(f"engine started in {time.perf_counter() - started:.1f} s")
    kvbench_scores = [task.score(ours[ex.example_id].text, ex)["score"] for ex in examples]
    print(f"kvbench full score {sum(kvbench_scores) / len(kvbench_scores):.2f}")
    print("\nparity, full: example | tokens | first divergence | kvbench's logit gap there | answer (kvbench / engine)")
    engine_full = {}
    for ex in examples:
        ids = ex.context_ids + ex.question_ids
        request = EngineRequest(ids, ex.max_new_tokens, "full", stop_ids=stop)
        got = be.generate(request)
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

    for budget in [1.0] + ([args.budget] if args.budget is not None else []):
        table(be, task, lm, examples, options, engine_full, stop, budget)
    be.close()


def table(be, task, lm, examples, options, engine_full, stop, budget) -> None:
    print(
        f"\noptions at budget {budget} (eviction options only; others hold every token): option | equal to the "
        "engine's full | kv_ratio | bytes/token | score | notes"
    )
    for option in options:
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
        n = len(ratios)
        if n:
            print(
                f"{option} | {equal}/{n} | {sum(ratios) / n:.3f} | {sum(per_token) / n:.0f} | "
                f"{sum(scores) / n:.2f} | {'; '.join(sorted(notes))}"
            )
        else:
            print(f"{option} | - | - | - | - | {'; '.join(sorted(notes))}")


if __name__ == "__main__":
    main()
