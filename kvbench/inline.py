"""`prefill=inline` and `prefill_chunk`: compress each layer inside the forward pass, chunk by chunk.

`prefill=shared` (the default, and what grids share) forwards the whole prompt, keeps every layer's K/V, then
compresses: the peak holds the whole uncompressed cache. `prefill=inline` runs one prefill per configuration and
compresses layer l right after layer l's attention (kvbench.attention.after_each_layer), with the statistics that
attention call just recorded: the method's `begin_compress`, then `compress_layer` per layer as it is produced, then
`end_compress` — the same three calls `Method.compress` makes after a shared prefill, so both keep the same entries
(tests/test_inline.py, every registered method). At most one layer's uncompressed K/V exists at a time; quantization
methods quantize each layer as it is produced.

`prefill_chunk=N` feeds the prompt N tokens at a time, each chunk at its absolute positions after what the cache
keeps (the method's `position`, as decoding does). After each chunk every layer is compressed again to its count for
the *whole* prompt (`layer_keep_counts` of the full prompt length), with that chunk's statistics over everything the
layer holds: which queries vote is the method's rule applied to the chunk's queries (SnapKV/PyramidKV: the chunk's
last `window_size` queries, so the last chunk's window is the prompt's last tokens — the question when
query_aware; H2O: every query, added to the scores the kept tokens received before; TOVA: the chunk's last query;
StreamingLLM: sinks + the most recent tokens, no votes; Expected Attention: the chunk's queries). Methods without a
budget (KIVI, hf-quant) quantize the first chunk as it is produced and later chunks as they land in their layers.
Peak memory is then weights + the budget's cache + one chunk's activations and one layer's chunk K/V.
"""

from __future__ import annotations

import time

import torch
from omegaconf import DictConfig

from kvbench import KvbenchError
from kvbench.attention import StatsRecorder, after_each_layer, recording
from kvbench.engine import Engine, Prefill
from kvbench.memory import read_peak, reset_peak, synchronize
from kvbench.methods import Budget, Method

PREFILL_MODES = ("shared", "inline")


def settings(cfg: DictConfig) -> tuple[str, int | None]:
    """(prefill, prefill_chunk) of a run."""
    chunk = cfg.get("prefill_chunk")
    return str(cfg.get("prefill") or "shared"), None if chunk is None else int(chunk)


def row_keys(cfg: DictConfig) -> dict:
    """The columns every row of a run records about its prefill."""
    mode, chunk = settings(cfg)
    return {"prefill": mode, "prefill_chunk": chunk}


def hash_keys(cfg: DictConfig) -> dict:
    """Config-hash keys: an inline or chunked prefill is measured apart from a shared one (its peak memory, and a
    chunked prefill's kept entries, differ)."""
    mode, chunk = settings(cfg)
    return {} if mode == "shared" else {"prefill": mode, **({"prefill_chunk": chunk} if chunk else {})}


def check(cfg: DictConfig, methods: list[Method], task) -> None:
    """What `prefill`/`prefill_chunk` combine with, before the model loads (one line naming the fix)."""
    mode, chunk = settings(cfg)
    if chunk is not None and mode != "inline":
        raise KvbenchError(
            f"prefill_chunk={chunk} compresses each chunk as it lands, which needs prefill=inline "
            "(a shared prefill keeps the whole prompt); add prefill=inline or drop prefill_chunk"
        )
    if mode != "inline":
        return
    others = {
        "diagnose=true": cfg.get("diagnose"),
        "prefix_cache=true": cfg.get("prefix_cache") or getattr(task, "workload", False),
        f"batch_size={cfg.get('batch_size')}": int(cfg.get("batch_size") or 1) > 1,
        f"task={task.name} (streamed perplexity)": task.streaming,
        f"task={task.name}": hasattr(task, "compute_rows"),
    }
    for what, present in others.items():
        if present:
            raise KvbenchError(
                f"prefill=inline does not combine with {what} (they need the prompt's uncompressed K/V or their own "
                "prefill); use prefill=shared for this run"
            )
    for method in methods:
        if not method.compresses_per_layer():
            raise KvbenchError(
                f"method {method.name} compresses after the whole prefill (it needs every layer first), so it cannot "
                "compress inside the forward pass; use prefill=shared for it"
            )
        if chunk is not None and not method.chunkable():
            raise KvbenchError(
                f"method {method.name} cannot re-compress its cache after each chunk ({method.chunk_limit}); "
                "drop prefill_chunk for it (prefill=inline alone works)"
            )


@torch.inference_mode()
def prefill(engine: Engine, method: Method, budget: Budget | None, ids: list[int], chunk: int | None = None) -> Prefill:
    """Forward `ids` (in chunks of `chunk` tokens; None = at once), compressing each layer inside the forward
    pass; returns a Prefill holding the compressed cache (`compressed`) and no uncompressed K/V."""
    from transformers import DynamicCache

    lm, device = engine.lm, engine.lm.device
    method.bind(lm)
    request = method.stats_request()
    cache = DynamicCache()
    baseline = reset_peak(device)
    synchronize(device)
    start = time.perf_counter()
    method.begin_compress(len(ids), lm.n_layers, budget)
    compressor = _LayerCompressor(engine, method, cache)
    step = chunk or len(ids)
    for first in range(0, len(ids), step):
        piece = ids[first : first + step]
        compressor.compress = first == 0 or method.has_budget  # quantization: later chunks quantized as they land
        base = method.position(first, cache) if first else 0
        with recording(request) as compressor.stats, after_each_layer(compressor):
            logits = engine.forward(piece, [base + i for i in range(len(piece))], cache)
        if len(compressor.layers_seen) != len(cache.layers):  # some attention bypassed kvbench's: nothing compressed
            raise KvbenchError(
                f"prefill=inline compresses each layer at the end of its attention, but {len(cache.layers)} cache "
                f"layers reported {len(compressor.layers_seen)} attention calls through kvbench's attention "
                f"({type(lm.model).__name__}); use prefill=shared with this model"
            )
        compressor.layers_seen.clear()
    stats = compressor.stats
    assert stats is not None  # the prompt has at least one token
    compressed = method.end_compress(list(cache.layers), stats, budget)
    synchronize(device)
    seconds = time.perf_counter() - start
    return Prefill(
        [],
        stats,
        logits[-1],
        seconds,
        read_peak(device),
        baseline_bytes=baseline,
        compressed=compressed,
        prompt_tokens=len(ids),
    )


class _LayerCompressor:
    """The per-layer hook: replaces cache layer l by the method's compressed layer right after l's attention."""

    def __init__(self, engine: Engine, method: Method, cache):
        self.engine, self.method, self.cache = engine, method, cache
        self.stats: StatsRecorder | None = None  # the current chunk's recorder
        self.compress = True
        self.layers_seen: set[int] = set()

    def __call__(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values (B, H_kv, T, D): everything layer `layer_idx` holds, this chunk included."""
        stats = self.stats
        assert stats is not None
        self.layers_seen.add(layer_idx)
        if not stats.has_layer(layer_idx):  # this model's attention did not report statistics: one clear line
            self.engine._check_recorded(stats.request, stats, self.engine.lm.n_layers)
        if self.compress:
            self.cache.layers[layer_idx] = self.method.compress_layer(layer_idx, keys, values, stats)
        stats.release(layer_idx)  # used: free the layer's statistics now rather than after the last layer
