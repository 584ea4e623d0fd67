"""StreamingLLM: attention sinks + a recent window (Xiao et al. 2023, https://arxiv.org/abs/2309.17453).

Keeps the first `start_size` tokens (sinks) and the most recent ones, evicting the middle after prefill and,
as the original does, at every decode step so the cache stays a constant size (methods/decode_eviction.py).

Positions: `absolute` (default; as kvpress and KVCache-Factory) keeps each token's original RoPE position;
`rolling` is the original mit-han-lab code's scheme: positions are counted inside the cache (sinks 0..s−1,
then the recent tokens contiguously), which is what lets it stream past the trained context. The original
stores pre-RoPE keys and rotates on read; here the cache layers (kvbench.model.rope.RollingLayer) store each key as
the model rotated it and rotate it on read to its slot, so keys never drift however long the stream.

`ring=true` (positions=absolute, evict_every=1): once a layer is at its size while decoding, it moves into a ring
buffer (kvbench.model.ring.RingLayer) whose decode step writes the new token in place over the token per-step eviction
drops next: the same tokens attended at every step, no per-step copy of the layer; the layer holds size + 1 tokens.
Decoding one by one (`Engine.decode`) and batched examples (`batch_size`, unpadded rows) ring their plain tensor
layers; grids decode such rows alone; paged (prefix-cache) layers and `diagnose` keep per-step eviction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import DynamicLayer

from kvbench import KvbenchError
from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, check_choice
from kvbench.methods.decode_eviction import DecodeEviction, Evicting
from kvbench.model.ring import RingLayer
from kvbench.model.rope import RollingLayer, inv_freq_of


def sink_and_recent(n_tokens: int, start_size: int, n_keep: int, like: torch.Tensor) -> torch.Tensor:
    """Indices [0, start_size) ∪ [n_tokens - (n_keep - start_size), n_tokens) as (B, H_kv, n_keep).

    like: any (B, H_kv, ...) tensor on the cache's device."""
    recent = n_keep - start_size
    sinks = torch.arange(start_size, device=like.device)
    index = torch.cat([sinks, torch.arange(n_tokens - recent, n_tokens, device=like.device)])  # (n_keep,)
    return index.expand(like.shape[0], like.shape[1], -1)  # (B, H_kv, n_keep)


class StreamingCompression(Evicting):
    """One example's StreamingLLM: sinks + recent while decoding; with ring=true, how far Engine.decode has
    gone (the ring layers' slots follow it)."""

    method: StreamingLLM

    def __init__(self, method: StreamingLLM, n_prompt: int, n_layers: int, budget):
        super().__init__(method, n_prompt, n_layers, budget)
        self.decoded_to: int | None = None  # ring: tokens seen so far while Engine.decode runs; None: no ring
        self.all_rings = False  # every layer rings: a decode step has nothing left to evict or convert
        self._kept: tuple[tuple[int, int], torch.Tensor] | None = None  # (tokens, size) → the last step's positions

    def start_decoding(self, cache, stats):
        method = self.method
        if method.positions == "rolling":  # each kept key remembers the position it was rotated at
            for layer_idx, layer in enumerate(cache.layers):
                n_kept = layer.keys.shape[2]
                kept = (
                    sink_and_recent(self.n_prompt, method.start_size, n_kept, layer.keys)[0, 0]
                    if n_kept < self.n_prompt
                    else torch.arange(self.n_prompt)
                )
                cache.layers[layer_idx] = RollingLayer(layer.keys, layer.values, kept, method.inv_freq)
        return cache

    def position(self, absolute_position: int, cache) -> int:
        if self.method.positions == "rolling" and self.sizes is not None:
            return cache.layers[0].get_seq_length()  # the next slot inside the cache
        return absolute_position

    def on_decode_start(self, cache, position: int) -> None:
        if self.method.ring and self.sizes is not None:
            self.decoded_to, self.all_rings = position, False

    def on_decode_step(self, cache, stats) -> None:
        if self.all_rings:
            return
        super().on_decode_step(cache, stats)  # per-step eviction (a ring layer is never over its size)
        if self.decoded_to is None:
            return
        assert self.sizes is not None  # a ring starts only on a held cache
        start_size = self.method.start_size
        self.decoded_to += 1
        for layer_idx, (layer, size) in enumerate(zip(cache.layers, self.sizes)):
            if type(layer) is DynamicLayer and layer.get_seq_length() == size > start_size:  # ring from now on
                keys, values = layer.keys, layer.values
                assert keys is not None and values is not None  # a layer holding tokens
                held = [*range(start_size), *range(self.decoded_to - size + start_size, self.decoded_to)]
                cache.layers[layer_idx] = RingLayer(keys, values, start_size, held)
        self.all_rings = all(isinstance(layer, RingLayer) for layer in cache.layers)

    def decode_keep(self, layer_idx, layer, size, stats):  # the layer is over its size
        assert self.like is not None  # set by `layer`
        key = (layer.get_seq_length(), size)  # the layers of a step share it: built once, not once a layer
        if self._kept is None or self._kept[0] != key:
            self._kept = key, sink_and_recent(key[0], self.method.start_size, size, self.like)  # oldest non-sinks go
        return self._kept[1]


@METHODS.register("streamingllm")
@dataclass
class StreamingLLM(DecodeEviction):
    start_size: int = knob(4, tokens=True)  # attention sinks kept at the start
    evict_during_decode: bool = True  # keep the cache at its post-prefill size while generating (the original)
    positions: str = "absolute"  # absolute | rolling (re-indexed inside the cache, the original code)
    ring: bool = False  # decode in a ring buffer: no per-step copy of the cache (positions=absolute, evict_every=1)

    compression = StreamingCompression

    def __post_init__(self):
        super().__post_init__()  # evict_every
        check_choice("positions", self.positions, ("absolute", "rolling"))
        if self.ring and (self.positions != "absolute" or self.evict_every != 1 or not self.evict_during_decode):
            raise KvbenchError(
                f"streamingllm ring=true overwrites the evicted token in place, which needs positions=absolute, "
                f"evict_every=1 and evict_during_decode=true (got positions={self.positions}, evict_every="
                f"{self.evict_every}, evict_during_decode={self.evict_during_decode}); drop ring=true or set those"
            )
        self.inv_freq: torch.Tensor | None = None  # the bound model's RoPE frequencies (positions=rolling)
        self.caps = replace(
            self.caps,
            evicts_while_decoding=self.evict_during_decode,
            decodes_alone=self.ring,  # its ring layers decode in Engine.decode's own loop: never a grid row
            reindexes_positions=self.positions == "rolling",
        )

    def bind(self, lm) -> None:
        if self.positions == "rolling":
            self.inv_freq = inv_freq_of(lm.model)

    def min_tokens(self) -> int:
        return self.start_size + 1

    def keep_indices(self, layer_idx, keys, values, stats, n_keep):
        return sink_and_recent(keys.shape[2], self.start_size, n_keep, keys)

    def rings_at(self, size: int) -> bool:
        return self.ring and size > self.start_size  # a ring needs a window beside the sinks
