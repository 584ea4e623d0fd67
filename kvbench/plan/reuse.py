"""The planner's reuse factor: `batch` requests whose contexts start with the same `prefix` tokens (one document
asked many questions, a long system prompt) under prefix caching, counted as kvbench's engine holds and computes
them (kvbench/run/requests.py, kvbench/native/prefix_cache.py).

Bytes held by the batch = `once` (held once for all) + batch × `private` (each request's own):
- no prefix (prefix=0): once 0, private = the request's cache (kvbench.model.kv_bytes).
- reuse=per_question, the full cache: the shared prefix's whole pages (⌊prefix / page_size⌋ · page_size tokens)
  are held once; each request holds the rest of its context (its cache refers to the pages, never copies them).
- reuse=per_question, a compressing method: each request compresses its whole prompt (with its question) into a
  cache of its own; the prefix cache still holds the shared pages once and each request's further whole pages,
  at full precision, while the request runs: private = those pages + its compressed cache. Compressing per
  question and sharing are at odds: this can hold more than without prefix caching (the planner shows it).
- reuse=compress_once: the prefix compressed once (the method's bytes at `prefix` tokens) is held once; each
  request appends the rest of its context uncompressed (counted dense: for a quantized cache an upper bound).
Decode still reads each request's whole view of the cache per step (no shared-prefix "cascade" kernel assumed),
so the decode roofline is that of the request's cache; the memory fit and the prefill change.

Prefill FLOPs of tokens [a, b) of a causal prompt: 2 · matmul params · (b − a) + 2 · H_q · head_dim · L · (b² − a²)
(QKᵀ and AV of each query over the tokens before it). Without reuse the batch costs batch · F(0, T). Per question,
the first request prefills all of it and the others reuse the shared whole pages, but never a method's observation
window (its statistics come from the request's own queries; H2O, which sums every query, reuses nothing; a method
with its own prefill, head merging, none): F(0, T) + (batch − 1) · F(r, T). Compress once: F(0, P) + batch · F(P, T)
(the appended tokens' attention over the compressed prefix is counted over the full one: an upper bound).

`reuse_from=PATH` takes the workload's shape from the rows of a run with prefix_cache=true (kvbench.run.requests):
batch = requests per workload, context = the median prompt (prefill_tokens + reused_tokens), prefix = the most
tokens a request reused (per question: whole pages, short of the observation window the grid left to each request:
at most a window below the shared prefix), reuse = the rows' mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench import KvbenchError
from kvbench.model.kv_bytes import KVShape, predict_kv_bytes


@dataclass(frozen=True)
class Reuse:
    prefix: int = 0  # tokens at the start of every request's context that the whole batch shares (0: none)
    mode: str = "per_question"  # per_question | compress_once, as a run's `reuse`
    page_size: int = 16  # the prefix cache's page granularity (per_question shares whole pages)

    @classmethod
    def from_cfg(cls, cfg, contexts: list[int] | None = None) -> Reuse:
        """The plan's `prefix`, `reuse`, `page_size` (their types and ranges: kvbench.plan.inputs, before this),
        checked against every context in `contexts`."""
        prefix, mode, page = cfg.get("prefix") or 0, cfg.get("reuse") or "per_question", cfg.get("page_size") or 16
        if contexts and prefix > min(contexts):
            raise KvbenchError(
                f"prefix={prefix} is longer than context={min(contexts)}: the shared prefix is part of each "
                "request's context; lower prefix or raise context"
            )
        return cls(prefix, mode, page)

    def shared_tokens(self, context: int) -> int:
        """Tokens held once for the batch: the prefix (compress once) or its whole pages (per question)."""
        prefix = min(self.prefix, context)
        return prefix if self.mode == "compress_once" else prefix // self.page_size * self.page_size

    @property
    def label(self) -> str:
        return self.mode if self.prefix else "none"


@dataclass(frozen=True)
class WorkloadShape:
    batch: int
    context: int
    prefix: int
    mode: str
    source: str

    def describe(self) -> str:
        return (
            f"{self.source}: {self.batch} requests per workload, {self.context}-token prompts (median), "
            f"{self.prefix} reused, {self.mode}"
        )


def workload_shape(path) -> WorkloadShape:
    """The reuse factor measured by a workload run (rows.parquet, a run directory or a store)."""
    from pathlib import Path

    from kvbench.store.results import read_rows

    if not Path(str(path)).expanduser().exists():
        raise KvbenchError(f"reuse_from={path} does not exist; give the rows of a run with prefix_cache=true")
    rows = read_rows(Path(str(path)).expanduser())
    if "reused_tokens" in rows and "prefix_cache" in rows:
        rows = rows[rows["prefix_cache"].fillna(False).astype(bool)]
    if "reused_tokens" not in rows or not len(rows):
        raise KvbenchError(
            f"reuse_from={path} holds no rows of a workload run with prefix_cache=true; run e.g. "
            "`python -m kvbench task=shared_doc prefix_cache=true` and point reuse_from at its run directory"
        )
    modes = sorted(set(rows["reuse"]))
    if len(modes) > 1:
        raise KvbenchError(f"reuse_from={path} mixes reuse={' and '.join(modes)}; point it at one run's rows.parquet")
    requests = rows.groupby(["config_hash", "workload"]).example_id.nunique()
    prompts = rows.drop_duplicates("example_id").eval("prefill_tokens + reused_tokens")
    return WorkloadShape(int(requests.max()), int(prompts.median()), int(rows.reused_tokens.max()), modes[0], str(path))


@dataclass(frozen=True)
class Held:
    once: int  # bytes held once for the whole batch
    private: int  # bytes each request holds on its own
    view: int  # bytes of one request's cache as its attention reads them (shared pages included)
    shared_tokens: int
    exact: bool


def is_uncompressed(method) -> bool:
    """The full cache: its layers keep the prefill's tensors, which per-question reuse turns into shared pages."""
    return method.name == "full"


def held_bytes(method, budget, shape: KVShape, context: int, reuse: Reuse) -> Held:
    request = predict_kv_bytes(method, budget, shape, context)
    if not reuse.prefix:
        return Held(0, request.kv_bytes, request.kv_bytes, 0, request.exact)
    shared, per_token = reuse.shared_tokens(context), shape.bytes_per_token
    if reuse.mode == "compress_once":
        once = predict_kv_bytes(method, budget, shape, shared)
        rest = (context - shared) * per_token
        return Held(once.kv_bytes, rest, once.kv_bytes + rest, shared, once.exact)
    if is_uncompressed(method):
        return Held(shared * per_token, (context - shared) * per_token, request.kv_bytes, shared, request.exact)
    own_pages = context // reuse.page_size * reuse.page_size - shared
    return Held(shared * per_token, own_pages * per_token + request.kv_bytes, request.kv_bytes, shared, request.exact)


def prefill_flops(arch, start: int, end: int) -> int:
    """FLOPs to prefill tokens [start, end) of a causal prompt whose first `start` tokens are cached."""
    return 2 * arch.matmul_params * (end - start) + 2 * arch.n_q_heads * arch.head_dim * arch.n_layers * (
        end**2 - start**2
    )


def reused_tokens(method, context: int, reuse: Reuse) -> int:
    """Tokens a later request of the batch takes from the prefix cache instead of prefilling (per question: whole
    pages, leaving the method's observation window to the request, as kvbench.run.requests.reuse_limit)."""
    from kvbench.run.requests import reuse_limit

    if not reuse.prefix:
        return 0
    shared = reuse.shared_tokens(context)
    if reuse.mode == "compress_once":
        return shared
    if not method.caps.shares_prefill:
        return 0
    cap = reuse_limit(method.stats_request(), context)
    return min(shared, max(0, cap) // reuse.page_size * reuse.page_size)


def batch_prefill_flops(arch, method, context: int, batch: int, reuse: Reuse) -> tuple[int, int]:
    """(FLOPs to prefill the batch with reuse, FLOPs saved vs prefilling every request whole)."""
    whole = batch * prefill_flops(arch, 0, context)
    if not reuse.prefix:
        return whole, 0
    reused = reused_tokens(method, context, reuse)
    if reuse.mode == "compress_once":
        flops = prefill_flops(arch, 0, reused) + batch * prefill_flops(arch, reused, context)
    else:
        flops = prefill_flops(arch, 0, context) + (batch - 1) * prefill_flops(arch, reused, context)
    return flops, whole - flops
