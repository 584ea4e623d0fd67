"""kvbench's own time for one example with the full cache vs plain transformers `generate` on the same prompt.

    python -m kvbench.bench vs_generate [overrides]      # e.g. model=hub model.name_or_path=DIR dtype=float32

The harness's overhead over the model's plain forward and decode: kvbench's prefill (logits of the last position
only: a 262K vocabulary must not cost a full-length logits tensor) + greedy decode, against
`model.generate(max_new_tokens=N, do_sample=False)` with transformers' own cache, interleaved, best of
`bench.repeats` (3), the ratio printed; tokens are checked equal. Per context length of `task.context_lengths`
(default 2048) a random prompt; `bench.new_tokens` (24) new tokens; `bench.threads` (1) torch threads. Default model
gemma3-270m on the CPU; `model=hub model.name_or_path=DIR` runs a checkpoint folder — a hybrid's (Qwen3.5,
Nemotron-H, ...) full cache through kvbench, its states carried beside the attention layers, against transformers'
own hybrid cache.
"""

from __future__ import annotations

import time

import torch

from kvbench.bench.common import checked, header, lengths, load, options

OPTIONS = {"new_tokens": 24, "repeats": 3, "threads": 1}


def best_times(engine, lm, ids: list[int], opts: dict) -> tuple[dict, dict]:
    """Each side's best seconds over the repeats, interleaved, and its last tokens."""
    from kvbench.methods import build_method

    full, new = build_method("full"), opts["new_tokens"]

    def kvbench_run():
        gen = engine.generate(engine.prefill(ids, full.stats_request()), full, None, [], new)
        return gen.token_ids

    def transformers_run():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return out[0, len(ids) :].tolist()

    best, tokens = {"kvbench": float("inf"), "transformers": float("inf")}, {}
    for _ in range(opts["repeats"]):
        for name, fn in (("kvbench", kvbench_run), ("transformers", transformers_run)):
            start = time.perf_counter()
            with torch.inference_mode():
                tokens[name] = fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best, tokens


def main(overrides: list[str]) -> None:
    from kvbench.native.engine import Engine

    opts, overrides = options(overrides, OPTIONS, "vs_generate")
    spec, _ = checked(overrides, "method=full", "model=gemma3-270m", "device=cpu", "task.context_lengths=[2048]")
    torch.set_num_threads(opts["threads"])
    lm = load(spec)
    torch.set_num_threads(opts["threads"])
    engine = Engine(lm)
    header("vs_generate", lm)
    for length in lengths(spec):
        low = min(100, lm.config.vocab_size // 2)
        ids = torch.randint(
            low, min(20000, lm.config.vocab_size), (length,), generator=torch.Generator().manual_seed(0)
        )
        best, tokens = best_times(engine, lm, ids.tolist(), opts)
        mine, theirs = tokens["kvbench"], tokens["transformers"]
        same = mine[: len(theirs)] == theirs[: len(mine)]
        print(f"{length}-token prompt, {opts['new_tokens']} new")
        print(f"kvbench full cache   {best['kvbench']:.3f} s")
        print(f"transformers generate {best['transformers']:.3f} s")
        counts = f"{len(mine)} vs {len(theirs)} tokens"  # kvbench stops at end-of-turn ids
        print(f"ratio {best['kvbench'] / best['transformers']:.3f}   tokens identical: {same} ({counts})")
