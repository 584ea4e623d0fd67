"""The rows of one example: `row_for` is the one row builder (every task kind's rows go through it);
`generation_row` turns a generated answer into its row; `generation_rows` runs an example's configurations through
the engine (one shared prefill), `stream_rows` a perplexity stream. `RowContext` is what every row of a run shares,
built once per run (kvbench.run.example_work)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kvbench.methods.modes import HooksPrefill
from kvbench.model.attention import StatsRequest
from kvbench.native import fidelity, inline
from kvbench.native.bandwidth import share_columns
from kvbench.native.batched import batch_columns, step_kv_bytes
from kvbench.native.engine import Engine, Generation
from kvbench.native.grid_decode import MAX_PADDING
from kvbench.rows.configuration import Configuration
from kvbench.tasks import Example, Task


@dataclass
class RowContext:
    """What every row of a run shares: the engine and its model, the task, the columns every row records
    (provenance, run id, the prefill setting), and the modes that shape how an example becomes rows."""

    engine: Engine
    task: Task
    common: dict  # columns of every row (kvbench.run.runner: provenance, run_id, seed, modes' row keys)
    diagnose: Any = None  # diagnose=true: the verdict Thresholds (kvbench.guide.diagnose_run); rows gain its columns
    side: list = field(default_factory=list)  # diagnose=true: per-(layer, KV head) records, written beside the rows
    prefill: str = "shared"  # shared | inline (kvbench.native.inline)
    prefill_chunk: int | None = None
    grid_batch: bool = False  # a grid's configurations of one example decoded together (kvbench.native.grid_decode)
    grid_padding: float = MAX_PADDING
    serving_engine: Any = None  # engine=<serving engine>: its started ServingEngine (kvbench.engines; `engine_rows`)
    fidelity: bool = True  # generating rows gain the fidelity columns (kvbench.native.fidelity)
    bandwidth: float = math.nan  # the machine's memory read bandwidth, bytes/s (kvbench.native.bandwidth)

    @property
    def lm(self):
        return self.engine.lm


def row_for(c: Configuration, ex: Example, ctx: RowContext, **measured) -> dict:
    """The one builder of a result row: provenance and what ran (configuration `c`, example `ex`, the run's task and
    model, shared by every task kind) + the measured columns. kvbench.store.results.COLUMNS lists what every row has."""
    lm = ctx.lm
    return {
        **ctx.common,
        "config_hash": c.hash,
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "model": lm.name,
        "task": ctx.task.name,
        "subset": ex.subset,
        "method": c.method.name,
        "budget": c.budget_value,
        "method_params": json.dumps(c.method.params(), sort_keys=True),
        "query_aware": c.query_aware,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "reused": False,
        # a hybrid's linear/Mamba/conv states per request (in kv_bytes and kv_bytes_full; 0 for attention-only models)
        "state_bytes": ctx.engine.full_layout.state_bytes(),
        **measured,
        **ex.meta,
    }


def generation_row(c: Configuration, ex: Example, ctx: RowContext, gen: Generation) -> dict:
    """The row of one generated answer, scored by the task."""
    task = ctx.task
    return row_for(
        c,
        ex,
        ctx,
        example_id=ex.example_id,
        context_tokens=gen.context_tokens,
        new_tokens=len(gen.token_ids),
        metric=task.metric_of(ex),
        prediction=gen.text,
        answers=json.dumps(ex.answers),
        kv_bytes=gen.kv_bytes,
        kv_bytes_full=gen.kv_bytes_full,
        kv_bytes_full_dense=gen.kv_bytes_full_dense,
        kv_ratio=gen.kv_ratio,
        kv_bytes_mha=gen.kv_bytes_mha,
        peak_mem_bytes=gen.peak_mem_bytes,
        peak_mem_delta_bytes=gen.peak_mem_delta_bytes,
        prefill_s=gen.prefill_s,
        decode_s=gen.decode_s,
        decode_ms_per_token=gen.decode_ms_per_token,
        **batch_columns(gen),
        **decode_share(ctx, gen.decode_s, gen.decode_steps, step_kv_bytes(gen)),
        **nominal_columns(c, gen),
        **task.score(gen.text, ex),
    )


def decode_share(ctx: RowContext, decode_s: float, steps: int, kv_bytes: int) -> dict:
    """`step_bytes` and `bandwidth_share` of a decoding row (kvbench.native.bandwidth): the weights and the K/V one
    step reads, at the row's step time, over the machine's bandwidth."""
    step_s = decode_s / steps if steps else math.nan
    return share_columns(ctx.engine.weight_bytes, kv_bytes, step_s, ctx.bandwidth)


def nominal_columns(c: Configuration, gen: Generation) -> dict:
    """`kv_ratio_nominal` for methods that claim a ratio apart from what is measured (kvpress's presses)."""
    if not isinstance(c.method, HooksPrefill):
        return {}
    return {"kv_ratio_nominal": c.method.kv_ratio_nominal(gen.context_tokens, gen.decode_steps)}


def generation_rows(ctx: RowContext, todo: list[Configuration], ex: Example, prefill=None) -> list[dict]:
    """One prefill serves every configuration that shares it; methods that change the model get their own.

        `prefill(ids, request)` replaces engine.prefill for the shared one (the prefix cache: kvbench.run.requests).
        With ctx.prefill=inline every configuration prefills on its own, compressing inside the forward pass
        (kvbench.native.inline). ctx.grid_batch: the configurations sharing the prefill decode together where their
        caches allow (kvbench.native.grid_decode), in batches holding at most ctx.grid_padding × their own cache bytes;
        rows are the same, timings the batch's. ctx.diagnose: rows gain the diagnostic columns and the per-(layer,
        KV head) records go to ctx.side. With ctx.fidelity every row gains the fidelity columns
    (kvbench.native.fidelity), computed after every row is measured."""
    engine, diagnose = ctx.engine, ctx.diagnose
    prompt_ids, suffix_ids = ex.split(todo[0].query_aware)
    mode, chunk = ctx.prefill, ctx.prefill_chunk
    shared = [c for c in todo if c.method.caps.shares_prefill and mode == "shared"]
    request = StatsRequest()
    for c in shared:
        request = request | c.method.stats_request()
    prefill = (prefill or engine.prefill)(prompt_ids, request) if shared else None
    rows, together = [], {}
    if ctx.grid_batch and len(shared) > 1 and diagnose is None and prefill.adopt is None:  # type: ignore[union-attr]
        from kvbench.native.grid_decode import generate_grid  # configurations of this example decoded as one batch

        confs = [(c.method, c.budget) for c in shared]
        gens = generate_grid(
            engine, prefill, confs, suffix_ids, ex.max_new_tokens, ex.stop, ctx.grid_padding, keep_logits=ctx.fidelity
        )
        together = {id(c): gen for c, gen in zip(shared, gens)}
    runs = []  # how each row's cache can be rebuilt for its fidelity columns (kvbench.native.fidelity)
    for c in todo:
        if id(c) in together:
            gen = together[id(c)]
            rows.append(generation_row(c, ex, ctx, gen))
            runs.append(fidelity.Ran(c.method, c.budget, engine, prefill, gen))
            continue
        own = engine if c.method.caps.shares_prefill else engine.prepared(c.method)
        if isinstance(c.method, HooksPrefill):  # kvpress: prefill and decode under its own hooks
            gen = own.hooked_generate(c.method, c.budget, prompt_ids, suffix_ids, ex.max_new_tokens, ex.stop)
            rows.append(generation_row(c, ex, ctx, gen))
            runs.append(fidelity.Ran(c.method, c.budget, own, None, gen))
            continue
        if mode == "inline":
            source = inline.prefill(own, c.method, c.budget, prompt_ids, chunk)
        elif prefill is not None and c.method.caps.shares_prefill:
            source = prefill
        else:
            source = own.prefill(prompt_ids, c.method.stats_request())
        start = own.compressed(source, c.method, c.budget, suffix_ids, ex.max_new_tokens)  # Engine.generate, with
        kept = own.logits_buffer(start, ex.max_new_tokens) if ctx.fidelity else None  # what fidelity reads
        gen = own.decode(start, c.method, ex.max_new_tokens, ex.stop, logits_buffer=kept)
        rows.append(generation_row(c, ex, ctx, gen))
        runs.append(fidelity.Ran(c.method, c.budget, own, None if mode == "inline" else source, gen))
    if ctx.fidelity:
        fidelity.add_columns(rows, runs, engine, prefill, prompt_ids, suffix_ids, ex.max_new_tokens, ex.stop)
    if diagnose is not None:
        from kvbench.guide.diagnose_run import diagnose_example

        ctx.side.extend(diagnose_example(engine, todo, ex, ctx.task, prefill, rows, diagnose))
    return rows


def stream_rows(ctx: RowContext, c: Configuration, ex: Example) -> list[dict]:
    """Perplexity tasks: one row per window of the streamed text (see kvbench.native.streaming)."""
    from kvbench.native.streaming import stream_budget, stream_perplexity

    engine, task = ctx.engine, ctx.task
    ids, chunk = ex.context_ids, task.chunk  # type: ignore[attr-defined]  # a stream task's step (tasks/ppl.py)
    budget = stream_budget(c.budget, len(ids))  # fraction of the text → tokens
    windows = stream_perplexity(  # headmerge: its model; prefill=inline bounds each layer inside the forward
        engine.prepared(c.method), c.method, budget, ids, chunk, inline=ctx.prefill == "inline"
    )
    rows, nll, predicted = [], 0.0, 0
    for w, row_id in zip(windows, task.row_ids(ex)):
        nll, predicted = nll + w.nll_sum, predicted + w.n_predicted
        row = row_for(
            c,
            ex,
            ctx,
            example_id=row_id,
            context_tokens=w.tokens_seen,
            new_tokens=w.n_predicted,
            metric=task.metric,
            prediction="",
            answers="[]",
            score=w.perplexity,
            kv_bytes=w.kv_bytes,
            kv_bytes_full=w.kv_bytes_full,
            kv_bytes_full_dense=w.kv_bytes_full_dense,
            kv_ratio=w.kv_bytes / w.kv_bytes_full,
            peak_mem_bytes=w.peak_mem_bytes,
            peak_mem_delta_bytes=w.peak_mem_delta_bytes,
            prefill_s=w.seconds,
            decode_s=0.0,
            decode_ms_per_token=1000 * w.seconds / max(1, w.n_predicted),
            window=w.index,
            cache_tokens=w.cache_tokens,
            perplexity_so_far=math.exp(nll / predicted),
        )
        rows.append(row)
    return rows


def engine_rows(ctx: RowContext, todo: list[Configuration], ex: Example) -> list[dict]:
    """Each configuration's row from a serving engine (kvbench.engines): the whole prompt through the engine's own
    process, greedy. kv_bytes is what the engine holds for the sequence, kv_bytes_full the same engine's uncompressed
    cache at the same tokens (its own baseline); the dense and MHA byte baselines are kvbench's accounting, not the
    engine's: left empty. The answer is cut at the task's stop strings as kvbench's engine cuts it.

    engine_extra keeps the generated ids (`token_ids`); the `full` row also carries `parity`: kvbench's own full
    cache run greedily on the same token ids (`engine_parity`). `engine_invalid` is the serving engine's reason when the
    generation is known to be garbage (kept out of every average), "" otherwise."""
    from kvbench.engines.base import EngineRequest

    prompt = ex.context_ids + ex.question_ids
    rows = []
    for c in todo:
        budget = None if c.budget is None else c.budget.value
        request = EngineRequest(prompt, ex.max_new_tokens, c.method.name, c.method.params(), budget, [])
        request.stop_ids = sorted(int(t) for t in ctx.engine.eos_ids if isinstance(t, int))
        gen = ctx.serving_engine.generate(request)
        text = ctx.engine.answer_text(gen.token_ids, ex.stop)
        rows.append(
            row_for(
                c,
                ex,
                ctx,
                example_id=ex.example_id,
                context_tokens=len(prompt),
                new_tokens=len(gen.token_ids),
                metric=ctx.task.metric_of(ex),
                prediction=text,
                answers=json.dumps(ex.answers),
                kv_bytes=gen.kv_bytes,
                kv_bytes_full=gen.kv_bytes_full,
                kv_bytes_full_dense=math.nan,
                kv_ratio=gen.kv_bytes / gen.kv_bytes_full,
                kv_bytes_mha=math.nan,
                peak_mem_bytes=gen.peak_mem_bytes,
                peak_mem_delta_bytes=None,
                prefill_s=gen.prefill_s,
                decode_s=gen.decode_s,
                decode_ms_per_token=1000 * gen.decode_s / gen.decode_steps if gen.decode_steps else math.nan,
                **decode_share(ctx, gen.decode_s, gen.decode_steps, gen.kv_bytes),  # kvbench's weights' bytes
                engine_version=gen.engine_version,
                engine_extra=json.dumps(
                    {**gen.extra, "token_ids": gen.token_ids, **engine_parity(ctx, c, prompt, ex, gen)},
                    sort_keys=True,
                    default=str,
                ),
                engine_invalid=gen.invalid or out_of_vocabulary(gen.token_ids, ctx.lm),
                **({"state_bytes": gen.extra["state_bytes"]} if "state_bytes" in gen.extra else {}),  # the engine's
                **ctx.task.score(text, ex),
            )
        )
    return rows


def out_of_vocabulary(token_ids, lm) -> str:
    """Why an engine's generation is invalid when it holds ids the model has no token for ("" when every id is one):
    such a run is broken, not a wrong answer to score 0 and average."""
    vocab = int(getattr(lm.config.get_text_config(decoder=True), "vocab_size", 0) or 0)
    outside = [t for t in token_ids if not 0 <= int(t) < vocab] if vocab else []
    if not outside:
        return ""
    return f"the engine generated {len(outside)} ids outside the model's vocabulary of {vocab:,} (e.g. {outside[0]})"


def engine_parity(ctx: RowContext, c: Configuration, prompt: list[int], ex: Example, gen) -> dict:
    """The engine's uncompressed run against kvbench's full cache on the same token ids, both greedy at the run's
    dtype: {"parity": {identical, first_divergence (the first step whose tokens differ, None when identical over
    the shorter run), compared (tokens both generated), kvbench_ids}}; {} for the engine's other options."""
    if c.method.name != "full":
        return {}
    from kvbench.methods import build_method

    ours = ctx.engine.run(build_method("full"), None, prompt, max_new_tokens=ex.max_new_tokens).token_ids
    theirs = list(gen.token_ids)
    compared = min(len(ours), len(theirs))
    step = next((i for i in range(compared) if ours[i] != theirs[i]), None)
    if step is None and len(ours) != len(theirs):  # one stopped where the other went on: they differ there
        step = compared
    return {"parity": {"identical": step is None, "first_divergence": step, "compared": compared, "kvbench_ids": ours}}
