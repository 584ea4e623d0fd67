"""The method interface.

A method is a small dataclass whose fields are its knobs, with their defaults (conf/method/<name>.yaml repeats them
for Hydra; tests/methods/test_methods.py checks that the two agree for every registered method). Every module in
methods/ is imported by methods/__init__.py, so a new file with `@METHODS.register("name")` is all it takes. The engine
drives a method through these hooks, each with a working default, so a method overrides only what it changes:

prefill and selection
- `bind(lm)`                          see the loaded model (RoPE frequencies for position re-indexing)
- `prepare_model(model)`              change the model itself (head merging); such methods opt out of shared prefill
- `stats_request()`                   attention statistics the prefill must record (observation window, all queries)
- `min_tokens()`                      the fewest kept tokens the method works with (its sinks/windows)
- `layer_tokens(n_keep, L, T)`        tokens kept per layer (uniform; PyramidKV redistributes them)
- `layer_keep_counts(T, L, budget)`   prompt tokens each layer keeps (the rule `compress` and the planner share)
- `keep_indices(layer, K, stats, n)`  per layer and KV head, which prompt positions to keep
- `compress(prefill_kv, stats, budget)`  the cache to decode from after a shared prefill: the three hooks below
- `begin_compress(T, L, budget)`      forget the last example, fix each layer's count for the whole prompt
- `compress_layer(l, K, V, stats)`    one layer's cache layer: `keep_indices` gathered by default; quantized
                                      caches build their own layers here. prefill=inline calls it inside the
                                      forward pass right after layer l's attention (kvbench/engine/inline.py), and
                                      prefill_chunk again after every chunk with what the layer then holds
- `observe_layer(l, K, stats)`        a layer kept whole: methods accumulating scores (H2O) add this pass's
- `end_compress(layers, stats, budget)`  the cache holding the layers; decode-time state is set up here
- `compresses_per_layer()`, `chunk_limit`  whether prefill=inline / prefill_chunk serve the method (validated)
decoding (methods/decode_eviction.py's DecodeEviction implements these once for H2O and StreamingLLM)
- `reset()`                           forget per-example state
- `decode_request()`                  statistics each decode forward must record
- `on_extend(n)`                      n uncompressed tokens are appended (the question when query_aware=false)
- `on_decode_start(cache, position)`  Engine.decode starts decoding one by one (StreamingLLM's ring starts here)
- `on_decode_step(cache, stats)`      after each decode forward: evict to stay at the budget
- `decodes_alone()`                   never a grid row (its own decode-time layers)
- `evicts_while_decoding()`           whether on_decode_step evicts (compose checks its precision part can drop tokens)
- `position(absolute, cache)`         the RoPE position of the next token (absolute by default; StreamingLLM can roll)
- `stream_bound(cache, stats, budget, first)`  keep a streamed text's cache bounded (perplexity task) after a
                                      chunk: `begin_stream`, `stream_layer` per layer, `end_stream` (prefill=inline
                                      calls `stream_layer` inside the forward, right after each layer's attention)
recording
- `params()`                          the knobs as recorded in the `method_params` column
- `lossless_params(lm)`               knobs under which the method must reproduce the full cache exactly (tested)
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import DynamicCache

from kvbench import KvbenchError
from kvbench.config.registry import Registry, build_dataclass
from kvbench.model.attention import StatsRecorder, StatsRequest
from kvbench.model.cache import KV, gather_kv, kv_layer

METHODS = Registry("method")


@dataclass(frozen=True)
class Budget:
    """Prompt KV tokens kept per layer: a fraction in (0, 1] of the prompt, or an absolute count (> 1, integer)."""

    value: float

    @classmethod
    def parse(cls, value) -> Budget:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise KvbenchError(
                f"budget={value!r} is not a number; give a fraction in (0, 1] or a token count"
            ) from None
        if not number > 0 or math.isinf(number):
            raise KvbenchError(f"budget={value} must be > 0: a fraction in (0, 1] (1.0 = no eviction) or a token count")
        if number > 1 and not number.is_integer():
            raise KvbenchError(
                f"budget={value}: a fraction must be in (0, 1]; "
                "a budget above 1 is a token count and must be an integer"
            )
        return cls(number)

    @property
    def is_tokens(self) -> bool:
        return self.value > 1

    def tokens(self, prompt_tokens: int) -> int:
        """Tokens to keep out of `prompt_tokens` (never more than the prompt)."""
        if self.is_tokens:
            return min(int(self.value), prompt_tokens)
        return min(prompt_tokens, max(1, round(self.value * prompt_tokens)))


@dataclass
class Method:
    name: ClassVar[str]
    has_budget: ClassVar[bool] = True  # False: the method keeps every token (quantization, full)
    shares_prefill: ClassVar[bool] = True  # False: the method changes the prefill itself (head merging)
    family: ClassVar[str] = "eviction"  # eviction | precision | structure | none: what `compose` stacks
    layers_can_select: ClassVar[bool] = True  # precision methods: do its cache layers support token eviction

    # ---- prefill -------------------------------------------------------------------------------------------
    def bind(self, lm) -> None:
        """Called with the LoadedModel before compressing (methods needing e.g. RoPE frequencies keep them)."""

    def stats_request(self) -> StatsRequest:
        return StatsRequest()

    def prepare_model(self, model):
        return model

    def min_tokens(self) -> int:
        """The smallest number of kept tokens the method can work with (sinks, windows)."""
        return 1

    def layer_tokens(self, n_keep: int, n_layers: int, n_prompt: int) -> list[int]:
        """Tokens kept in each layer; uniform by default (PyramidKV redistributes the same total)."""
        return [n_keep] * n_layers

    def keep_indices(self, layer_idx: int, keys: torch.Tensor, stats: StatsRecorder, n_keep: int) -> torch.Tensor:
        """Positions to keep for one layer: (B, H_kv, n_keep) int64, sorted ascending."""
        raise KvbenchError(f"method {self.name!r} does not evict tokens")

    def layer_keep_counts(self, n_prompt: int, n_layers: int, budget: Budget | None) -> list[int] | None:
        """Prompt tokens each layer keeps under `budget`; None when nothing is evicted. The one rule both
        `compress` and the planner's byte accounting (kvbench.model.kv_bytes) follow."""
        if budget is None or not self.has_budget:
            return None
        n_keep = budget.tokens(n_prompt)
        if n_keep >= n_prompt:
            return None
        if n_keep < self.min_tokens() and not budget.is_tokens:
            # a fraction of a short prompt: keep the method's minimum (its window/sinks) instead, as SnapKV
            # compresses only prompts longer than its capacity; the measured kv_ratio records what was kept
            n_keep = self.min_tokens()
            if n_keep >= n_prompt:
                return None
        if n_keep < self.min_tokens():
            raise KvbenchError(
                f"budget {budget.value} keeps {n_keep} of {n_prompt} prompt tokens, fewer than {self.name} needs "
                f"({self.min_tokens()}: its sinks/windows); raise the budget or shrink the window"
            )
        return [min(n, n_prompt) for n in self.layer_tokens(n_keep, n_layers, n_prompt)]

    def compress(self, prefill_kv: list[KV], stats: StatsRecorder, budget: Budget | None):
        """The cache to decode from, after the whole prefill (`prefill=shared`): `begin_compress`, then
        `compress_layer` for each layer, then `end_compress` — the same calls `prefill=inline` makes inside the
        forward pass, one layer at a time (kvbench.engine.inline)."""
        self.begin_compress(prefill_kv[0][0].shape[2], len(prefill_kv), budget)
        layers = [self.compress_layer(i, keys, values, stats) for i, (keys, values) in enumerate(prefill_kv)]
        return self.end_compress(layers, stats, budget)

    def begin_compress(self, n_prompt: int, n_layers: int, budget: Budget | None) -> None:
        """Before the first layer: forget the last example, fix each layer's kept count for the whole prompt.

        Records `kept_positions` (kvbench.guide.diagnose): per layer the (B, H_kv, N) prompt positions kept, None
        where a layer keeps every token."""
        self.reset()
        self.kept_positions: list[torch.Tensor | None] = [None] * n_layers
        self._keep_counts = self.layer_keep_counts(n_prompt, n_layers, budget)
        self._layer_values: torch.Tensor | None = None  # compress_layer's values, for value-aware scorers
        self._seen = [0] * n_layers  # prompt tokens each layer has been given (chunked prefill: so far)

    def compress_layer(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, stats: StatsRecorder):
        """One layer's cache layer to decode from, given everything it holds now, keys/values (B, H_kv, T, D):
        `keep_indices` gathered into new tensors when the layer holds more than its count, else kept whole.

        Chunked prefill calls it again after every chunk with what the layer then holds (kept tokens + the chunk);
        `stats` are always the current pass's, over all of the layer's keys."""
        n_keep = None if self._keep_counts is None else self._keep_counts[layer_idx]
        slots = self._slot_positions(layer_idx, keys.shape[2], keys)  # (B, H_kv, T) prompt positions, or None
        if n_keep is None or n_keep >= keys.shape[2]:
            self.observe_layer(layer_idx, keys, stats)
            self.kept_positions[layer_idx] = slots
            return kv_layer(keys, values)
        self._layer_values = values  # value-aware scorers (methods/scorer.py) read the layer's values
        try:
            index = self.keep_indices(layer_idx, keys, stats, n_keep)  # (B, H_kv, n_keep)
        finally:
            self._layer_values = None
        self.kept_positions[layer_idx] = index if slots is None else slots.gather(-1, index)  # (B, H_kv, n_keep)
        return kv_layer(*gather_kv(keys, values, index))

    def _slot_positions(self, layer_idx: int, n_slots: int, like: torch.Tensor) -> torch.Tensor | None:
        """Prompt positions of a layer's `n_slots` cache slots: the positions kept so far, then the new tokens;
        None while the layer has never been evicted (slot = position)."""
        held = self.kept_positions[layer_idx]  # (B, H_kv, P) or None
        seen = self._seen[layer_idx]
        self._seen[layer_idx] = seen + n_slots - (seen if held is None else held.shape[-1])
        if held is None:
            return None
        new = torch.arange(seen, self._seen[layer_idx], device=held.device)  # (T − P,)
        return torch.cat([held, new.expand(*held.shape[:2], -1)], dim=-1)  # (B, H_kv, T)

    def observe_layer(self, layer_idx: int, keys: torch.Tensor, stats: StatsRecorder) -> None:
        """A layer kept whole by `compress_layer` (under its count): methods that accumulate scores (H2O) add
        this pass's statistics, so a later chunk or decode step evicts with them."""

    def end_compress(self, layers: list, stats: StatsRecorder, budget: Budget | None):
        """After the last layer: the cache holding `layers` (methods with decode-time state set it up here)."""
        cache = DynamicCache()
        cache.layers = list(layers)
        return cache

    @classmethod
    def compresses_per_layer(cls) -> bool:
        """Whether `prefill=inline` can compress this method layer by layer: true unless the method overrides
        `compress` itself instead of the begin/compress_layer/end hooks (e.g. one needing every layer first)."""
        return getattr(cls.compress, "__qualname__", "") == "Method.compress" and cls.compresses_inline

    compresses_inline: ClassVar[bool] = True  # False: a method whose selection needs every layer's statistics
    chunk_limit: ClassVar[str] = ""  # why the method cannot re-compress after each prefill chunk ("": it can)

    def chunkable(self) -> bool:
        """Whether `prefill_chunk` can re-compress this method's cache after every chunk."""
        return not self.chunk_limit

    # ---- decode --------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget per-example state (called at the start of each example's compression)."""

    def decode_request(self) -> StatsRequest:
        return StatsRequest()

    def on_extend(self, n_tokens: int) -> None:
        """`n_tokens` are about to be appended uncompressed (the question when query_aware=false): methods that
        evict while decoding grow their size by that much instead of evicting the context for them."""

    def evicts_while_decoding(self) -> bool:
        return False

    def on_decode_step(self, cache, stats: StatsRecorder) -> None:
        """Called after each decode forward (the new token is already in the cache)."""

    def acts_on_decode_steps(self) -> bool:
        """Whether `on_decode_step` does anything (a subclass overrides it): the decode loops then run it per row."""
        return type(self).on_decode_step is not Method.on_decode_step

    def on_decode_start(self, cache, position: int) -> None:
        """Decoding one token per step starts from `cache` (the next token at `position`): Engine.decode and
        batched examples (kvbench.engine.batched) call it; grid batches and diagnose do not."""

    def decodes_alone(self) -> bool:
        """Whether decoding needs Engine.decode's own loop (StreamingLLM's ring layers): never a grid row."""
        return False

    # ---- streaming (task=ppl) -----------------------------------------------------------------------------
    def stream_bound(self, cache, stats: StatsRecorder, budget: Budget | None, first: bool):
        """Streaming (perplexity): bound the cache after a whole chunk's forward; returns the cache to continue with.
        `begin_stream`, `stream_layer` per layer, `end_stream`: the calls ppl with prefill=inline makes one layer at a
        time inside the forward (kvbench.engine.streaming), so both bound every layer identically."""
        self.begin_stream(cache.layers[0].get_seq_length(), len(cache.layers), budget, first)
        layers = [self.stream_layer(i, layer, stats) for i, layer in enumerate(cache.layers)]
        cache.layers[:] = layers
        return self.end_stream(cache, stats, budget)

    def begin_stream(self, n_tokens: int, n_layers: int, budget: Budget | None, first: bool) -> None:
        """Before a streamed chunk's layers are bounded; n_tokens: what each layer holds, the chunk included.

        Eviction methods re-select from what each layer holds (with this chunk's statistics): a fresh compression
        to the budget; methods without a budget compress once, after the first chunk (quantization), and then let
        the cache grow."""
        self._stream_compresses = first or self.has_budget
        if self._stream_compresses:
            self.begin_compress(n_tokens, n_layers, budget if self.has_budget else None)

    def stream_layer(self, layer_idx: int, layer, stats: StatsRecorder):
        """One layer right after this chunk's attention (it holds what it kept + the chunk): the layer to keep."""
        if not self._stream_compresses:
            return layer
        return self.compress_layer(layer_idx, layer.keys, layer.values, stats)

    def end_stream(self, cache, stats: StatsRecorder, budget: Budget | None):
        """After every layer of a chunk is bounded: the cache to continue with."""
        if not self._stream_compresses:
            return cache
        return self.end_compress(list(cache.layers), stats, budget if self.has_budget else None)

    def position(self, absolute_position: int, cache) -> int:
        """RoPE position for the next token; the original absolute position unless the method re-indexes."""
        return absolute_position

    @classmethod
    def lossless_params(cls, lm) -> dict | None:
        """Parameters under which the method must reproduce the full cache exactly (tested for every method);
        None for a method that has no lossless setting."""
        return {}

    def params(self) -> dict:
        """The knobs as recorded in the `method_params` column."""
        from dataclasses import asdict

        return asdict(self)


def method_defaults(name: str) -> dict:
    """A registered method's knobs and their defaults (its dataclass fields), for methods built by name (grids,
    compose); conf/method/<name>.yaml repeats them for Hydra (a test checks they agree)."""
    defaults = {}
    for knob in dataclasses.fields(METHODS.get(name)):
        if knob.init and knob.default is not dataclasses.MISSING:
            defaults[knob.name] = copy.deepcopy(knob.default)
        elif knob.init and knob.default_factory is not dataclasses.MISSING:
            defaults[knob.name] = knob.default_factory()
    return defaults


def build_method(name: str, params: dict | None = None) -> Method:
    """Instantiate a registered method from its config (unknown names and parameters list the valid ones)."""
    cls = METHODS.get(name)
    return build_dataclass(cls, dict(params or {}), f"method {name!r}")
