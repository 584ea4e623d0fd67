"""One example's compression: what `method.begin(n_prompt, n_layers, budget)` returns.

A method (methods/base.py) is its knobs and pure hooks; everything one example's compression keeps lives here, in
an object the engine holds beside that example's cache and drops with it: the per-layer counts for this prompt,
the prompt positions each layer kept (`kept`, what kvbench.guide.diagnose reads), the tokens each layer has been
given so far (chunked prefill), and what a method keeps while decoding (H2O's accumulated scores, held sizes,
ring buffers). Two examples never share one; a grid row, a batched example and a served request each hold their own.

The engine drives it in three calls, the same after a shared prefill (`run`) and inside the forward pass
(prefill=inline, kvbench.native.inline):
- `layer(l, K, V, stats)`   one layer's cache layer from everything it holds now (K/V (B, H_kv, T, D))
- `end(layers, stats)`      the cache holding the layers, decode-time state set up
and while decoding, its hooks (each a no-op here: a method that does nothing while generating):
- `decode_request()`        statistics each decode forward must record
- `on_extend(n)`            `n` tokens are about to be appended uncompressed (the question when query_aware=false)
- `on_decode_start(cache, position)`, `on_decode_step(cache, stats)`  around Engine.decode's steps
- `position(absolute, cache)`  RoPE position for the next token (StreamingLLM positions=rolling counts in the cache)
- `slack()`                 tokens a layer may hold beyond its size between two evictions (block eviction)
A method that acts while decoding returns a subclass (methods/decode_eviction.py's `Evicting`, methods/decoding.py)
that sets `acts_while_decoding`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from kvbench.model.attention import StatsRecorder, StatsRequest
from kvbench.model.cache import KV, gather_kv, kv_layer


class Compression:
    """What one example's compression by `method` keeps: counts, kept positions, decode-time state."""

    acts_while_decoding = False  # True: on_decode_step may change the cache (the engine asks)

    # `method` is the Method (methods/base.py) that began it, `budget` its Budget or None; typed loosely here because
    # base.py imports this module (each subclass names its method's class)
    def __init__(self, method: Any, n_prompt: int, n_layers: int, budget: Any):
        self.method, self.n_prompt, self.budget = method, n_prompt, budget
        # prompt tokens each layer keeps of the whole prompt; None: nothing is evicted
        self.counts = method.layer_keep_counts(n_prompt, n_layers, budget)
        # per layer the (B, H_kv, N) prompt positions kept, None where a layer keeps every token (filled by `layer`)
        self.kept: list[torch.Tensor | None] = [None] * n_layers
        self.seen = [0] * n_layers  # prompt tokens each layer has been given (chunked prefill: so far)

    def run(self, prefill_kv: list[KV], stats: StatsRecorder):
        """The cache to decode from after a whole prefill (`prefill=shared`): `layer` per layer, then `end`."""
        return self.end([self.layer(i, keys, values, stats) for i, (keys, values) in enumerate(prefill_kv)], stats)

    def layer(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, stats: StatsRecorder):
        """One layer's cache layer, given everything it holds now, keys/values (B, H_kv, T, D): the method's
        `keep_indices` gathered into new tensors when the layer holds more than its count, else kept whole.

        Chunked prefill calls it again after every chunk with what the layer then holds (kept tokens + the chunk);
        `stats` are always the current pass's, over all of the layer's keys."""
        n_keep = None if self.counts is None else self.counts[layer_idx]
        slots = self._slot_positions(layer_idx, keys.shape[2])  # (B, H_kv, T) prompt positions, or None
        if n_keep is None or n_keep >= keys.shape[2]:
            self.observe(layer_idx, keys, stats)
            self.kept[layer_idx] = slots
            return kv_layer(keys, values)
        index = self.select(layer_idx, keys, values, stats, n_keep)  # (B, H_kv, n_keep)
        self.kept[layer_idx] = index if slots is None else slots.gather(-1, index)  # (B, H_kv, n_keep)
        return kv_layer(*gather_kv(keys, values, index))

    def select(self, layer_idx: int, keys, values, stats: StatsRecorder, n_keep: int) -> torch.Tensor:
        """Positions (B, H_kv, n_keep) of a layer over its count to keep: the method's pure `keep_indices`; a
        method whose selection accumulates state (H2O) selects in its own subclass."""
        return self.method.keep_indices(layer_idx, keys, values, stats, n_keep)

    def observe(self, layer_idx: int, keys: torch.Tensor, stats: StatsRecorder) -> None:
        """A layer kept whole by `layer` (under its count): methods that accumulate scores (H2O) add this pass's
        statistics, so a later chunk or decode step evicts with them."""

    def _slot_positions(self, layer_idx: int, n_slots: int) -> torch.Tensor | None:
        """Prompt positions of a layer's `n_slots` cache slots: the positions kept so far, then the new tokens;
        None while the layer has never been evicted (slot = position)."""
        held = self.kept[layer_idx]  # (B, H_kv, P) or None
        seen = self.seen[layer_idx]
        self.seen[layer_idx] = seen + n_slots - (seen if held is None else held.shape[-1])
        if held is None:
            return None
        new = torch.arange(seen, self.seen[layer_idx], device=held.device)  # (T − P,)
        return torch.cat([held, new.expand(*held.shape[:2], -1)], dim=-1)  # (B, H_kv, T)

    def end(self, layers: list, stats: StatsRecorder):
        """After the last layer: the cache holding `layers` (decode-time state is set up here by subclasses)."""
        cache = DynamicCache()
        cache.layers = list(layers)
        return cache

    # ---- decoding: nothing happens while generating unless a subclass says so ----------------------------------
    def decode_request(self) -> StatsRequest:
        """Statistics each decode forward must record."""
        return StatsRequest()

    def on_extend(self, n_tokens: int) -> None:
        """`n_tokens` are about to be appended uncompressed: methods that evict while decoding grow their size by
        that much instead of evicting the context for them."""

    def on_decode_start(self, cache, position: int) -> None:
        """Decoding one token per step starts from `cache` (the next token at `position`): Engine.decode and
        batched examples (kvbench.native.batched) call it; grid batches and diagnose do not."""

    def on_decode_step(self, cache, stats: StatsRecorder) -> None:
        """Called after each decode forward (the new token is already in the cache): evict to stay at the budget."""

    def position(self, absolute_position: int, cache) -> int:
        """RoPE position for the next token; the original absolute position unless the method re-indexes
        (StreamingLLM positions=rolling). Chunked prefill and streaming place each chunk by it too."""
        return absolute_position

    def slack(self) -> int:
        """Tokens a layer may hold beyond its size between two evictions (block eviction: evict_every − 1); the
        engine's in-place slot buffers (kvbench.native.slots) leave room for them."""
        return 0
