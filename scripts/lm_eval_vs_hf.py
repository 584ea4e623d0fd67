"""kvbench's lm-eval model at the full cache against lm-eval's own `hf` model, same weights, same tasks, fp32.

    python scripts/lm_eval_vs_hf.py [--limit N] [--tasks kvbench_qa,kvbench_mc] [--include_path DIR]

Loads the bundled model's converted directory (~/.cache/kvbench/smollm2-135m/transformers-<version>, `python -m kvbench` creates it) with
`hf`, and the same directory with `kvbench` (method=full), runs lm-eval's evaluator on the offline fixture tasks
(tests/fixtures/lm_eval; run from the repository root), and prints each task's metrics side by side, how many
generations are identical and the largest log-likelihood difference.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--tasks", default="kvbench_qa,kvbench_mc")
    parser.add_argument("--include_path", default="tests/fixtures/lm_eval")
    args = parser.parse_args()

    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from kvbench.integrations.lm_eval_model import from_model_args
    from kvbench.model.load import converted_dir

    path = str(converted_dir("smollm2-135m"))
    names = args.tasks.split(",")

    def evaluate(lm):
        tasks = TaskManager(include_path=args.include_path, include_defaults=False).load(names)
        start = time.perf_counter()
        out = evaluator.evaluate(lm, tasks, limit=args.limit, bootstrap_iters=0, log_samples=True)
        return out, time.perf_counter() - start

    hf, hf_s = evaluate(HFLM(pretrained=path, dtype="float32", device="cpu", batch_size=1))
    kv, kv_s = evaluate(from_model_args({"pretrained": path, "dtype": "float32", "device": "cpu"}))
    for name in names:
        metrics = [k for k in hf["results"][name] if "," in k and "stderr" not in k]
        print(
            f"{name}: "
            + ", ".join(f"{m} hf {hf['results'][name][m]:.4f} kvbench {kv['results'][name][m]:.4f}" for m in metrics)
        )
        same, n, worst = 0, 0, 0.0
        for a, b in zip(hf["samples"][name], kv["samples"][name], strict=True):
            for ra, rb in zip(a["resps"], b["resps"], strict=True):
                n += 1
                if isinstance(ra[0], str):
                    same += ra[0] == rb[0]
                else:
                    same += ra[0][1] == rb[0][1]  # is_greedy
                    worst = max(worst, abs(ra[0][0] - rb[0][0]))
        print(f"  {same}/{n} responses identical (texts, or greedy flags); max |Δ loglikelihood| {worst:.2e}")
    print(f"evaluator time (one run, shared CPU): hf {hf_s:.0f} s, kvbench {kv_s:.0f} s")


if __name__ == "__main__":
    main()
