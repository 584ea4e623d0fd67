"""`prefill=inline` and `prefill_chunk`: compress each layer inside the forward pass, chunk by chunk.

`prefill=shared` (the default, and what grids share) forwards the whole prompt, keeps every layer's K/V, then
compresses: the peak holds the whole uncompressed cache. `prefill=inline` runs one prefill per configuration and
compresses layer l right after layer l's attention (kvbench.model.attention.after_each_layer), with the statistics that
attention call just recorded: the method's `begin` (the example's compression), then its `layer` per layer as it is
produced, then its `end` — the same calls its `run` makes after a shared prefill, so both keep the same entries
(tests/native/test_inline.py, every registered method). At most one layer's uncompressed K/V exists at a time;
quantization methods quantize each layer as it is produced.

`prefill_chunk=N` feeds the prompt N tokens at a time, each chunk at its absolute positions after what the cache
keeps (the method's `position`, as decoding does). After each chunk every layer is compressed again to its count for
the *whole* prompt (`layer_keep_counts` of the full prompt length), with that chunk's statistics over everything the
layer holds: which queries vote is the method's rule applied to the chunk's queries (SnapKV/PyramidKV: the chunk's
last `window_size` queries, so the last chunk's window is the prompt's last tokens — the question when
query_aware; H2O: every query, added to the scores the kept tokens received before; TOVA: the chunk's last query;
StreamingLLM: sinks + the most recent tokens, no votes; Expected Attention: the chunk's queries). Methods without a
budget (KIVI, hf-quant) quantize the first chunk as it is produced and later chunks as they land in their layers.
Peak memory is then weights + the budget's cache + one chunk's activations and one layer's chunk K/V.

task=ppl with prefill=inline streams its text through the same per-layer hook (`forward_per_layer`): each layer is
bounded by `Stream.layer` right after its attention (kvbench.native.streaming); its `task.chunk` is the
chunk.
"""

from __future__ import annotations

import time

import torch

from kvbench import KvbenchError
from kvbench.methods import Budget, Method
from kvbench.model.attention import StatsRecorder, after_each_layer, recording
from kvbench.native.engine import Engine, Prefill
from kvbench.native.memory import read_peak, reset_peak, synchronize

PREFILL_MODES = ("shared", "inline")


def compresses_per_layer(method: Method | type[Method]) -> bool:
    """Whether `prefill=inline` can compress `method` (an instance or a class) layer by layer: as its capabilities
    declare (`caps.compresses_inline`: False for one needing every layer first)."""
    return method.caps.compresses_inline


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
    compression = method.begin(len(ids), lm.n_layers, budget)
    step = chunk or len(ids)
    for first in range(0, len(ids), step):
        piece = ids[first : first + step]
        # quantization (no budget): later chunks land in the layers as they are, quantized by the layer's own rule
        bound = compression.layer if first == 0 or method.caps.has_budget else _as_is
        base = compression.position(first, cache) if first else 0
        logits, stats = forward_per_layer(engine, cache, request, piece, [base + i for i in range(len(piece))], bound)
    compressed = compression.end(list(cache.layers), stats)
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
        compression=compression,
    )


def forward_per_layer(engine: Engine, cache, request, ids: list[int], positions: list[int], bound, **logits):
    """Forward `ids` through `cache`, calling `bound(layer_idx, keys, values, stats)` right after each layer's
    attention: the cache layer it returns (None: keep the layer as it is) replaces that layer, whose statistics are
    then freed. Returns (logits as `Engine.forward` gives them with `**logits`, the recorder). Used by
    prefill=inline (per prompt chunk) and task=ppl (per text chunk, kvbench.native.streaming)."""
    hook = _PerLayer(engine, cache, bound)
    with recording(request) as hook.stats, after_each_layer(hook):
        out = engine.forward(ids, positions, cache, **logits)
    if len(hook.layers_seen) != len(cache.layers):  # some attention bypassed kvbench's: nothing compressed
        raise KvbenchError(
            f"prefill=inline compresses each layer at the end of its attention, but {len(cache.layers)} cache "
            f"layers reported {len(hook.layers_seen)} attention calls through kvbench's attention "
            f"({type(engine.lm.model).__name__}); use prefill=shared with this model"
        )
    return out, hook.stats


def _as_is(layer_idx, keys, values, stats) -> None:
    """A `bound` that keeps the layer as it is."""


class _PerLayer:
    """The per-layer hook: replaces cache layer l by what `bound` makes of it right after l's attention."""

    def __init__(self, engine: Engine, cache, bound):
        self.engine, self.cache, self.bound = engine, cache, bound
        self.stats: StatsRecorder | None = None  # the current chunk's recorder
        self.layers_seen: set[int] = set()

    def __call__(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values (B, H_kv, T, D): everything layer `layer_idx` holds, this chunk included."""
        stats = self.stats
        assert stats is not None
        self.layers_seen.add(layer_idx)
        if not stats.has_layer(layer_idx):  # this model's attention did not report statistics: one clear line
            self.engine._check_recorded(stats.request, stats, self.engine.lm.n_layers)
        layer = self.bound(layer_idx, keys, values, stats)
        if layer is not None:
            self.cache.layers[layer_idx] = layer
        stats.release(layer_idx)  # used: free the layer's statistics now rather than after the last layer
