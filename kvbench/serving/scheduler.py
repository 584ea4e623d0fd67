"""Continuous batching under a fixed KV memory budget (bytes), over kvbench's engine and cache layers.

Each iteration: (1) admit waiting requests, first come first served, while the budget holds the next one's prefill
— its whole prompt's uncompressed K/V, held until compression — plus one more token for every running request;
an admitted request is prefilled alone (`Engine.prefill`), compressed by its method (`Engine.compressed`: SnapKV,
StreamingLLM, ... keep their share of the prompt), and its first token is out; (2) before the decode step, every
running request will hold one token more: while that would exceed the budget, the most recently admitted request
is preempted (its cache freed; it goes back to the head of the queue and is recomputed from its prompt when
admitted again — greedy decoding regenerates its tokens, the ones already sent are not sent twice), and nothing is
admitted until a running request finishes (else the freed room readmits it, to be preempted again); (3) one decode
step for every running request. Methods that evict while decoding (H2O, StreamingLLM) do so after each step, so
they hold their size and never grow.

Decoding: requests whose compressed cache is plain tensors (full, SnapKV, PyramidKV, H2O, StreamingLLM, TOVA, ...)
are rows of one batch — one forward per step for all of them (kvbench.serving.batch). Others (KIVI's quantized
layers, AdaKV's ragged heads, StreamingLLM ring/rolling, sliding-window models) decode alone, one forward per
request per step, as `Engine.decode` does: correct, but each costs a forward of its own.

Bytes: `held` = every running request's own cache (each row's tokens, or a lone cache's storages) + the prompt
being prefilled. It is checked to stay ≤ the budget after every admission and every step, the step's new token
included (`samples` records it: the tests assert it). The clock is wall time, except that idle gaps (nothing
running, the next request not yet arrived) are skipped rather than slept.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench import KvbenchError
from kvbench.model.attention import recording
from kvbench.model.cache import cache_nbytes
from kvbench.native.grid_decode import decodes_in_grid
from kvbench.serving.batch import RowBatch
from kvbench.serving.trace import Request


@dataclass
class Served:
    """One request's life in the scheduler: its timings (seconds on the trace's clock) and its output."""

    request: Request
    admitted_s: float = float("nan")  # first admission (its prefill starts)
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    emitted_s: list[float] = field(default_factory=list)  # when each output token went out (never re-sent)
    emitted: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)  # this admission's tokens (recomputed after a preemption)
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens generated again after a preemption
    recompute_mismatches: int = 0  # regenerated tokens that differ from the ones sent before
    prefill_s: float = 0.0  # every prefill + compression of this request (recomputes included)
    kv_bytes: int = 0  # its cache when it finished
    decode_mode: str = ""  # batch | alone
    # while running
    method: Any = None
    hooks: Any = None
    cache: Any = None  # a lone request's cache (None: a row of the batch)
    position: int = 0  # absolute position of the next fed token
    admissions: int = 0

    @property
    def token(self) -> int:
        return self.generated[-1]


@dataclass
class ServeResult:
    served: list[Served]
    samples: list[tuple[float, int, int]]  # (clock s, held bytes, running requests) after every admission and step
    peak_held_bytes: int
    peak_padded_bytes: int  # the same moments as peak_held_bytes with the batch's pad slots: never below it
    max_concurrency: int
    decode_steps: int
    duration_s: float  # trace clock at the last finish
    wall_s: float  # wall time (idle gaps included only as they were run, not skipped)
    idle_skipped_s: float


class Scheduler:
    def __init__(self, engine, method, budget, kv_budget_bytes: int):
        self.engine = engine.prepared(method)  # head merging: its own model; every request of the run shares it
        self.method, self.budget, self.kv_budget = method, budget, int(kv_budget_bytes)
        self.layout = self.engine.lm.layout  # the model requests decode on (head merging: the converted one)
        self.token_bytes = self.layout.full_bytes(1)  # one more token in every layer
        self.batch = RowBatch(self.engine.lm.device)
        self.running: list[Served] = []
        self.samples: list[tuple[float, int, int]] = []
        self.peak_held = self.peak_padded = self.max_concurrency = self.steps = 0
        self.skipped = 0.0
        self.backoff = False  # after a preemption: admit nothing until a request finishes (no admit-preempt loop)
        self.now: Callable[[], float] = time.perf_counter

    # ---- bytes ---------------------------------------------------------------------------------------------
    def held(self) -> int:
        batch = sum(self.batch.row_bytes(s) for s in self.batch.rows)
        return batch + sum(cache_nbytes(s.cache) for s in self.running if s.cache is not None)

    def padded(self) -> int:
        return self.batch.padded_bytes() + sum(cache_nbytes(s.cache) for s in self.running if s.cache is not None)

    def _sample(self, transient: int = 0) -> None:
        """Record the bytes held now plus `transient` (a prompt's uncompressed K/V during its prefill, a step's new
        tokens before eviction). Both peaks see the same transients: the padded one (the batch's tensors with their
        pad slots) was once sampled without them and came out below the held one."""
        held = self.held() + transient
        if held > self.kv_budget:  # the scheduler's own invariant: a bug, not bad input
            raise RuntimeError(f"held {held} bytes > kv_budget_bytes {self.kv_budget}")
        self.samples.append((self.now(), held, len(self.running)))
        self.peak_held = max(self.peak_held, held)
        self.peak_padded = max(self.peak_padded, self.padded() + transient)
        self.max_concurrency = max(self.max_concurrency, len(self.running))

    # ---- the loop ------------------------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> ServeResult:
        self.batch = RowBatch(self.engine.lm.device)
        self.running, self.samples = [], []
        self.peak_held = self.peak_padded = self.max_concurrency = self.steps = 0
        self.backoff = False
        served = {r.request_id: Served(r) for r in requests}
        pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.request_id)))
        queue: deque[Served] = deque()
        start, self.skipped = time.perf_counter(), 0.0
        self.now = lambda: time.perf_counter() - start + self.skipped
        while pending or queue or self.running:
            while pending and pending[0].arrival_s <= self.now():
                queue.append(served[pending.popleft().request_id])
            if not queue and not self.running:  # idle until the next arrival: skip the gap, do not sleep
                self.skipped += pending[0].arrival_s - self.now()
                continue
            while queue and not self.backoff and self._fits_admission(queue[0]):
                self._admit(queue.popleft())
            if self.running:
                self._make_room(queue)
                self._step()
        return ServeResult(
            served=[served[r.request_id] for r in requests],
            samples=self.samples,
            peak_held_bytes=self.peak_held,
            peak_padded_bytes=self.peak_padded,
            max_concurrency=self.max_concurrency,
            decode_steps=self.steps,
            duration_s=max(s.finish_s for s in served.values()),
            wall_s=time.perf_counter() - start,
            idle_skipped_s=self.skipped,
        )

    def _fits_admission(self, s: Served) -> bool:
        """The prompt's uncompressed K/V during its prefill — every layer holds the whole prompt until compression
        and a sliding layer's trim (dense_bytes) — and one more token for every running request and it."""
        need = self.layout.dense_bytes(s.request.prompt_tokens) + (len(self.running) + 1) * self.token_bytes
        if self.held() + need <= self.kv_budget:
            return True
        if not self.running:  # nothing will free memory: the budget cannot hold this request at all
            raise KvbenchError(
                f"kv_budget_bytes={self.kv_budget:,} cannot hold request {s.request.request_id} "
                f"({s.request.prompt_tokens} prompt tokens need {need:,} bytes to prefill); raise the budget"
            )
        return False

    @torch.inference_mode()
    def _admit(self, s: Served) -> None:
        r, engine = s.request, self.engine
        if s.admissions == 0:
            s.admitted_s = self.now()
        s.admissions += 1
        s.method = self.method  # decode-time state (H2O's scores, sizes) is the request's own compression's
        t0 = time.perf_counter()
        prefill = engine.prefill(list(r.prompt_ids), s.method.stats_request())
        self.running.append(s)  # counted as running from its prefill on
        self._sample(sum(k.nbytes + v.nbytes for k, v in prefill.kv))  # the prompt's whole K/V
        start = engine.compressed(prefill, s.method, self.budget, list(r.suffix_ids), r.max_new_tokens)
        s.hooks = start.hooks  # this request's compression
        del prefill  # the uncompressed prompt's K/V is freed here (unless the method keeps it: the full cache)
        s.prefill_s += time.perf_counter() - t0
        s.position = start.position
        s.generated = [int(start.logits.argmax())]
        if decodes_in_grid(s.method, start):
            s.decode_mode = "batch"
            self.batch.add(s, start.cache)
            s.cache = None
        else:
            s.decode_mode = "alone"
            s.cache = start.cache
            s.hooks.on_decode_start(s.cache, s.position)  # as Engine.decode
        self._sample()
        self._emit(s)
        self._sample()

    def _make_room(self, queue: deque) -> None:
        """Preempt the most recently admitted requests until every running one can take one more token."""
        while self.held() + len(self.running) * self.token_bytes > self.kv_budget:
            if len(self.running) == 1:
                raise RuntimeError("a lone request outgrew the budget the entrance checks let through")
            victim = self.running[-1]
            self._release(victim)
            self.backoff = True
            victim.preemptions += 1
            victim.generated, victim.method, victim.hooks = [], None, None
            queue.appendleft(victim)  # first in line again (it arrived before anything still waiting)

    def _release(self, s: Served) -> None:
        if s.cache is None:
            self.batch.remove(s)
        s.cache = None
        self.running.remove(s)

    @torch.inference_mode()
    def _step(self) -> None:
        engine = self.engine
        self._sample(len(self.running) * self.token_bytes)  # the step's own new tokens, before eviction
        rows = list(self.batch.rows)
        if rows:
            logits = self.batch.step(engine, [s.token for s in rows], [s.position for s in rows])  # (B, V)
            for s, row_logits in zip(rows, logits):
                s.generated.append(int(row_logits.argmax()))
        for s in [s for s in self.running if s.cache is not None]:
            with recording(s.hooks.decode_request()) as stats:
                out = engine.forward([s.token], [s.hooks.position(s.position, s.cache)], s.cache)[-1]  # (V,)
            s.hooks.on_decode_step(s.cache, stats)
            s.generated.append(int(out.argmax()))
        self.steps += 1
        self._sample()  # the batch's tensors after the step (grown for its tokens), before finished rows leave
        for s in list(self.running):
            s.position += 1
            self._emit(s)
        self._sample()

    def _emit(self, s: Served) -> None:
        """Send the request's newest token (unless a preempted run already sent it); finish it when it is done."""
        index = len(s.generated) - 1
        if index < len(s.emitted):  # recomputing after a preemption: already sent
            s.recomputed_tokens += 1
            s.recompute_mismatches += int(s.emitted[index] != s.generated[index])
        else:
            t = self.now()
            s.emitted.append(s.generated[index])
            s.emitted_s.append(t)
            if index == 0:
                s.first_token_s = t
        if self._finished(s):
            s.kv_bytes = self.batch.row_bytes(s) if s.cache is None else cache_nbytes(s.cache)
            s.finish_s = self.now()
            self._release(s)
            self.backoff = False  # its memory is free: admission resumes

    def _finished(self, s: Served) -> bool:
        """As Engine.decode stops: max_new_tokens, an end-of-turn id, a stop string."""
        out, r = s.generated, s.request
        if len(out) >= r.max_new_tokens or out[-1] in self.engine.eos_ids:
            return True
        return bool(r.stop) and any(x in self.engine.lm.tokenizer.decode(out, skip_special_tokens=True) for x in r.stop)
