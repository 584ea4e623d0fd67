"""Batched decoding: B examples prefilled together, compressed together, decoded together (`batch_size`).

Examples batch together when their prompts (and appended questions) have the same token count — NIAH examples of
one context length do; others form smaller batches. Equal prompts make every row's cache the same length in every
layer, so the cache is the batch-1 cache stacked along B: each row's selection, quantization groups and positions
are exactly what it gets alone (a method's `compress` and decode hooks work on (B, H_kv, T, D) as on B = 1), and
no padding or masking of the cache is needed. Rows that finish early (EOS, stop string, max_new_tokens) keep
feeding their last token so the caches stay aligned; what they produce afterwards is masked out of their output.

Each row records `batch_size` (the rows decoded together), `decode_tokens_per_s` (the batch's generated tokens per
decode second), `latency_s` (its prefill + decode until it finished), `kv_bytes` at its own last step (the batch's
cache / B: every tensor has B as its leading dimension), and the batch's prefill time and peak memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvbench.methods import Budget, Method
from kvbench.methods.compression import Compression
from kvbench.model.attention import StatsRequest, recording
from kvbench.model.cache import cache_kv, cache_nbytes, one_mask
from kvbench.native.engine import Engine, Generation, Prefill
from kvbench.native.memory import read_peak, reset_peak, synchronize


@dataclass
class BatchedGeneration(Generation):
    batch_size: int = 1
    decode_tokens_per_s: float = float("nan")  # the whole batch's
    latency_s: float = float("nan")  # this request: prefill + decode until it finished
    batch_kv_bytes: int = 0  # every row's cache at the end: what one step of the batch reads besides the weights
    # a grid row that left the reference row's answer (kvbench.native.grid_decode `reference`): its cache and
    # decode-time state as they stood when it did, for fidelity's forced continuation (no recompression)
    divergence: Divergence | None = None
    # a grid row that left the reference row's answer, forced along it inside the grid itself (a forked row)
    forced: ForcedTail | None = None


@dataclass
class Divergence:
    """A row's state at the step its token first differed from the reference row's: `step` (its generated token
    `step` is the first that differs), a copy of its cache and of its compression's decode-time state, and the
    position of the next token — fed the reference's token `step` from here, it is the row teacher-forced along
    the reference's answer."""

    step: int
    cache: object  # a transformers DynamicCache of batch 1
    hooks: Compression
    position: int


@dataclass
class ForcedTail:
    """A grid row's teacher-forced continuation, computed as another row of its grid (kvbench.native.grid_decode
    `DivergenceWatch`): from its distribution `step` on (its own decoding's before it), the distributions forcing it
    along the reference row's answer gives, and `seconds`, the forked row's share of the steps it was in (each
    step's seconds over the rows then in the batch)."""

    step: int
    logits: list[torch.Tensor]  # (V,) each
    seconds: float


@dataclass
class Fork:
    """A row `decode_together`'s watch added to the batch as its last row (the cache already holds it): a copy of
    row `parent` as it stands, fed row `lead`'s tokens from the next step on — teacher forcing along `lead`'s
    answer — and done when `lead` is."""

    parent: int
    lead: int


@torch.inference_mode()
def forward_batch(engine: Engine, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """ids, positions (B, n) → fp32 logits (B, V) at each row's last position, appending to `cache`."""
    out = engine.lm.model(
        input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{engine.lm.cache_kwarg: cache}
    )
    return out.logits[:, -1].float()  # (B, V)


@torch.inference_mode()
def prefill_batch(engine: Engine, prompts: list[list[int]], request: StatsRequest) -> Prefill:
    """One forward of B equal-length prompts; the Prefill holds (B, H_kv, T, D) K/V and (B, H_q, T) statistics."""
    from transformers import DynamicCache

    device = engine.lm.device
    ids = torch.tensor(prompts, device=device)  # (B, T)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)  # (B, T)
    cache = DynamicCache()
    reset_peak(device)
    synchronize(device)
    start = time.perf_counter()
    with recording(request) as stats:
        logits = forward_batch(engine, ids, positions, cache)  # (B, V)
    synchronize(device)
    seconds = time.perf_counter() - start
    engine._check_recorded(request, stats, len(cache.layers))
    return Prefill(cache_kv(cache), stats, logits, seconds, read_peak(device))


@torch.inference_mode()
def generate_batch(
    engine: Engine,
    prefill: Prefill,
    method: Method,
    budget: Budget | None,
    suffixes: list[list[int]],
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    keep_logits: bool = False,
) -> list[BatchedGeneration]:
    """Compress the batch's prefill with `method`, append each row's suffix, decode greedily until every row is
    done; one BatchedGeneration per row, equal to what `Engine.generate` gives that row alone."""
    device, lm = engine.lm.device, engine.lm
    n_rows = prefill.kv[0][0].shape[0]
    reset_peak(device)
    start = time.perf_counter()
    method.bind(lm)
    hooks = method.begin(prefill.n_tokens, len(prefill.kv), budget)  # the batch's compression: its decode hooks
    cache = hooks.run(prefill.kv, prefill.stats)
    logits, position = prefill.last_logits, prefill.n_tokens  # (B, V)
    if suffixes and suffixes[0]:
        logits = _extend_batch(engine, cache, hooks, torch.tensor(suffixes, device=device), position)
        position += len(suffixes[0])
    synchronize(device)
    others = sum(prefill.stats.seconds.values()) - prefill.stats.seconds_for(method.stats_request())
    prefill_s = prefill.seconds - others + time.perf_counter() - start
    compress_peak = read_peak(device)

    hooks.on_decode_start(cache, position)  # every row decodes one token per step, unpadded: as Engine.decode
    done = decode_together(
        engine,
        cache,
        logits,
        position,
        positions=lambda p, n: torch.full((n, 1), hooks.position(p, cache), device=device),  # (B, 1)
        request=lambda live: hooks.decode_request(),
        after_step=lambda stats, live: hooks.on_decode_step(cache, stats),
        row_bytes=lambda row: cache_nbytes(cache) // n_rows,  # every tensor has B as its leading dimension
        max_new_tokens=max_new_tokens,
        stop=stop,
        keep_logits=keep_logits,
    )
    peak = max(prefill.peak_mem_bytes, compress_peak, done.peak)
    generated, kept, finish_steps, finish_bytes, finish_s = (
        done.generated,
        done.logits,
        done.steps,
        done.nbytes,
        done.seconds,
    )

    rows = []
    for row in range(n_rows):
        text = engine.answer_text(generated[row], stop)
        context = prefill.n_tokens + len(suffixes[row] if suffixes else [])
        tokens_if_full = context + finish_steps[row]
        rows.append(
            BatchedGeneration(
                token_ids=generated[row],
                text=text,
                context_tokens=context,
                prefill_s=prefill_s,
                decode_s=finish_s[row],
                decode_steps=finish_steps[row],
                kv_bytes=finish_bytes[row],
                **engine.baselines(tokens_if_full),
                peak_mem_bytes=peak,
                logits=kept[row],
                batch_size=n_rows,
                decode_tokens_per_s=done.tokens_per_s,
                batch_kv_bytes=sum(finish_bytes),
                latency_s=prefill_s + finish_s[row],
            )
        )
    return rows


@dataclass
class Decoded:
    """What `decode_together` produced for each row, and the batch's decode time and peak memory."""

    generated: list[list[int]]
    logits: list[list[torch.Tensor]]
    steps: list[int]  # decode steps until the row finished
    seconds: list[float]  # the batch's decode wall time until the row finished
    nbytes: list[int]  # the row's cache bytes when it finished
    decode_s: float
    peak: int
    shares: dict[int, float] = field(default_factory=dict)  # a forked row's share of its steps' seconds

    @property
    def tokens_per_s(self) -> float:
        """The batch's generated tokens (decode steps of every row but the forked ones) per second of its decode."""
        steps = sum(n for row, n in enumerate(self.steps) if row not in self.shares)
        return steps / self.decode_s if self.decode_s > 0 else float("nan")


@torch.inference_mode()
def decode_together(
    engine: Engine,
    cache,
    logits: torch.Tensor,
    position: int,
    positions,
    request,
    after_step,
    row_bytes,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    keep_logits: bool = False,
    drop_rows=None,
    recorder=None,
    follow: list[list[int]] | None = None,
    watch=None,
    measure_peak: bool = True,
) -> Decoded:
    """Greedy decoding of B rows in one batch from `logits` (B, V) at the prompt's end, until every row is done.

    Each row stops as `Engine.generate` stops alone (max_new_tokens, an end-of-turn id, a stop string). Finished
    rows keep feeding their last token (the cache stays one batch; what they produce is masked out), unless
    `drop_rows(keep)` is given: it removes them from the cache (batch indices `keep` stay) and the batch shrinks;
    it may return the kept indices in a new batch order (the grid moves a row into a hole instead of copying all).
    `live`: the rows still in the batch (original indices, in batch order). positions(p, n) → (n, 1) RoPE positions
    of the next step at absolute position p; request(live) → the StatsRequest the step records; after_step(stats,
    live) after each forward (decode-time eviction); recorder(request, live) → the StatsRecorder to record with
    (default: every row); row_bytes(row) → a row's cache bytes, read when it finishes. follow: teacher forcing —
    row r is fed follow[r] instead of its own tokens (kvbench.native.fidelity) and stops after len(follow[r]).
    watch(generated, live) after the first tokens and after each step's (a grid's divergence copies): its time is
    not the decode's; the `Fork`s it returns are rows it added to the cache, which join the batch as new rows
    (indices from n_rows on) — each one's share of the steps it is in is `Decoded.shares`. measure_peak=False:
    `Decoded.peak` is 0 and the peak is not reset — a grid's rows report their compression's peak, and on the CPU
    the reset's malloc_trim would make the steps fault their buffers in again."""
    device, tokenizer = engine.lm.device, engine.lm.tokenizer
    n_rows = logits.shape[0]

    def fed(rows: list[int], step: int) -> torch.Tensor:  # (B_live,) the forced tokens of step `step`
        assert follow is not None
        return torch.tensor([follow[row][min(step, len(follow[row]) - 1)] for row in rows], device=device)

    tokens = logits.argmax(-1) if follow is None else fed(list(range(n_rows)), 0)  # (B,)
    generated = [[int(t)] for t in tokens]
    kept = [[row] for row in logits] if keep_logits else [[] for _ in range(n_rows)]
    done = [False] * n_rows
    steps, finish_steps, finish_bytes, finish_s = 0, [0] * n_rows, [0] * n_rows, [0.0] * n_rows
    if measure_peak:
        reset_peak(device)
    start, paused = time.perf_counter(), 0.0

    leads: dict[int, int] = {}  # a forked row → the row whose tokens it is fed
    shares: dict[int, float] = {}

    def watched(live: list[int]) -> float:  # seconds spent in `watch`; its forks join the batch (live grows)
        nonlocal tokens
        if watch is None:
            return 0.0
        begun = time.perf_counter()
        for fork in watch(generated, live) or ():
            row, lead = len(generated), live.index(fork.lead)
            leads[row], shares[row] = fork.lead, 0.0
            generated.append([int(tokens[lead])])  # what the lead read from this step: the fork is fed it next
            kept.append([kept[fork.parent][-1]])  # the parent's distribution of this step: its first
            done.append(False)
            finish_steps.append(0)
            finish_bytes.append(0)
            finish_s.append(0.0)
            live.append(row)
            tokens = torch.cat([tokens, tokens[lead : lead + 1]])  # (B_live,)
        return time.perf_counter() - begun

    def finished(row: int) -> bool:
        if row in leads:
            return done[leads[row]]
        out = generated[row]
        limit = max_new_tokens if follow is None else len(follow[row])
        if len(out) >= limit or (follow is None and out[-1] in engine.eos_ids):
            return True
        if follow is not None:
            return False
        return bool(stop) and any(s in tokenizer.decode(out, skip_special_tokens=True) for s in stop)

    live = list(range(n_rows))
    paused += watched(live)
    while True:
        for row in sorted(live, key=leads.__contains__):  # forks after their leads: done with them
            if not done[row] and finished(row):  # this row's cache now holds what it holds alone at its end
                done[row], finish_steps[row] = True, steps
                finish_bytes[row] = row_bytes(row)
                finish_s[row] = time.perf_counter() - start - paused
        if all(done):
            break
        if drop_rows is not None and any(done[row] for row in live):
            keep = [i for i, row in enumerate(live) if not done[row]]
            order = drop_rows(keep) or keep  # the batch indices, in their new batch order
            tokens, live = tokens[order], [live[i] for i in order]  # (B_live,)
        step_request, step_start = request(live), time.perf_counter()
        with recording(step_request, recorder(step_request, live) if recorder else None) as stats:
            logits = forward_batch(engine, tokens[:, None], positions(position, len(live)), cache)  # (B_live, V)
        after_step(stats, live)
        position, steps = position + 1, steps + 1
        tokens = logits.argmax(-1) if follow is None else fed(live, steps)  # (B_live,)
        if leads:  # forked rows are fed their lead's token; each is charged its share of the step
            tokens = tokens[[live.index(leads.get(row, row)) for row in live]]  # (B_live,)
            share = (time.perf_counter() - step_start) / len(live)
            for row in live:
                if row in leads:
                    shares[row] += share
        for i, row in enumerate(live):
            if not done[row]:  # finished rows still in the batch keep decoding; their output is masked out
                generated[row].append(int(tokens[i]))
                if keep_logits:
                    kept[row].append(logits[i])
        paused += watched(live)
    synchronize(device)
    decode_s = time.perf_counter() - start - paused
    peak = read_peak(device) if measure_peak else 0
    return Decoded(generated, kept, finish_steps, finish_s, finish_bytes, decode_s, peak, shares)


def _extend_batch(engine: Engine, cache, hooks: Compression, ids: torch.Tensor, position: int) -> torch.Tensor:
    """Append ids (B, n) after compression (the question when query_aware=false), as Engine._extend does."""
    hooks.on_extend(ids.shape[1])
    one_pass = one_mask(cache)  # else token by token
    chunks = [ids] if one_pass else [ids[:, i : i + 1] for i in range(ids.shape[1])]
    for chunk in chunks:  # (B, n_chunk)
        base = hooks.position(position, cache)
        positions = torch.arange(base, base + chunk.shape[1], device=ids.device).expand_as(chunk)  # (B, n_chunk)
        with recording(hooks.decode_request()) as stats:
            logits = forward_batch(engine, chunk, positions, cache)
        hooks.on_decode_step(cache, stats)
        position += chunk.shape[1]
    return logits


def run_batch(
    engine: Engine,
    method: Method,
    budget: Budget | None,
    prompts: list[list[int]],
    suffixes: list[list[int]] | None = None,
    max_new_tokens: int = 32,
    stop: tuple[str, ...] = (),
    keep_logits: bool = False,
) -> list[BatchedGeneration]:
    """Prefill + generate B equal-length prompts with one configuration (the batched `Engine.run`)."""
    own = engine.prepared(method)
    prefill = prefill_batch(own, prompts, method.stats_request())
    return generate_batch(own, prefill, method, budget, suffixes or [], max_new_tokens, stop, keep_logits)


def batches(examples: list, batch_size: int, key) -> list[list]:
    """Consecutive groups of at most `batch_size` examples with equal `key` (prompt and suffix lengths)."""
    groups: dict = {}
    for ex in examples:
        groups.setdefault(key(ex), []).append(ex)
    return [group[i : i + batch_size] for group in groups.values() for i in range(0, len(group), batch_size)]


def step_kv_bytes(gen: Generation) -> int:
    """The cache bytes one decode step of this row reads: its batch's every row (the rows of a grid or of batched
    examples), else its own."""
    return getattr(gen, "batch_kv_bytes", 0) or gen.kv_bytes


def batch_columns(gen: Generation) -> dict:
    """The batching columns of a result row (batch 1: the generation alone)."""
    if isinstance(gen, BatchedGeneration):
        return {
            "batch_size": gen.batch_size,
            "decode_tokens_per_s": gen.decode_tokens_per_s,
            "latency_s": gen.latency_s,
        }
    return {
        "batch_size": 1,
        "decode_tokens_per_s": gen.decode_steps / gen.decode_s if gen.decode_s else float("nan"),
        "latency_s": gen.prefill_s + gen.decode_s,
    }
