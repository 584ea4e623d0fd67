"""Fidelity beyond a task score: how far a compressed cache's next-token distributions move from the full cache's.

Teacher-forced along the full cache's own greedy answer (llama.cpp's KL-divergence check of a KV type against f16):
both caches are fed the same tokens, so step i compares the two distributions the full answer's token i is read
from. Per row: `kl_mean`, `kl_max` and its step `kl_max_step` of KL(full ‖ compressed) in nats, `top1_agreement`
(the share of steps whose most likely token is the full cache's), `fidelity_tokens` (steps compared) and
`length_vs_full` (the row's generated tokens over the full cache's: eviction can lengthen a reasoning trace), and
`fidelity_s`, the seconds these columns cost (the full cache's row: its reference distributions).

Cost per example, nearly nothing where rows keep what they decoded from (a grid's rows and rows decoded one by one,
`fidelity=true`): the full cache's decoding is teacher forcing along its own answer, so its kept distributions are the
reference, and a row whose tokens followed that answer read its own. Only a row that left the answer pays: forced
inside its grid as a forked row (kvbench.native.grid_decode.DivergenceWatch: its distributions come with the row),
or from the copy a grid made where it left (`resume`: its own decoding before that step), else its compression
again from the shared prefill (deterministic: the cache the row decoded from), then the answer fed through it — in
one forward where that equals decoding (plain caches of one mask), else token by token as decoding feeds it
(quantized or custom layers, methods acting on decode steps); token-by-token rows that can be rows of one grid
batch (the CPU's row-independent kernels) are forced together, one step for all of them, each from its own step
(`forced_rows`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import cast

import torch
from transformers.cache_utils import DynamicLayer

from kvbench.methods import Budget, Method, build_method
from kvbench.model.attention import StatsRequest, recording
from kvbench.native.batched import Divergence
from kvbench.native.engine import Compressed, Engine, Generation, Prefill, one_forward

COLUMNS = ("kl_mean", "kl_max", "kl_max_step", "top1_agreement", "fidelity_tokens", "length_vs_full")


@torch.inference_mode()
def forced_logits(
    engine: Engine, start: Compressed, method: Method, answer: list[int], resumed: bool = False
) -> torch.Tensor:
    """(n, V) fp32: the distributions answer[0..n) are read from when `start`'s cache is fed `answer` (the cache is
    consumed). Step 0 is the compressed cache's first distribution; step i follows answer[:i]. resumed: `start` is a
    grid row's state where it left the answer (`resume`), its decoding already begun."""
    first = start.logits.float()[None]  # (1, V)
    rest, position, cache = answer[:-1], start.position, start.cache
    if not rest:
        return first
    if one_forward(method, start):
        logits = engine.forward(rest, list(range(position, position + len(rest))), cache, all_logits=True)
        return torch.cat([first, logits])  # (n, V)
    hooks = start.hooks  # this configuration's compression: its decode-time evictions
    if not resumed:  # a grid row never began one (kvbench.native.grid_decode)
        hooks.on_decode_start(cache, position)
    out = [first]
    for token in rest:
        with recording(hooks.decode_request()) as stats:
            out.append(engine.forward([token], [hooks.position(position, cache)], cache)[-1:])  # (1, V)
        hooks.on_decode_step(cache, stats)  # evictions as decoding makes them
        position += 1
    return torch.cat(out)  # (n, V)


def decoded_logits(gen: Generation, answer: list[int]) -> torch.Tensor | None:
    """(n, V) fp32: the distributions the row's own decoding read its tokens from, when they are what teacher forcing
    along `answer` gives — the row kept them (a token-by-token configuration: kvbench.native.grid_decode) and its
    first n − 1 tokens are the answer's, so forcing would feed the same tokens the same way; else None."""
    n = len(answer)
    if len(gen.logits) < n or gen.token_ids[: n - 1] != answer[: n - 1]:
        return None
    return torch.stack(gen.logits[:n]).float()  # (n, V)


def compressed_logits(
    engine: Engine,
    prefill,
    method: Method,
    budget: Budget | None,
    suffix_ids: list[int],
    answer: list[int],
    max_new_tokens: int | None = None,
) -> torch.Tensor:
    """(n, V): the configuration's cache rebuilt from `prefill` (Engine.compressed), fed `answer`. A prefix cache's
    `adopt` (kvbench.run.requests: it records each configuration's cache) is not called for the rebuilt one."""
    start = engine.compressed(replace(prefill, adopt=None), method, budget, suffix_ids, max_new_tokens)
    return forced_logits(engine, start, method, answer)


@dataclass
class Reference:
    """The full cache's distributions (n, V) as every comparison reads them, computed once per example."""

    log_p: torch.Tensor  # (n, V) fp32 log-softmax
    p: torch.Tensor  # (n, V) its probabilities
    top1: torch.Tensor  # (n,) its most likely tokens

    @classmethod
    def of(cls, full: torch.Tensor) -> Reference:
        log_p = torch.log_softmax(full.float(), -1)  # (n, V)
        return cls(log_p, log_p.exp(), full.argmax(-1))


def per_step(full: torch.Tensor | Reference, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) KL(full ‖ other) in nats and (n,) top-1 agreement (1.0 / 0.0) of logits `other` (n, V) against the full
    cache's `full` (n, V) logits or their `Reference`, step by step (diagnose's per-step columns read the same)."""
    ref = full if isinstance(full, Reference) else Reference.of(full)
    log_q = torch.log_softmax(other.float(), -1)  # (n, V)
    kl = (ref.p * (ref.log_p - log_q)).sum(-1).clamp_min(0)  # (n,) KL(p ‖ q); rounding can dip below 0
    return kl, (ref.top1 == other.argmax(-1)).float()  # (n,), (n,)


def compare(full: torch.Tensor | Reference, other: torch.Tensor) -> dict:
    """Fidelity columns of distributions `other` (n, V) logits against the full cache's (n, V) logits or their
    `Reference`."""
    kl, top1 = per_step(full, other)  # (n,), (n,)
    step = int(kl.argmax())
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl[step]),
        "kl_max_step": step,
        "top1_agreement": float(top1.mean()),
        "fidelity_tokens": int(kl.numel()),
    }


def identical(n: int) -> dict:
    """The columns of a distribution compared with itself over n steps (the full cache's own rows)."""
    return {"kl_mean": 0.0, "kl_max": 0.0, "kl_max_step": 0, "top1_agreement": 1.0, "fidelity_tokens": n}


@dataclass
class Ran:
    """One configuration of an example as it ran: `source` is the Prefill its cache was compressed from (None: the
    cache cannot be rebuilt without a prefill of its own — kvpress's hooks, prefill=inline — its KL columns stay
    empty)."""

    method: Method
    budget: Budget | None
    engine: Engine
    source: Prefill | None
    gen: Generation


@torch.inference_mode()
def add_columns(
    rows: list[dict],
    runs: list[Ran],
    engine: Engine,
    prefill: Prefill | None,
    prompt_ids: list[int],
    suffix_ids: list[int],
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
) -> None:
    """Add the fidelity columns to `rows` (one per entry of `runs`, same order) of one example whose configurations
    share `prefill` (None: none shares one; a plain prefill is made when a reference is needed). The full cache's
    answer is its row's, and its reference distributions the ones it decoded from when it kept them; without a full
    row here (reused from the store) it is decoded once. Rows that followed the answer read their own decoding; the
    others' caches are rebuilt and forced along the answer (`forced_rows`)."""
    full_run = next((r for r in runs if r.method.name == "full"), None)
    rebuild = [r for r in runs if r.source is not None and r.method.name != "full"]
    reference, start = None, time.perf_counter()
    if full_run is not None:
        answer = full_run.gen.token_ids
        reference = decoded_logits(full_run.gen, answer)  # its decoding is teacher forcing along its own answer
    if rebuild and reference is None:
        full = build_method("full")
        prefill = prefill or engine.prefill(prompt_ids, StatsRequest())
        if full_run is None:
            start_full = engine.compressed(replace(prefill, adopt=None), full, None, suffix_ids, max_new_tokens)
            answer = engine.decode(start_full, full, max_new_tokens, stop).token_ids
        reference = compressed_logits(engine, prefill, full, None, suffix_ids, answer, max_new_tokens)
    compared = Reference.of(reference) if reference is not None and rebuild else None  # what every row is read against
    shared_s = time.perf_counter() - start  # the reference's cost: charged to the full cache's row
    own = {i: decoded_logits(run.gen, answer) for i, run in enumerate(runs) if run in rebuild}
    forced, forced_s = forced_rows(
        [(i, runs[i]) for i, logits in own.items() if logits is None], suffix_ids, answer, max_new_tokens
    )
    for i, (row, run) in enumerate(zip(rows, runs)):
        row["length_vs_full"] = len(run.gen.token_ids) / len(answer)
        if run.method.name == "full":  # the reference itself
            row.update(identical(len(answer)), fidelity_s=shared_s)
        elif i in own and compared is not None:
            start = time.perf_counter()
            logits = own[i]
            columns = compare(compared, logits if logits is not None else forced[i])
            row.update(columns, fidelity_s=time.perf_counter() - start + forced_s.get(i, 0.0))


def resume(run: Ran, answer: list[int]) -> tuple[Compressed, int] | None:
    """A grid row's state where it left the answer (its `divergence`, copied when it did) and that step d: fed
    answer[d:] from there, token by token, it gives distributions d.. of forcing along the answer, its own decoding
    steps 0..d − 1 being the rest — no compression again, no steps before d. A cache fed the answer in one forward
    (`one_forward`) takes it whole from its compressed cache: the copy without its d decoded tokens (nothing evicted
    them), step 0. None: no copy (the row decoded alone, or did not leave the answer while decoded), or a model with
    window layers (their rows share a forced batch only at one position, and a window dropped tokens since): the
    row is compressed again and forced from the start with the others."""
    fork: Divergence | None = getattr(run.gen, "divergence", None)
    if fork is None or fork.step >= len(answer) or len(run.gen.logits) <= fork.step:
        return None
    run.gen.divergence = None  # type: ignore[attr-defined]  # consumed: the copy's memory goes with it
    layers = fork.cache.layers  # type: ignore[attr-defined]  # a DynamicCache
    if any(type(layer) is not DynamicLayer for layer in layers):
        return None  # window layers: rows batch only at one position — all from the start, compressed again
    begun = Compressed(
        fork.cache, run.gen.logits[fork.step], fork.position, 0, 0, 0.0, 0, compression=fork.hooks
    )  # its token `step` was read from its own distribution `step`: forcing's too (same tokens before it)
    if not one_forward(run.method, begun):
        return begun, fork.step
    for layer in layers:  # (1, H_kv, n, D) → the compressed cache's (1, H_kv, n − d, D)
        layer.keys, layer.values = layer.keys[:, :, : -fork.step or None], layer.values[:, :, : -fork.step or None]
    begun.position, begun.logits = fork.position - fork.step, run.gen.logits[0]
    return begun, 0


def forced_rows(
    todo: list[tuple[int, Ran]], suffix_ids: list[int], answer: list[int], max_new_tokens: int
) -> tuple[dict[int, torch.Tensor], dict[int, float]]:
    """The (n, V) distributions of rows that left the answer, by row index, and each one's seconds: forced inside
    their grid (`BatchedGeneration.forced`), else fed it from where they left it (`resume`) or from their caches
    rebuilt. Caches fed token by token that can be rows of one
    grid batch (kvbench.native.grid_decode: the CPU's row-independent kernels) are forced together, one step for
    all of them, each from its own step; one-forward caches and the rest one by one."""
    from kvbench.native.grid_decode import decode_grid, decodes_in_grid
    from kvbench.native.slots import decode_kernels

    def grid_rows(run: Ran, begun: Compressed) -> bool:  # bit for bit its forcing alone (kernels: row-independent)
        return decode_kernels(run.engine.lm.model) and decodes_in_grid(run.method, begun)

    runs = dict(todo)
    logits: dict[int, torch.Tensor] = {}
    seconds: dict[int, float] = {}
    steps: dict[int, int] = {}  # where each row's forcing starts: its own decoding's distributions before it
    together: dict[object, list[tuple[int, Compressed]]] = {}  # rows forced as one batch, by `batch_key`
    for i, run in todo:
        tail = getattr(run.gen, "forced", None)
        if tail is not None and len(run.gen.logits) >= tail.step:  # forced in its grid (grid_decode.DivergenceWatch)
            steps[i], logits[i], seconds[i] = tail.step, torch.stack(tail.logits).float(), tail.seconds
            continue
        start = time.perf_counter()
        resumed = resume(run, answer)
        if resumed is None:
            source = replace(cast(Prefill, run.source), adopt=None)
            resumed = run.engine.compressed(source, run.method, run.budget, suffix_ids, max_new_tokens), 0
        begun, steps[i] = resumed
        if run.engine is not todo[0][1].engine or one_forward(run.method, begun) or not grid_rows(run, begun):
            logits[i] = forced_logits(run.engine, begun, run.method, answer[steps[i] :], resumed=steps[i] > 0)
        else:
            together.setdefault(batch_key(begun), []).append((i, begun))
        seconds[i] = time.perf_counter() - start
    for batch in together.values():
        start = time.perf_counter()
        follow = [answer[steps[i] :] for i, _ in batch]
        if len(batch) == 1:
            ((i, begun),) = batch
            logits[i] = forced_logits(runs[i].engine, begun, runs[i].method, follow[0], resumed=steps[i] > 0)
        else:
            gens = decode_grid(runs[batch[0][0]].engine, [b for _, b in batch], len(answer), (), True, follow=follow)
            logits.update({i: torch.stack(gen.logits).float() for (i, _), gen in zip(batch, gens)})  # (n − step, V)
        for i, _ in batch:
            seconds[i] += (time.perf_counter() - start) / len(batch)
    for i, step in steps.items():  # (step, V) of its own decoding, then (n − step, V) forced: (n, V)
        logits[i] = torch.cat([torch.stack(runs[i].gen.logits[:step]).float(), logits[i]]) if step else logits[i]
    return logits, seconds


def batch_key(begun: Compressed) -> object:
    """Rows forced as one grid batch: any, each at its own position — except where the model has window layers,
    whose rows must stand at the same position (kvbench.native.grid_decode.GridWindowLayer)."""
    windows = any(type(layer) is not DynamicLayer for layer in begun.cache.layers)
    return begun.position if windows else None
