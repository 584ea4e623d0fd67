"""Prefix caching side by side: the shared-prefix workloads (`shared_doc`, `multiturn`, `system_prompt`:
kvbench/tasks/shared_prefix.py) through kvbench's prefix cache and every engine of kvbench.engines with one
(`ServingEngine.prefix_cache`; each engine's `serve_prefix` says what it keeps), each with and without its cache,
requests in order (each after the one before finished: a chat's turns need it, and a request's TTFT is then its own
prefill).

    python -m kvbench.serving.prefix                                   # smollm2-135m, the three workloads
    python -m kvbench.serving.prefix --model gemma3-270m --requests 4 --context 512 --engines <engine>

Per workload × system: requests, prompt tokens, hit rate (prompt tokens the cache supplied / prompt tokens; kvbench:
its `reused_tokens`, an engine: what it reports, NaN where it does not say: `ServingEngine.tells_hits`), total TTFT
without and with the cache and their ratio, whether every answer is the same token string as without the cache,
and the score. Then compression and reuse: kvbench's `reuse=compress_once` (SnapKV compresses the shared context
once and answers every request from it) against `per_question` (every request compresses its whole prompt beside the
cached pages), with its TTFT ratio, bytes held and score; the engines cannot reuse a compressed prefix (their
cached blocks or kept tokens are the uncompressed sequence, or their eviction and prefix cache do not combine), so
they have no such row. Timings are ratios within one run of one machine. Writes `prefix_serving.parquet` (+ `.md`)
into --out.

Exit codes: 0 done, and every system's full-cache answers are the same with its prefix cache as without; 1 some
system's full-cache answers changed with its prefix cache (the table printed and written all the same); 2 bad input
(one line, before any model loads: a flag, an engine whose venv is missing).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import pandas as pd

from kvbench import KvbenchError, conf_dir

WORKLOADS = ("shared_doc", "multiturn", "system_prompt")
COUNT_KEY = {"shared_doc": "questions", "multiturn": "turns", "system_prompt": "questions"}


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def task_overrides(args, workload: str) -> list[str]:
    return [
        f"model={args.model}",
        f"task={workload}",
        f"task.context_length={args.context}",
        f"task.{COUNT_KEY[workload]}={args.requests}",
        f"task.max_new_tokens={args.max_new_tokens}",
        f"device={args.device}",
        f"dtype={args.dtype}",
    ]


def kvbench_rows(tmp: Path, overrides: list[str]) -> pd.DataFrame:
    from kvbench.run.runner import run

    name = str(abs(hash(tuple(overrides))))
    cfg = compose([*overrides, f"results_dir={tmp / 'store'}", "report=false", "rerun=true"])
    rows = run(cfg, output_dir=tmp / name)
    return rows.sort_values("request_index")


def kvbench_side(tmp: Path, args, workload: str) -> list[dict]:
    """kvbench's prefix cache on the full cache, then compress-once vs per-question reuse for --method."""
    base = task_overrides(args, workload)
    without = kvbench_rows(tmp, [*base, "method=full"])
    with_cache = kvbench_rows(tmp, [*base, "method=full", "prefix_cache=true"])
    out = [kvbench_row(workload, "full", without, with_cache)]
    method = [f"method={args.method}", f"budget={args.budget}", "prefix_cache=true"]
    per_question = kvbench_rows(tmp, [*base, *method])
    once = kvbench_rows(tmp, [*base, *method, "reuse=compress_once"])
    per_question, once = (r[r.method == args.method] for r in (per_question, once))
    option = f"{args.method} {args.budget:g}: compress_once vs per_question"
    out.append(
        {
            **kvbench_row(workload, option, per_question, once),
            "score_without": per_question.score.mean(),
            "held_without_MB": per_question.held_bytes.iloc[-1] / 1e6,
        }
    )
    return out


def kvbench_row(workload: str, option: str, without: pd.DataFrame, reused: pd.DataFrame) -> dict:
    """One line of the prefix table from kvbench's rows of a workload run without and with reuse."""
    prompt = int((reused.reused_tokens + reused.prefill_tokens).sum())
    return {
        "workload": workload,
        "system": "kvbench",
        "option": option,
        "requests": len(reused),
        "prompt_tokens": prompt,
        "hit_rate": reused.reused_tokens.sum() / prompt,
        "ttft_without_s": without.prefill_s.sum(),
        "ttft_with_s": reused.prefill_s.sum(),
        "identical": list(without.prediction) == list(reused.prediction),
        "score": reused.score.mean(),
        "held_MB": reused.held_bytes.iloc[-1] / 1e6,
    }


def engine_requests(cfg, lm):
    """The workload's requests in order, as kvbench.serving.trace Requests (whole prompts, arrival 0)."""
    from kvbench.serving.trace import Request
    from kvbench.tasks import build_task

    task = build_task(cfg.task, lm.tokenizer, int(cfg.seed), lm.max_context)
    examples = task.examples()
    requests = [
        Request(i, 0.0, ex.context_ids + ex.question_ids, [], ex.max_new_tokens, example=ex, stop=tuple(ex.stop))
        for i, ex in enumerate(examples)
    ]
    return requests, task


def engine_row(workload, name, requests, task, engine, without: dict, with_cache: dict, hits: bool = True) -> dict:
    """`hits`: the engine reports the prompt tokens its cache supplied (`ServingEngine.tells_hits`)."""

    def ttft(reply):
        return sum(r["first_token_s"] - r["arrival_s"] for r in reply["requests"])

    tokens = [r["tokens"] for r in with_cache["requests"]]
    texts = [engine.answer_text(t, q.stop) for t, q in zip(tokens, requests)]
    prompt = sum(q.prompt_tokens for q in requests)
    cached = sum(r["cached_tokens"] for r in with_cache["requests"])
    return {
        "workload": workload,
        "system": name,
        "option": "full",
        "requests": len(requests),
        "prompt_tokens": prompt,
        "hit_rate": cached / prompt if hits else math.nan,
        "ttft_without_s": ttft(without),
        "ttft_with_s": ttft(with_cache),
        "identical": tokens == [r["tokens"] for r in without["requests"]],
        "score": sum(task.score(t, q.example)["score"] for t, q in zip(texts, requests)) / len(requests),
    }


def prefix_engines() -> list[str]:
    """The engines with a prefix cache to compare (`ServingEngine.prefix_cache`), in the order messages name them."""
    from kvbench.engines import ENGINES, listed

    return [name for name in listed() if ENGINES.get(name).prefix_cache]


def engines_side(args, workloads: list[str]) -> list[dict]:
    """Each engine of --engines (`ServingEngine.serve_prefix`): every workload's requests in order without then with its
    prefix cache."""
    from kvbench.config.rules import plain
    from kvbench.engines import ENGINES
    from kvbench.model.load import load_model
    from kvbench.native.engine import Engine
    from kvbench.serving.engines import wire

    first = compose(task_overrides(args, workloads[0]))
    lm = load_model(first.model, "cpu", args.dtype)  # its tokenizer and stop ids (the engines load their own)
    engine = Engine(lm)
    dtype = str(lm.dtype).removeprefix("torch.")
    model_cfg = dict(plain(first.model))
    stop_ids = sorted(int(t) for t in engine.eos_ids if isinstance(t, int))
    traces = {w: engine_requests(compose(task_overrides(args, w)), lm) for w in workloads}
    wired = {w: wire(requests) for w, (requests, _) in traces.items()}
    out = []
    for name in dict.fromkeys(args.engines):  # each engine once, in the order given
        serving_engine = ENGINES.get(name)()
        try:
            replies = serving_engine.serve_prefix(model_cfg, dtype, wired, stop_ids, args.kv_space)
        finally:
            serving_engine.close()
        for w, (requests, task) in traces.items():
            without, with_cache = replies[w]
            out.append(engine_row(w, name, requests, task, engine, without, with_cache, hits=serving_engine.tells_hits))
    return out


def markdown_table(table: pd.DataFrame) -> str:
    from kvbench.guide.selection import markdown

    shown = table.assign(
        hit_rate=table.hit_rate.map(lambda v: "n/a" if math.isnan(v) else f"{v:.2f}"),
        ttft_ratio=(table.ttft_with_s / table.ttft_without_s).map(lambda v: f"{v:.2f}"),
        score=table.score.map(lambda v: f"{v:.2f}"),
    )[["workload", "system", "option", "requests", "prompt_tokens", "hit_rate", "ttft_ratio", "identical", "score"]]
    return markdown(shown)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="kvbench's own runs")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--requests", type=int, default=6, help="questions (turns) per workload")
    parser.add_argument("--context", type=int, default=1024, help="tokens of the shared document")
    parser.add_argument("--max-new-tokens", type=int, default=12, help="a 7-digit answer is ~9 tokens")
    parser.add_argument("--method", default="snapkv", help="the compressing method for compress_once")
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--engines", nargs="*", default=prefix_engines(), choices=prefix_engines())
    parser.add_argument("--kv-space", type=int, default=256 << 20, help="KV space (bytes) of an engine that takes one")
    parser.add_argument("--out", default=None, help="directory for prefix_serving.parquet/.md")
    args = parser.parse_args(argv)
    for key in ("requests", "context", "max_new_tokens"):
        if getattr(args, key) < 1:
            raise KvbenchError(f"--{key.replace('_', '-')}={getattr(args, key)} must be ≥ 1")
    if not args.budget > 0:
        raise KvbenchError(f"--budget={args.budget} must be > 0 (a fraction ≤ 1 or a token count)")
    for workload in args.workloads:  # every input before the engines' venvs: a missing venv must not hide a bad flag
        check_inputs(args, workload)
    check_venvs(args.engines)
    return args


def check_inputs(args, workload: str) -> None:
    """--model, --method, --budget, --dtype, --context through kvbench's own entrance check (no model loads); a name
    Hydra cannot find is named by its flag."""
    from hydra.errors import HydraException

    from kvbench.preflight.entrance import check_config

    overrides = [*task_overrides(args, workload), f"method={args.method}", f"budget={args.budget}"]
    try:
        cfg = compose(overrides)
    except HydraException as error:
        first = str(error).strip().splitlines()[0]
        for flag, group in (("--method", "method"), ("--model", "model")):
            if f"'{group}/" in first or f"group {group}" in first or f"{group}=" in first:
                raise KvbenchError(f"{flag}={getattr(args, group)}: {first}; see conf/{group}/ for the names") from None
        raise KvbenchError(f"the configuration does not compose: {first}") from None
    try:
        check_config(cfg)
    except KvbenchError as error:  # kvbench's check names its keys (dtype=, budget=): here they are switches
        raise KvbenchError(as_switches(str(error))) from None


def as_switches(line: str) -> str:
    """A run's check line with this command's switches for the keys it sets (`dtype=x` → `--dtype x`)."""
    import re

    line = line.replace(", or budget=null", "")  # a run may unset its budget; this command always takes one
    return re.sub(r"\b(dtype|budget|model|method)=", lambda m: f"--{m.group(1)} ", line)


def check_venvs(engines: list[str]) -> None:
    """The engines' venvs, before any model loads; a missing one is named with the switch that leaves it out."""
    from kvbench.engines import ENGINES

    for name in engines:
        serving_engine = ENGINES.get(name)
        if not serving_engine.installed():
            others = " ".join(e for e in engines if e != name)
            raise KvbenchError(
                f"--engines {name} needs {serving_engine.venv}: run `make {serving_engine.make_target}`, "
                f"or leave it out (`--engines {others}`{'' if others else ': kvbench alone'})"
            )


def main(argv=None) -> int:
    try:
        args = parse(argv)
        with tempfile.TemporaryDirectory() as tmp:
            rows = [r for w in args.workloads for r in kvbench_side(Path(tmp), args, w)]
        if args.engines:
            rows += engines_side(args, args.workloads)
    except KvbenchError as error:
        print(f"kvbench.serving.prefix: error: {error}", file=sys.stderr)
        return 2
    table = pd.DataFrame(rows).sort_values(["workload", "system"], kind="stable")
    text = markdown_table(table)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        table.to_parquet(out / "prefix_serving.parquet", index=False)
        (out / "prefix_serving.md").write_text(text + "\n")
    return 0 if table.identical[table.option == "full"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
