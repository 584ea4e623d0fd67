"""Requests in order, sharing prefixes: the runner's path for workload tasks and for `prefix_cache=true`.

`reuse=per_question` (default): each request prefills only what the prefix cache lacks, then every configuration
compresses the whole prompt as usual (query-aware when `query_aware`), so with the full cache the outputs are
the same tokens as without prefix caching. The statistics a method reads come from this request's queries, so a
request always prefills at least the method's observation window (H2O, which sums every query, reuses nothing).

`reuse=compress_once`: each configuration compresses a request's shared context (`Example.context_ids`) once,
without the question, keeps the compressed cache in the prefix cache, and answers every request on that context
from it: the question (and any chat history after the context) is appended uncompressed, as with query_aware=false.

Each row gains `request_index` (from the task), `prefill_tokens` (computed), `reused_tokens`, `hit_rate`,
`store_bytes` (the prefix cache, each page once) and `held_bytes`: the store plus every request's own cache bytes
so far in the run, as if each request's cache stayed resident (without prefix caching: the sum of `kv_bytes`).
`prefill_s` stays the time to first token (lookup, prefill of the rest, compression, appended question).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import Any

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvbench.config.spec import RunSpec
from kvbench.methods.compression import Compression
from kvbench.model.attention import StatsRecorder, StatsRequest
from kvbench.model.cache import _tensors, cache_from_kv, cache_nbytes
from kvbench.native.engine import Prefill
from kvbench.native.prefix_cache import PrefixCache, gather_pages, page_of, share_pages, shared_layer


def reuse_limit(request: StatsRequest, n_prompt: int) -> int:
    """Prompt tokens that may come from the cache: the observation windows (every query, for H2O's sums) and at
    least the last token (for the first logits) must be computed by this request."""
    if request.all_queries:
        return 0
    return n_prompt - max(1, max(request.windows, default=1))


@dataclass
class CachedPrefill(Prefill):
    """A prefill that was done once for the shared context: only its length and last logits are needed."""

    context_tokens: int = 0

    @property
    def n_tokens(self) -> int:
        return self.context_tokens


@dataclass
class StoredContext:
    """A configuration's compressed shared context, kept in the prefix cache (reuse=compress_once)."""

    layers: list  # the compressed cache's layers, shared (read-only) by every request
    compression: Compression  # its compression right after compressing (decode-time eviction continues from it)
    last_logits: object
    n_tokens: int
    storages: set[int]


def reused_copy(compressed: StoredContext) -> tuple[Compression, DynamicCache]:
    """A configuration's compression as it stood after compressing the shared context (a fresh copy: decode-time
    eviction continues from it), and the cache to decode from, whose layers share the stored tensors: plain layers
    become a PagedLayer over them (appended tokens go to a private tail), others (KIVI) a shallow copy whose updates
    replace tensors, never write into them. The engine decodes from it as from a prefill=inline cache
    (`Prefill.compressed`)."""
    cache = DynamicCache()
    cache.layers.extend(
        shared_layer(layer.keys, layer.values)  # type: ignore[arg-type]  # a stored plain layer holds tensors
        if type(layer) is DynamicLayer
        else copy.copy(layer)
        for layer in compressed.layers
    )
    return copy.deepcopy(compressed.compression), cache


def storages_of(cache) -> dict[int, int]:
    """data_ptr → nbytes of every storage a cache holds."""
    out: dict[int, int] = {}
    seen: set[int] = set()
    for layer in cache.layers:
        for tensor in _tensors(vars(layer), seen):
            if tensor.numel():
                out[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return out


class RequestRunner:
    """Requests run in order, each through the prefix cache when there is one (see the module's docstring)."""

    def __init__(self, engine, spec: RunSpec):
        self.engine, self.lm = engine, engine.lm
        self.reuse = spec.reuse
        self.store = PrefixCache(spec.page_size, spec.prefix_cache_bytes) if spec.prefix_cache else None
        self.own_bytes: dict[str, int] = {}  # per configuration: Σ requests' own cache bytes so far
        self.requests: dict[str, int] = {}  # per configuration: requests so far (request_index of plain tasks)
        # sliding-window layers: their page tensors apart, since a request keeps its own window of them
        self.windows = frozenset(i for i, kind in enumerate(self.lm.layout.layers) if kind.kind == "sliding")

    def rows(self, ctx, todo, ex) -> list[dict]:
        """Each configuration's row for request `ex` (ctx: kvbench.rows.build.RowContext); with ctx.diagnose the rows
        gain the diagnostic columns and ctx.side the per-(layer, KV head) records, from this request's own caches:
        per question the prompt as prefilled through the prefix cache, compressed once the stored compressed context
        with the question appended (against the full cache with the same split)."""
        if self.reuse != "compress_once":
            return self._per_question(ctx, todo, ex)
        done = [self._compress_once(ctx, c, ex) for c in todo]
        rows = [row for row, _ in done]
        if ctx.diagnose is not None:
            from kvbench.guide.diagnose_run import diagnose_example

            again = [reused_copy(value) for _, value in done]  # fresh copies of the state right after compressing
            ctx.side.extend(diagnose_example(self.engine, todo, ex, ctx.task, None, rows, ctx.diagnose, again, False))
        return rows

    # ---- per question: prefix pages + prefill of the rest ----------------------------------------------------
    def _per_question(self, ctx, todo, ex) -> list[dict]:
        from kvbench.rows.build import generation_rows

        lm = self.lm
        prompt_ids, suffix_ids = ex.split(todo[0].query_aware)
        caches: list = []
        used: dict[str, Any] = {"reused": 0, "pages": []}

        def prefill(ids, request):
            if self.store is None:
                return replace(self.engine.prefill(ids, request), adopt=lambda cache: caches.append(cache) or cache)
            start, p = time.perf_counter(), self.store.page_size
            pages = self.store.match(ids, reuse_limit(request, len(ids)))
            self.store.lock(pages)
            n_reused = len(pages) * p
            prefix = cache_from_kv([gather_pages(pages, i) for i in range(lm.n_layers)]) if pages else None
            out = self.engine.prefill(ids[n_reused:], request, prefix, position=n_reused)
            all_pages = self.store.insert(ids, lambda i: page_of(out.kv, i * p, (i + 1) * p, self.windows))
            self.store.lock(all_pages)
            self.store.release(pages)
            used.update(reused=n_reused, pages=all_pages)

            def adopt(cache):
                caches.append(share_pages(cache, out.kv, all_pages))
                return caches[-1]

            return replace(out, seconds=time.perf_counter() - start, adopt=adopt)

        rows = generation_rows(ctx, todo, ex, prefill=prefill)
        store_ptrs = self.store.storages() if self.store else set()
        shared = iter(caches)
        for c, row in zip(todo, rows):
            reused = used["reused"] if c.method.caps.shares_prefill else 0
            cache = next(shared) if c.method.caps.shares_prefill else None
            own = sum(n for ptr, n in storages_of(cache).items() if ptr not in store_ptrs) if cache else row["kv_bytes"]
            self._annotate(row, c, ex, len(prompt_ids) + len(suffix_ids), reused, own)
        if self.store:
            self.store.release(used["pages"])
        return rows

    # ---- compress once, answer many ----------------------------------------------------------------------------
    def _compress_once(self, ctx, c, ex) -> tuple[dict, StoredContext]:
        """The row of configuration `c` for request `ex`, and the compressed context it was answered from."""
        from kvbench.rows.build import generation_row

        assert self.store is not None  # reuse=compress_once runs with prefix_cache=true (workload.check)
        engine = self.engine.prepared(c.method)
        start = time.perf_counter()
        entry = self.store.get((c.hash, tuple(ex.context_ids)), len(ex.context_ids))
        hit, peak = entry is not None, 0
        if not hit:
            out = engine.prefill(ex.context_ids, c.method.stats_request())
            done = engine.compressed(out, c.method, c.budget, [])  # sliding layers at the model's own windows
            value = StoredContext(
                list(done.cache.layers),
                copy.deepcopy(done.hooks),
                out.last_logits,
                len(ex.context_ids),
                set(storages_of(done.cache)),
            )
            entry = self.store.put((c.hash, tuple(ex.context_ids)), value, cache_nbytes(done.cache))
            peak = done.prefill_peak
            del done, out
        assert entry is not None  # found, or just stored
        reused = len(ex.context_ids) if hit else 0
        entry.refs += 1
        caches = []
        compression, cache = reused_copy(entry.value)
        prefill = CachedPrefill(
            kv=[],
            stats=StatsRecorder(StatsRequest()),
            last_logits=entry.value.last_logits,
            seconds=time.perf_counter() - start,
            peak_mem_bytes=peak,
            adopt=lambda cache: caches.append(cache) or cache,  # type: ignore[func-returns-value]  # keep, pass on
            compressed=cache,
            compression=compression,
            context_tokens=entry.value.n_tokens,
        )
        gen = engine.generate(prefill, c.method, c.budget, list(ex.question_ids), ex.max_new_tokens, ex.stop)
        entry.refs -= 1
        row = generation_row(c, ex, ctx, gen)
        row["query_aware"] = False  # the context was compressed without the question
        store_ptrs = self.store.storages()
        own = sum(n for ptr, n in storages_of(caches[0]).items() if ptr not in store_ptrs)
        self.store.evict()
        # the store holds every configuration's entry: this configuration's held bytes count only its own
        store_bytes = sum(e.nbytes for key, e in self.store.entries.items() if key[0] == c.hash)
        self._annotate(row, c, ex, ex.n_tokens, reused, own, store_bytes)
        return row, entry.value

    def _annotate(self, row: dict, c, ex, n_prompt: int, reused: int, own_bytes: int, store_bytes=None) -> None:
        self.own_bytes[c.hash] = self.own_bytes.get(c.hash, 0) + own_bytes
        self.requests[c.hash] = self.requests.get(c.hash, -1) + 1
        if store_bytes is None:
            store_bytes = self.store.nbytes if self.store else 0
        row.update(
            request_index=ex.meta.get("request_index", self.requests[c.hash]),
            prefill_tokens=n_prompt - reused,
            reused_tokens=reused,
            hit_rate=reused / n_prompt,
            store_bytes=store_bytes,
            held_bytes=store_bytes + self.own_bytes[c.hash],
            prefix_cache=self.store is not None,
            reuse=self.reuse,
        )
