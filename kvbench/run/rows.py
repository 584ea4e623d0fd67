"""The rows of one example: `generation_row` turns a generated answer into its row (through
kvbench.store.results.row_for, the one row builder); `generation_rows` runs an example's configurations through the
engine (one shared prefill), `stream_rows` a perplexity stream."""

from __future__ import annotations

import json
import math

from kvbench.engine import inline
from kvbench.engine.batched import batch_columns
from kvbench.engine.engine import Engine, Generation
from kvbench.engine.grid_decode import MAX_PADDING
from kvbench.methods.modes import HooksPrefill
from kvbench.model.attention import StatsRequest
from kvbench.run.configuration import Configuration
from kvbench.store.results import row_for
from kvbench.tasks import Example


def generation_row(c: Configuration, ex: Example, task, common: dict, lm, gen: Generation) -> dict:
    """The row of one generated answer, scored by the task."""
    return row_for(
        c,
        ex,
        task,
        common,
        lm,
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
        **nominal_columns(c, gen),
        **task.score(gen.text, ex),
    )


def nominal_columns(c: Configuration, gen: Generation) -> dict:
    """`kv_ratio_nominal` for methods that claim a ratio apart from what is measured (kvpress's presses)."""
    if not isinstance(c.method, HooksPrefill):
        return {}
    return {"kv_ratio_nominal": c.method.kv_ratio_nominal(gen.context_tokens, gen.decode_steps)}


def generation_rows(
    engine: Engine,
    todo: list[Configuration],
    ex: Example,
    task,
    common: dict,
    lm,
    diagnose=None,
    side: list | None = None,
    prefill=None,
    inline_chunk: tuple[str, int | None] = ("shared", None),
    grid_batch: bool = False,
    grid_padding: float = MAX_PADDING,
) -> list[dict]:
    """One prefill serves every configuration that shares it; methods that change the model get their own.

    diagnose: verdict Thresholds when `diagnose=true` (kvbench.guide.diagnose_run): rows gain the diagnostic columns and
    the per-(layer, KV head) records are appended to `side`. `prefill(ids, request)` replaces engine.prefill for
    the shared one (the prefix cache: kvbench.run.workload). `inline_chunk` = (prefill, prefill_chunk): with
    prefill=inline every configuration prefills on its own, compressing inside the forward pass (kvbench.engine.inline).
    grid_batch: the configurations sharing the prefill decode together where their caches allow
    (kvbench.engine.grid_decode), in batches holding at most grid_padding × their own cache bytes; rows are the same,
    timings the batch's."""
    prompt_ids, suffix_ids = ex.split(todo[0].query_aware)
    mode, chunk = inline_chunk
    shared = [c for c in todo if c.method.caps.shares_prefill and mode == "shared"]
    request = StatsRequest()
    for c in shared:
        request = request | c.method.stats_request()
    prefill = (prefill or engine.prefill)(prompt_ids, request) if shared else None
    rows, together = [], {}
    if grid_batch and len(shared) > 1 and diagnose is None and prefill.adopt is None:  # type: ignore[union-attr]
        from kvbench.engine.grid_decode import generate_grid  # configurations of this example decoded as one batch

        confs = [(c.method, c.budget) for c in shared]
        gens = generate_grid(engine, prefill, confs, suffix_ids, ex.max_new_tokens, ex.stop, grid_padding)
        together = {id(c): gen for c, gen in zip(shared, gens)}
    for c in todo:
        if id(c) in together:
            gen = together[id(c)]
            rows.append(generation_row(c, ex, task, common, lm, gen))
            continue
        own = engine if c.method.caps.shares_prefill else engine.prepared(c.method)
        if isinstance(c.method, HooksPrefill):  # kvpress: prefill and decode under its own hooks
            gen = own.hooked_generate(c.method, c.budget, prompt_ids, suffix_ids, ex.max_new_tokens, ex.stop)
            rows.append(generation_row(c, ex, task, common, lm, gen))
            continue
        if mode == "inline":
            source = inline.prefill(own, c.method, c.budget, prompt_ids, chunk)
        elif prefill is not None and c.method.caps.shares_prefill:
            source = prefill
        else:
            source = own.prefill(prompt_ids, c.method.stats_request())
        gen = own.generate(source, c.method, c.budget, suffix_ids, ex.max_new_tokens, ex.stop)
        rows.append(generation_row(c, ex, task, common, lm, gen))
    if diagnose is not None:
        from kvbench.guide.diagnose_run import diagnose_example

        side.extend(diagnose_example(engine, todo, ex, task, prefill, rows, diagnose))  # type: ignore[union-attr]  # given with diagnose
    return rows


def stream_rows(engine: Engine, c: Configuration, ex: Example, task, common: dict, lm) -> list[dict]:
    """Perplexity tasks: one row per window of the streamed text (see kvbench.engine.streaming)."""
    from kvbench.engine.streaming import stream_budget, stream_perplexity

    ids = ex.context_ids
    budget = stream_budget(c.budget, len(ids))  # fraction of the text → tokens
    windows = stream_perplexity(  # headmerge: its model; prefill=inline bounds each layer inside the forward
        engine.prepared(c.method), c.method, budget, ids, task.chunk, inline=common["prefill"] == "inline"
    )
    rows, nll, predicted = [], 0.0, 0
    for w, row_id in zip(windows, task.row_ids(ex)):
        nll, predicted = nll + w.nll_sum, predicted + w.n_predicted
        row = row_for(
            c,
            ex,
            task,
            common,
            lm,
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
