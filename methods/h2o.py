"""H2O — Heavy-Hitter Oracle (Zhang et al. 2023, https://arxiv.org/abs/2306.14048; FMInference/H2O).

A cached token's score is the attention it has received, accumulated over every query so far (all prompt
queries at prefill, then each generated token), per head. The cache keeps the `recent` newest tokens plus the
highest-scoring "heavy hitters", and — as in the paper's real-drop mode — evicts the lowest-scoring token
outside the recent window at every decode step, so the cache stays at its budget. The original needs eager
attention and has no GQA support; here the column sums come from Q and K in chunks and a KV head's score is
the sum over its query group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench import KvbenchError
from kvbench.attention import StatsRequest
from kvbench.cache import layer_lengths, layer_select
from kvbench.methods.base import METHODS, Method
from kvbench.methods.scoring import per_kv_head, top_k_sorted


@METHODS.register("h2o")
@dataclass
class H2O(Method):
    recent_ratio: float = 0.5  # share of the budget kept as the recent window (the paper: 10 % heavy + 10 % recent)

    def __post_init__(self):
        if not 0 <= self.recent_ratio < 1:
            raise KvbenchError(f"recent_ratio={self.recent_ratio}: must be in [0, 1) (the rest are heavy hitters)")
        self.reset()

    def reset(self) -> None:
        self._scores: list[torch.Tensor] = []  # per layer (B, H_kv, T_cache), aligned with the cache
        self._size: list[int] | None = None
        self._recent = 0

    def bind(self, lm) -> None:
        self._n_kv_heads = lm.n_kv_heads

    def stats_request(self) -> StatsRequest:
        return StatsRequest(all_queries=True)

    def decode_request(self) -> StatsRequest:
        return StatsRequest(all_queries=True) if self._size is not None else StatsRequest()

    def min_tokens(self) -> int:
        return 2  # one heavy hitter and one recent token

    def recent_tokens(self, n_keep: int) -> int:
        return min(n_keep - 1, max(1, round(self.recent_ratio * n_keep))) if self.recent_ratio else 0

    def keep_indices(self, layer_idx, keys, stats, n_keep):
        """Recent window + top accumulated scores before it; remembers the kept tokens' scores for decoding."""
        self._recent = self.recent_tokens(n_keep)
        scores = per_kv_head(stats.all_queries[layer_idx], keys.shape[1], "sum")  # (B, H_kv, T)
        index = self._keep(scores, n_keep)  # (B, H_kv, n_keep)
        self._scores.append(scores.gather(-1, index))
        return index

    def _keep(self, scores: torch.Tensor, n_keep: int) -> torch.Tensor:
        n_tokens = scores.shape[-1]
        heavy = top_k_sorted(scores[..., : n_tokens - self._recent], n_keep - self._recent)  # (B, H_kv, heavy)
        recent = torch.arange(n_tokens - self._recent, n_tokens, device=scores.device)
        return torch.cat([heavy, recent.expand(*scores.shape[:2], -1)], dim=-1)  # (B, H_kv, n_keep)

    def compress(self, prefill_kv, stats, budget):
        cache = super().compress(prefill_kv, stats, budget)  # resets, then keep_indices per layer
        if len(self._scores) != len(prefill_kv):  # budget ≥ prompt: no eviction, during decoding either
            self.reset()
            return cache
        self._size = layer_lengths(cache)
        return cache

    def evicts_while_decoding(self) -> bool:
        return True

    def on_extend(self, n_tokens: int) -> None:
        if self._size is not None:
            self._size = [size + n_tokens for size in self._size]

    def on_decode_step(self, cache, stats) -> None:
        if self._size is None:
            return
        self._accumulate_and_evict(cache, stats, self._size)

    def _accumulate_and_evict(self, cache, stats, sizes: list[int]) -> None:
        for layer_idx, layer in enumerate(cache.layers):
            old = self._scores[layer_idx]  # (B, H_kv, T_cache − new)
            received = per_kv_head(stats.all_queries[layer_idx], old.shape[1], "sum")  # (B, H_kv, T_cache)
            received[..., : old.shape[-1]] += old  # accumulate; new tokens start from what they received now
            if received.shape[-1] > sizes[layer_idx]:  # over budget: drop the weakest non-recent tokens
                index = self._keep(received, sizes[layer_idx])
                layer_select(layer, index)
                received = received.gather(-1, index)
            self._scores[layer_idx] = received

    def stream_bound(self, cache, stats, budget, first: bool):
        """Streaming (perplexity): scores accumulate over every query since the first token, then evict."""
        n_layers = len(cache.layers)
        n_keep = budget.tokens(10**12)  # streams take absolute budgets (see kvbench.streaming)
        if first:
            self.reset()
            self._scores = [q.new_zeros(q.shape[0], self._n_kv_heads, 0)  # (B, H_kv, 0): nothing received yet
                            for q in (stats.all_queries[i] for i in range(n_layers))]
        self._recent = self.recent_tokens(n_keep)
        self._accumulate_and_evict(cache, stats, [n_keep] * n_layers)
        return cache
