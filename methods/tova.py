"""TOVA — Token Omission Via Attention (Oren et al. 2024, https://arxiv.org/abs/2401.06104;
schwartz-lab-NLP/TOVA src/tova_cache.py, kvpress's TOVAPress).

A token's score is the attention the *current* (last) query pays to it, averaged over all query heads of the
layer, so every KV head of a layer keeps the same positions. After prefill the cache keeps the top `n_keep`
positions by the last prompt token's attention; then, as in the original's `reduce`, every decode step appends the
new token and evicts down to the same size by the new query's head-averaged attention — the new token included
(the original does not protect it; kvpress pins it, a difference its docstring calls negligible).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.attention import StatsRequest
from kvbench.cache import layer_lengths, layer_select
from kvbench.methods.base import METHODS
from kvbench.methods.scorer import ScoreEviction
from kvbench.methods.scoring import top_k_sorted


@METHODS.register("tova")
@dataclass
class TOVA(ScoreEviction):
    evict_during_decode: bool = True  # the original: a constant-size cache while generating

    def __post_init__(self):
        self._size: list[int] | None = None

    def stats_request(self) -> StatsRequest:
        return StatsRequest(windows=frozenset({1}))  # the last query's attention row

    def decode_request(self) -> StatsRequest:
        return self.stats_request() if self._size is not None else StatsRequest()

    def scores(self, layer_idx, keys, values, stats):
        row = stats.window[1][layer_idx]  # (B, H_q, T): softmax of the last query over every key
        return row.mean(dim=1, keepdim=True).expand(-1, keys.shape[1], -1)  # (B, H_kv, T), same for every head

    def reset(self) -> None:
        self._size = None

    def begin_compress(self, n_prompt, n_layers, budget):
        super().begin_compress(n_prompt, n_layers, budget)
        self._n_prompt = n_prompt

    def end_compress(self, layers, stats, budget):
        cache = super().end_compress(layers, stats, budget)
        evicted = any(n < self._n_prompt for n in layer_lengths(cache))
        self._size = layer_lengths(cache) if evicted and self.evict_during_decode else None  # budget 1.0: never
        return cache

    def evicts_while_decoding(self) -> bool:
        return self.evict_during_decode

    def on_extend(self, n_tokens: int) -> None:
        if self._size is not None:
            self._size = [size + n_tokens for size in self._size]

    def on_decode_step(self, cache, stats) -> None:
        if self._size is None:
            return
        for layer_idx, (layer, size) in enumerate(zip(cache.layers, self._size)):
            if layer.get_seq_length() > size:  # the new token pushed the layer over: drop the least attended
                layer_select(layer, top_k_sorted(self.scores(layer_idx, layer.keys, layer.values, stats), size))
