"""The same trace served by real engines' continuous batching under the same KV budget (`serving.engines`): every
engine of kvbench.engines whose ServingEngine lists `serving_options`, each in its own venv and worker process (the
worker's `serve_trace` op drives the engine on the trace's clock: kvbench.engines.trace_driver).

The KV budget becomes the engine's whole KV space (`ServingEngine.serve` says how: a byte budget, or a block count of
the option's own block bytes). Each engine schedules, batches, chunks prefills and preempts by its own rules. Rows
are kvbench's own (kvbench.serving.metrics), with `engine` and `method` = `<engine>:<option>`; what an engine does
not tell is NaN (`ServingEngine.tells_queue` False: queueing time, preemptions and per-request blocks). Scores: the
engine's greedy ids as text, cut as kvbench cuts its own (Engine.answer_text), scored by the task.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from kvbench import KvbenchError
from kvbench.serving import OutputFailed


def servers() -> list[str]:
    """The engines that serve a trace (their ServingEngine's `serving_options`), in the order messages name them."""
    from kvbench.engines import ENGINES, listed

    return [name for name in listed() if ENGINES.get(name).serving_options]


def check_engines(value) -> dict[str, tuple[str, ...]]:
    """`serving.engines`: null, or a list of `<engine>:<option>`, each an option the engine serves a trace with;
    returns {engine: (option, ...)} in the order given."""
    from kvbench.engines import ENGINES

    if value is None or value == [] or value == {}:
        return {}
    if isinstance(value, str):
        value = [value]
    if not (isinstance(value, (list, tuple)) and all(isinstance(v, str) and v.count(":") == 1 for v in value)):
        example = ",".join(f"{name}:{o}" for name in servers()[:1] for o in ENGINES.get(name).serving_options[:2])
        raise KvbenchError(
            f"serving.engines={value!r} must be a list of <engine>:<option>; use 'serving.engines=[{example}]'"
        )
    grouped: dict[str, list[str]] = {}
    for entry in value:
        name, option = entry.split(":")
        grouped.setdefault(name, []).append(option)
    out = {}
    for name, options in grouped.items():
        if name not in servers():
            raise KvbenchError(f"serving.engines: {name} is no serving engine; use {' or '.join(servers())}")
        serving_engine = ENGINES.get(name)
        bad = [o for o in options if o not in serving_engine.serving_options]
        if bad:
            raise KvbenchError(
                f"serving.engines: {name}:{bad[0]} is not an option {name} serves a trace with; use one of "
                + ", ".join(f"{name}:{o}" for o in serving_engine.serving_options)
            )
        if not serving_engine.installed():
            raise KvbenchError(
                f"serving.engines: {name} needs {serving_engine.venv}: run `make {serving_engine.make_target}`, "
                f"or serve without it (serving.engines=null: kvbench's own scheduler only)"
            )
        out[name] = tuple(options)
    return out


def engine_need(engine: str, option: str, token_bytes_model: int, elements_per_token: int, tokens: int) -> int:
    """Bytes of the engine's KV space one request of `tokens` tokens needs: whole blocks at the option's
    precision (`ServingEngine.serving_need`)."""
    from kvbench.engines import ENGINES

    return ENGINES.get(engine).serving_need(option, token_bytes_model, elements_per_token, tokens)


def check_engine_budgets(engines: dict, shape, budgets, prompt: int, output: int) -> None:
    """Every KV budget holds the longest request in each engine's blocks (before any engine starts)."""
    token_bytes = shape.layout.full_bytes(1)
    elements = 2 * shape.n_layers * shape.n_kv_heads * shape.head_dim
    for engine, options in engines.items():
        for option in options:
            need = engine_need(engine, option, token_bytes, elements, prompt + output)
            for b in budgets:
                if b < need:
                    raise KvbenchError(
                        f"serving.kv_budget_bytes={b:,} holds not one request in {engine}:{option}'s blocks "
                        f"({prompt:,} prompt + {output} output tokens need {need:,} bytes); use "
                        f"serving.kv_budget_bytes ≥ {need:,}"
                    )


def wire(requests) -> list[dict]:
    """The trace as the workers read it: the whole prompt (context + question, and any appended suffix)."""
    return [
        {
            "id": r.request_id,
            "arrival_s": r.arrival_s,
            "prompt_ids": [*r.prompt_ids, *r.suffix_ids],
            "max_new_tokens": r.max_new_tokens,
        }
        for r in requests
    ]


def result_of(requests, reply: dict, block_bytes: int, knows_queue: bool):
    """A worker's serve_trace reply as the scheduler's ServeResult (kvbench.serving.metrics reads it)."""
    from kvbench.serving.scheduler import Served, ServeResult

    served = []
    for r, rec in zip(requests, reply["requests"]):
        if rec["status"] != "FINISHED":
            raise KvbenchError(f"the engine ended request {r.request_id} {rec['status'] or 'unfinished'}")
        s = Served(r)
        s.admitted_s = rec["admitted_s"] if knows_queue else math.nan
        s.first_token_s, s.finish_s = rec["first_token_s"], rec["finish_s"]
        s.emitted, s.emitted_s = list(rec["tokens"]), list(rec["emitted_s"])
        s.preemptions = rec["preemptions"] if knows_queue else math.nan  # type: ignore[assignment]
        s.kv_bytes = rec["blocks"] * block_bytes if knows_queue else math.nan  # type: ignore[assignment]
        s.prefill_s = math.nan  # inside the engine's steps (chunked, batched with decodes)
        s.recompute_mismatches = 0
        s.decode_mode = "engine"
        served.append(s)
    blocks = [b for _, b, _ in reply["samples"]] or [0]
    return ServeResult(
        served=served,
        samples=[(t, b * block_bytes, c) for t, b, c in reply["samples"]],
        peak_held_bytes=max(blocks) * block_bytes,
        peak_padded_bytes=max(blocks) * block_bytes,
        max_concurrency=max((c for _, _, c in reply["samples"]), default=0),
        decode_steps=reply["steps"],
        duration_s=max(s.finish_s for s in served),
        wall_s=reply["wall_s"],
        idle_skipped_s=reply["idle_skipped_s"],
    )


def serve_engines(
    ctx, engines: dict, requests, kv_budgets, confs, on_served: Callable[..., None] | None = None
) -> tuple[list[tuple[str, str, float, int, Any, dict]], list[str]]:
    """Every engine × option × KV budget: ([(engine, option, budget, kv_budget, ServeResult, reply)], skipped).
    An engine that fails (its model will not convert, its worker dies) keeps the runs it finished and is skipped
    from there with one line, so the other engines and kvbench's own rows are still written; `skipped` holds those
    lines. `ctx`: the serving run's (cfg, lm, engine) — the model config, dtype and stop ids kvbench decodes with.
    `on_served(*run)` is called with each run as it ends (so that it is written before the next one starts)."""
    from kvbench.config.rules import plain
    from kvbench.engines import ENGINES

    cfg, lm, engine = ctx
    model = (dict(plain(cfg.model)), str(lm.dtype).removeprefix("torch."))
    stop_ids = sorted(int(t) for t in engine.eos_ids if isinstance(t, int))
    evict_budget = next((c.budget_value for c in confs if c.budget is not None), 0.25)
    trace = wire(requests)
    out: list[tuple[str, str, float, int, Any, dict]] = []
    skipped: list[str] = []
    for name, options in engines.items():
        serving_engine = ENGINES.get(name)()
        progress = {"option": options[0], "served": 0}  # the option being served, and its KV budgets done
        try:
            serving_engine.serving_start(*model)
            for option in options:
                progress.update(option=option, served=0)
                budget = evict_budget if serving_engine.evicts(option) else None
                refused = serving_engine.serving_refusal(option, budget, trace)
                if refused:
                    skipped.append(f"{name}:{option} not served: {refused}")
                    print(f"[serving] {skipped[-1]}", file=sys.stderr, flush=True)
                    continue
                for kv_budget in kv_budgets:
                    print(f"[serving] {name}:{option} at {kv_budget / 1e6:.1f} MB ...", file=sys.stderr, flush=True)
                    reply, block_bytes = serving_engine.serve(option, budget, kv_budget, trace, stop_ids)
                    result = result_of(requests, reply, block_bytes, knows_queue=serving_engine.tells_queue)
                    out.append((name, option, 1.0 if budget is None else budget, kv_budget, result, reply))
                    progress["served"] += 1
                    if on_served is not None:
                        on_served(*out[-1])
        except OutputFailed:
            raise
        except KvbenchError as e:
            skipped.append(skipped_line(name, options, progress, len(kv_budgets), e))
            print(f"[serving] {skipped[-1]}", file=sys.stderr, flush=True)
        finally:
            serving_engine.close()
    return out, skipped


def skipped_line(name: str, options, progress: dict, budgets: int, error: KvbenchError) -> str:
    """The line naming an engine that failed and what it left: the option it was at (and its KV budgets left), the
    options after it."""
    left = [f"{name}:{o}" for o in options[options.index(progress["option"]) :]]
    if progress["served"]:
        left[0] += f" at {budgets - progress['served']} of {budgets} KV budgets"
    return f"{name} skipped ({', '.join(left)} not served): {error}"
