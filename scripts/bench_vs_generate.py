"""kvbench's own time for one example with the full cache vs plain transformers `generate` on the same prompt.

The harness's overhead over the model's plain forward and decode: kvbench's prefill (logits of the last position
only: a 262K vocabulary must not cost a full-length logits tensor) + greedy decode, against
`model.generate(max_new_tokens=N, do_sample=False)` with transformers' own cache, interleaved, best of `--repeats`,
the ratio printed. Tokens are checked equal.

    python scripts/bench_vs_generate.py [--model gemma3-270m] [--tokens 2048] [--new 24] [--repeats 3] [--threads 1]

`--model` is a conf/model name or a checkpoint folder (model=hub): a hybrid's (Qwen3.5, Nemotron-H, ...) full cache
through kvbench — its states carried beside the attention layers — against transformers' own hybrid cache.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch
from omegaconf import OmegaConf

from kvbench import conf_dir
from kvbench.engine.engine import Engine
from kvbench.methods import build_method
from kvbench.model.load import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    named = conf_dir() / "model" / f"{args.model}.yaml"
    section = (
        OmegaConf.load(named)
        if named.exists()
        else OmegaConf.merge(OmegaConf.load(conf_dir() / "model" / "hub.yaml"), {"name_or_path": args.model})
    )
    lm = load_model(section, "cpu", args.dtype)
    torch.set_num_threads(args.threads)
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name'"], capture_output=True, text=True).stdout.split(":")[
        -1
    ]
    ids = torch.randint(100, 20000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    engine, full = Engine(lm), build_method("full")

    def kvbench_run():
        gen = engine.generate(engine.prefill(ids, full.stats_request()), full, None, [], args.new)
        return gen.token_ids

    def transformers_run():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
        return out[0, len(ids) :].tolist()

    best = {"kvbench": float("inf"), "transformers": float("inf")}
    tokens = {}
    for _ in range(args.repeats):
        for name, fn in (("kvbench", kvbench_run), ("transformers", transformers_run)):
            start = time.perf_counter()
            with torch.inference_mode():
                tokens[name] = fn()
            best[name] = min(best[name], time.perf_counter() - start)
    same = tokens["kvbench"][: len(tokens["transformers"])] == tokens["transformers"][: len(tokens["kvbench"])]
    print(
        f"{args.model} {lm.dtype} on {cpu.strip()}, {args.threads} thread(s): "
        f"{args.tokens}-token prompt, {args.new} new"
    )
    print(f"kvbench full cache   {best['kvbench']:.3f} s")
    print(f"transformers generate {best['transformers']:.3f} s")
    counts = f"{len(tokens['kvbench'])} vs {len(tokens['transformers'])} tokens"  # kvbench stops at end-of-turn ids
    print(f"ratio {best['kvbench'] / best['transformers']:.3f}   tokens identical: {same} ({counts})")


if __name__ == "__main__":
    main()
