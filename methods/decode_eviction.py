"""Decode-time eviction, shared by H2O, StreamingLLM and TOVA: hold every layer at its size while generating.

Prefill selection (`keep_indices`, `layer_tokens`) decides what the compressed prompt keeps; this part decides
what the cache holds afterwards, so a method that evicts while decoding writes only its policy, in its compression
(an `Evicting`, the per-example object its `begin` returns): `decode_keep` (which of a layer's tokens to keep once it
is over its size), and, when it tracks state, `start_decoding` and `observe_step`.

Each layer's size after `compress` is what it kept — or the budget itself when an absolute budget is at least the
prompt: nothing is evicted at prefill and decoding evicts once the cache reaches the budget, as the originals hold
their cache at the budget. Budget 1.0 (and no budget) never evicts: the full cache, exactly. Tokens appended
uncompressed after compression (`on_extend`, the question when query_aware=false) grow the sizes. Streaming
(task=ppl, kvbench.native.streaming) compresses the first chunk, then evicts like a decode step after each chunk
(`evict_streamed_layer`; `stream_evicts`).

Block eviction (`evict_every` = k): the originals evict one token at every decode step, which costs a gather of
the whole cache per step — more than the growing full cache pays. With k > 1 a layer grows for k − 1 steps and
at the k-th evicts down to its size at once (k tokens), so the gather is paid once per k steps. The slack: after
each step a layer holds between size and size + k − 1 tokens (size + k during the step's own attention); kv_bytes
is measured at the end of generation as always, i.e. size + (decode steps mod k) tokens — what is physically held
then (the planner predicts the same: `held_after_decoding`); the most it holds between steps is size + k − 1. Every
step's attention is still observed (`observe_step`: H2O adds it to its scores), so k changes only when and how many
tokens go at once: H2O drops the k lowest-scored tokens outside the recent window together instead of one per step
(the window has moved on by then); StreamingLLM keeps exactly what per-step eviction keeps at every k-th step.
k = 1 is the originals' per-step eviction, unchanged (the default).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvbench import KvbenchError
from kvbench.config.registry import knob
from kvbench.methods.base import Budget, Capabilities, Method
from kvbench.methods.compression import Compression
from kvbench.model.attention import StatsRecorder
from kvbench.model.cache import layer_lengths, layer_select


class Evicting(Compression, abc.ABC):
    """One example's compression by a `DecodeEviction` method: what it kept, then each layer's size while
    decoding; subclasses implement `decode_keep` (and `start_decoding`, `observe_step` when they track state)."""

    acts_while_decoding = True
    method: DecodeEviction

    def __init__(self, method: DecodeEviction, n_prompt: int, n_layers: int, budget: Budget | None):
        super().__init__(method, n_prompt, n_layers, budget)
        self.sizes: list[int] | None = None  # per layer while decoding; None: the cache is not held (budget 1.0)
        self.like: torch.Tensor | None = None  # (B, H_kv, 0): shape and device for decode-time indices

    def layer(self, layer_idx, keys, values, stats):
        self.like = keys.new_empty(*keys.shape[:2], 0)  # (B, H_kv, 0)
        return super().layer(layer_idx, keys, values, stats)

    def end(self, layers, stats: StatsRecorder):
        cache = super().end(layers, stats)
        self.sizes = self.method.sizes_to_hold(layer_lengths(cache), self.n_prompt, self.budget)
        if self.sizes is not None:
            cache = self.start_decoding(cache, stats)
        return cache

    # ---- decoding ------------------------------------------------------------------------------------------
    def start_decoding(self, cache, stats: StatsRecorder):
        """Called once after compression when the cache will be held; returns the cache to decode from."""
        return cache

    @abc.abstractmethod
    def decode_keep(self, layer_idx: int, layer, size: int, stats: StatsRecorder) -> torch.Tensor:
        """Positions (B, H_kv, size) of `layer` to keep, sorted ascending; called only when it is over its size."""

    def observe_step(self, layer_idx: int, layer, stats: StatsRecorder) -> None:
        """Called after every forward while decoding (also the steps that do not evict): accumulate scores."""

    def slack(self) -> int:
        return self.method.evict_every - 1

    def decode_request(self):
        if self.sizes is not None and self.method.caps.evicts_while_decoding:
            return self.method.stats_request()
        return super().decode_request()

    def on_extend(self, n_tokens: int) -> None:
        if self.sizes is not None:
            self.sizes = [size + n_tokens for size in self.sizes]

    def on_decode_step(self, cache, stats: StatsRecorder) -> None:
        if self.sizes is not None and self.method.caps.evicts_while_decoding:
            for layer_idx, (layer, size) in enumerate(zip(cache.layers, self.sizes)):
                self._evict_layer(layer_idx, layer, size, stats, slack=self.method.evict_every - 1)

    def evict_streamed_layer(self, layer_idx: int, layer, stats: StatsRecorder) -> None:
        """A streamed chunk's layer (task=ppl, after the first chunk; `stream_evicts`) evicted as a decode step
        evicts it, without block slack."""
        if self.sizes is not None:
            self._evict_layer(layer_idx, layer, self.sizes[layer_idx], stats)

    def _evict_layer(self, layer_idx: int, layer, size: int, stats: StatsRecorder, slack: int = 0) -> None:
        """The layer observes the step, then drops to its size if it is over its size + `slack`."""
        if isinstance(layer, DynamicSlidingWindowLayer):
            return  # a sliding layer keeps its window (kvbench.model.cache.WindowLayer): nothing to hold or observe
        self.observe_step(layer_idx, layer, stats)
        if layer.get_seq_length() > size + slack:
            layer_select(layer, self.decode_keep(layer_idx, layer, size, stats))  # (B, H_kv, size)


@dataclass
class DecodeEviction(Method):
    """A `Method` that keeps evicting after prefill; its compression (`compression`, an `Evicting` subclass)
    holds the sizes and implements `decode_keep`."""

    evict_every: int = knob(
        1, min=1, tokens=True
    )  # decode steps per eviction: 1 = every step (the originals); k: k tokens at once, slack k − 1

    caps = Capabilities(evicts_while_decoding=True)  # a subclass whose knob turns it off replaces it
    compression: ClassVar[type[Evicting]]  # each subclass's own, returned by `begin`
    # False: a cache that compression left whole (budget ≥ the prompt) grows while decoding (TOVA's original)
    holds_whole_prompt: ClassVar[bool] = True
    # streaming (task=ppl): after the first chunk, evict like a decode step (False: every chunk re-selects from
    # all the layer holds, TOVA)
    stream_evicts: ClassVar[bool] = True

    def __post_init__(self):
        if not isinstance(self.evict_every, int) or self.evict_every < 1:
            raise KvbenchError(
                f"evict_every={self.evict_every!r}: give the number of decode steps between evictions, an integer "
                f">= 1 (1 = every step, as the original; e.g. evict_every=32)"
            )

    def begin(self, n_prompt: int, n_layers: int, budget: Budget | None) -> Evicting:
        return self.compression(self, n_prompt, n_layers, budget)

    # ---- byte accounting -----------------------------------------------------------------------------------
    def sizes_to_hold(self, kept: list[int], n_prompt: int, budget: Budget | None) -> list[int] | None:
        """Each layer's size while decoding, from what compression kept of an n_prompt-token prompt; None: the cache
        grows. The one rule both `Evicting.end` and the planner's byte accounting (`held_after_decoding`) follow."""
        if any(n < n_prompt for n in kept):
            return kept
        if not self.holds_whole_prompt or budget is None or not self.caps.has_budget or budget.value == 1.0:
            return None
        if budget.is_tokens:  # an absolute budget ≥ the prompt: hold the cache at the budget itself
            return [int(budget.value)] * len(kept)
        return kept  # a fraction that rounds to the whole (short) prompt: hold it there

    def held_after_decoding(self, kept, n_prompt, budget, appended, decoded):
        """Held at `sizes_to_hold` (grown by the appended tokens, `on_extend`): over size + evict_every − 1 a layer
        drops to its size (blocks of evict_every steps)."""
        sizes = self.sizes_to_hold(kept, n_prompt, budget) if self.caps.evicts_while_decoding else None
        if sizes is None:
            return super().held_after_decoding(kept, n_prompt, budget, appended, decoded)
        held = []
        for n, size in zip(kept, sizes):
            tokens, size = n + appended, size + appended
            rings, ringed = self.rings_at(size), False
            for _ in range(decoded):
                tokens += 1
                if tokens > size + self.evict_every - 1:
                    tokens = size
                ringed = ringed or (rings and tokens == size)
            held.append(tokens + ringed)
        return held, True

    def rings_at(self, size: int) -> bool:
        """Whether a layer held at `size` moves into a ring buffer once it is there, holding one slot more from then
        on (StreamingLLM ring=true, kvbench/model/ring.py)."""
        return False
