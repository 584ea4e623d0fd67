"""StreamingLLM: attention sinks + a recent window (Xiao et al. 2023, https://arxiv.org/abs/2309.17453).

Keeps the first `start_size` tokens (sinks) and the most recent ones, evicting the middle after prefill and,
as the original does, at every decode step so the cache stays a constant size.

Positions: `absolute` (default; as kvpress and KVCache-Factory) keeps each token's original RoPE position;
`rolling` is the original mit-han-lab code's scheme: positions are counted inside the cache (sinks 0..s−1,
then the recent tokens contiguously), which is what lets it stream past the trained context. The original
stores pre-RoPE keys and rotates on read; here kept keys are re-rotated by (new − old position) on eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.cache import layer_lengths, layer_select
from kvbench.methods.base import METHODS, Method
from kvbench.methods.scoring import check_choice
from kvbench.rope import inv_freq_of, rerotate


def sink_and_recent(n_tokens: int, start_size: int, n_keep: int, like: torch.Tensor) -> torch.Tensor:
    """Indices [0, start_size) ∪ [n_tokens - (n_keep - start_size), n_tokens) as (B, H_kv, n_keep).

    like: any (B, H_kv, ...) tensor on the cache's device."""
    recent = n_keep - start_size
    index = torch.cat([torch.arange(start_size), torch.arange(n_tokens - recent, n_tokens)]).to(like.device)
    return index.expand(like.shape[0], like.shape[1], -1)  # (B, H_kv, n_keep)


@METHODS.register("streamingllm")
@dataclass
class StreamingLLM(Method):
    start_size: int = 4  # attention sinks kept at the start
    evict_during_decode: bool = True  # keep the cache at its post-prefill size while generating (the original)
    positions: str = "absolute"  # absolute | rolling (re-indexed inside the cache, the original code)

    def __post_init__(self):
        check_choice("positions", self.positions, ("absolute", "rolling"))
        self._size: list[int] | None = None
        self._inv_freq: torch.Tensor | None = None

    def bind(self, lm) -> None:
        if self.positions == "rolling":
            self._inv_freq = inv_freq_of(lm.model)

    def min_tokens(self) -> int:
        return self.start_size + 1

    def reset(self) -> None:
        self._size = None

    def keep_indices(self, layer_idx, keys, stats, n_keep):
        return sink_and_recent(keys.shape[2], self.start_size, n_keep, keys)

    def compress(self, prefill_kv, stats, budget):
        cache = super().compress(prefill_kv, stats, budget)
        evicted = layer_lengths(cache) != [keys.shape[2] for keys, _ in prefill_kv]
        # budget 1.0 means no eviction at all, during decoding too
        self._size = layer_lengths(cache) if evicted else None
        keys = prefill_kv[0][0]
        self._like = keys.new_empty(*keys.shape[:2], 0)  # (B, H_kv, 0): shape and device for decode-time indices
        if evicted and self.positions == "rolling":
            n_prompt, n_keep = prefill_kv[0][0].shape[2], self._size[0]
            shift = torch.zeros(n_keep, dtype=torch.long)  # sinks stay; recent tokens move down by the gap
            shift[self.start_size :] = -(n_prompt - n_keep)
            self._rerotate(cache, shift)
        return cache

    def _rerotate(self, cache, shift: torch.Tensor) -> None:
        for layer in cache.layers:
            layer.keys = rerotate(layer.keys, shift.to(layer.keys.device), self._inv_freq.to(layer.keys.device))  # type: ignore[union-attr]  # bind() set it: rolling

    def position(self, absolute_position: int, cache) -> int:
        if self.positions == "rolling" and self._size is not None:
            return cache.layers[0].get_seq_length()  # the next slot inside the cache
        return absolute_position

    def evicts_while_decoding(self) -> bool:
        return self.evict_during_decode

    def on_extend(self, n_tokens: int) -> None:
        if self._size is not None:
            self._size = [size + n_tokens for size in self._size]

    def on_decode_step(self, cache, stats) -> None:
        if not self.evict_during_decode or self._size is None:
            return
        for layer, size in zip(cache.layers, self._size):
            n_tokens = layer.get_seq_length()
            if n_tokens > size:  # drop the oldest non-sink token(s)
                index = sink_and_recent(n_tokens, self.start_size, size, self._like)
                layer_select(layer, index)
                if self.positions == "rolling":  # the recent tokens slide down into the freed slots
                    shift = torch.zeros(size, dtype=torch.long)
                    shift[self.start_size :] = -(n_tokens - size)
                    layer.keys = rerotate(layer.keys, shift.to(layer.keys.device),
                                          self._inv_freq.to(layer.keys.device))  # type: ignore[union-attr]  # rolling
