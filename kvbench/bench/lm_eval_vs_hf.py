"""kvbench's lm-eval model at the full cache against lm-eval's own `hf` model, same weights, same tasks.

    python -m kvbench.bench lm_eval_vs_hf [overrides]     # e.g. limit=4 'bench.tasks=[kvbench_qa]'

Loads the model's transformers folder (the bundled model's converted directory, ~/.cache/kvbench/<model>/
transformers-<version>, made here on first use; `model=hub model.name_or_path=DIR`: that folder) with `hf`, and the
same folder with `kvbench` (method=full), runs lm-eval's evaluator on the offline fixture tasks (`bench.tasks`,
default kvbench_qa and kvbench_mc from `bench.include_path`, tests/fixtures/lm_eval; run from the repository root;
`limit=N` documents each), and prints each task's metrics side by side, how many responses are identical and the
largest log-likelihood difference. Default dtype float32 on the CPU.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvbench import KvbenchError
from kvbench.bench.common import checked, header, load, options

OPTIONS = {"tasks": ["kvbench_qa", "kvbench_mc"], "include_path": "tests/fixtures/lm_eval"}


def folder_of(spec) -> Path:
    """The model's transformers folder (config.json beside its weights), or one line naming how to get one."""
    from kvbench.model.conversion import converted_dir

    path = Path(spec.model.get("name_or_path") or converted_dir(str(spec.model.get("name"))))
    if not (path / "config.json").is_file():
        raise KvbenchError(
            f"model={spec.model.get('name')} has no transformers folder ({path}): use a converted model "
            "(model=smollm2-135m) or model=hub model.name_or_path=DIR"
        )
    return path


def compare(name: str, hf: dict, kv: dict) -> None:
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


def main(overrides: list[str]) -> None:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    opts, overrides = options(overrides, OPTIONS, "lm_eval_vs_hf")
    spec, _ = checked(overrides, "method=full", "dtype=float32", "device=cpu")
    if not Path(opts["include_path"]).is_dir():
        raise KvbenchError(f"bench.include_path={opts['include_path']}: no such folder (run from the repository root)")
    lm = load(spec)  # converts the bundled model on first use
    path = folder_of(spec)
    header("lm_eval_vs_hf", lm, str(path))
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from kvbench.integrations.lm_eval_model import from_model_args

    def evaluate(model):
        tasks = TaskManager(include_path=opts["include_path"], include_defaults=False).load(opts["tasks"])
        start = time.perf_counter()
        out = evaluator.evaluate(model, tasks, limit=spec.limit, bootstrap_iters=0, log_samples=True)
        return out, time.perf_counter() - start

    args = {"pretrained": str(path), "dtype": spec.dtype, "device": spec.device}
    hf, hf_s = evaluate(HFLM(**args, batch_size=1))
    kv, kv_s = evaluate(from_model_args(args))
    for name in opts["tasks"]:
        compare(name, hf, kv)
    print(f"evaluator time (one run, shared CPU): hf {hf_s:.0f} s, kvbench {kv_s:.0f} s")
