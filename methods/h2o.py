"""H2O — Heavy-Hitter Oracle (Zhang et al. 2023, https://arxiv.org/abs/2306.14048; FMInference/H2O).

A cached token's score is the attention it has received, accumulated over every query so far (all prompt
queries at prefill, then each generated token), per head. The cache keeps the `recent` newest tokens plus the
highest-scoring "heavy hitters", and — as in the paper's real-drop mode — evicts the lowest-scoring token
outside the recent window at every decode step, so the cache stays at its budget (methods/decode_eviction.py). The
original needs eager attention and has no GQA support; here the column sums come from Q and K in chunks and a
KV head's score is the sum over its query group.

`score=sum` is the original's accumulated attention. Under a causal mask the key at position i has received
T − i queries, so the sum favours early tokens; `score=mean` divides by that count — kvpress's
ObservedAttentionPress normalisation (the average attention a key received), counted on through decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvbench import KvbenchError
from kvbench.methods.base import METHODS, check_choice, top_k_sorted
from kvbench.methods.decode_eviction import DecodeEviction, Evicting
from kvbench.methods.scorers import per_kv_head
from kvbench.model.attention import StatsRequest
from kvbench.model.cache import layer_select


class H2OCompression(Evicting):
    """One example's H2O: the attention each kept token has received so far (and, for score=mean, how many
    queries it was seen by), per layer; the recent window's length."""

    method: H2O

    def __init__(self, method: H2O, n_prompt: int, n_layers: int, budget):
        super().__init__(method, n_prompt, n_layers, budget)
        self.received: dict[int, torch.Tensor] = {}  # layer → (B, H_kv, T_cache) attention received, summed
        self.queries: dict[int, torch.Tensor] = {}  # layer → (B, H_kv, T_cache) queries each key received (mean)
        self.recent = 0

    # ---- scores --------------------------------------------------------------------------------------------
    def receive(self, layer_idx: int, stats, n_kv_heads: int) -> int:
        """Add this pass's attention (its Q queries are the newest positions) to the layer's scores; returns T."""
        received = per_kv_head(stats.all_queries[layer_idx], n_kv_heads, "sum")  # (B, H_kv, T)
        n_tokens = received.shape[-1]
        old = self.received.get(layer_idx)
        n_old = 0 if old is None else old.shape[-1]
        if old is not None:
            received[..., :n_old] += old  # new tokens start from what they received now
        self.received[layer_idx] = received
        if self.method.score == "mean":  # the denominators: only mean reads them
            # causal: key i (of T) is seen by the pass's last min(Q, T − i) queries, Q = T − n_old new tokens
            seen = (n_tokens - torch.arange(n_tokens, device=received.device)).clamp(max=n_tokens - n_old).float()
            queries = seen.expand_as(received).clone()  # (B, H_kv, T)
            if old is not None:
                queries[..., :n_old] += self.queries[layer_idx]
            self.queries[layer_idx] = queries
        return n_tokens

    def ranking(self, layer_idx: int) -> torch.Tensor:
        received = self.received[layer_idx]  # (B, H_kv, T)
        return received / self.queries[layer_idx] if self.method.score == "mean" else received

    def keep(self, layer_idx: int, n_keep: int) -> torch.Tensor:
        """Recent window + top scores before it (B, H_kv, n_keep); the layer's scores follow the kept tokens."""
        ranking = self.ranking(layer_idx)  # (B, H_kv, T)
        n_tokens = ranking.shape[-1]
        heavy = top_k_sorted(ranking[..., : n_tokens - self.recent], n_keep - self.recent)  # (B, H_kv, heavy)
        recent = torch.arange(n_tokens - self.recent, n_tokens, device=ranking.device)
        index = torch.cat([heavy, recent.expand(*ranking.shape[:2], -1)], dim=-1)  # (B, H_kv, n_keep)
        self.received[layer_idx] = self.received[layer_idx].gather(-1, index)
        if layer_idx in self.queries:  # score=mean
            self.queries[layer_idx] = self.queries[layer_idx].gather(-1, index)
        return index

    # ---- prefill and decoding ------------------------------------------------------------------------------
    def select(self, layer_idx, keys, values, stats, n_keep):
        """Recent window + top accumulated scores before it; remembers the kept tokens' scores for decoding."""
        self.recent = self.method.recent_tokens(n_keep)
        self.receive(layer_idx, stats, keys.shape[1])
        return self.keep(layer_idx, n_keep)

    def observe(self, layer_idx, keys, stats):
        """A layer kept whole (budget ≥ the prompt, or a chunk that fits): score its tokens for later evictions."""
        self.receive(layer_idx, stats, keys.shape[1])

    def start_decoding(self, cache, stats):
        assert self.sizes is not None  # called only when the cache is held
        self.recent = self.method.recent_tokens(min(self.sizes))
        return cache

    def observe_step(self, layer_idx, layer, stats):
        self.receive(layer_idx, stats, self.received[layer_idx].shape[1])  # every step's query votes

    def decode_keep(self, layer_idx, layer, size, stats):
        return self.keep(layer_idx, size)  # the layer is over its size

    def on_decode_step(self, cache, stats) -> None:
        """Every layer's step at once where the layers stand alike (plain layers holding the same tokens' count,
        one size, score=sum): one stacked score update and one ranking for all of them — per layer the very scores
        and kept positions the layer-by-layer step gives (the arithmetic is elementwise or along each row), without
        ~10 small tensor operations a layer per step. Else layer by layer."""
        layers, sizes = cache.layers, self.sizes
        if sizes is None or not self.method.caps.evicts_while_decoding or not self._alike(layers, sizes, stats):
            return super().on_decode_step(cache, stats)
        n_layers, n_tokens = len(layers), layers[0].get_seq_length()
        votes = torch.stack([stats.all_queries[i] for i in range(n_layers)])  # (L, B, H_q, T)
        n_kv_heads = self.received[0].shape[1]
        received = per_kv_head(votes.flatten(0, 1), n_kv_heads, "sum").view(n_layers, -1, n_kv_heads, n_tokens)
        n_old = self.received[0].shape[-1]
        received[..., :n_old] += torch.stack([self.received[i] for i in range(n_layers)])  # (L, B, H_kv, T)
        index = None
        if n_tokens > sizes[0] + self.slack():
            heavy = top_k_sorted(received[..., : n_tokens - self.recent], sizes[0] - self.recent)  # (L, B, H_kv, ·)
            recent = torch.arange(n_tokens - self.recent, n_tokens, device=received.device)
            index = torch.cat([heavy, recent.expand(*received.shape[:3], -1)], dim=-1)  # (L, B, H_kv, size)
            received = received.gather(-1, index)
        for i, layer in enumerate(layers):
            self.received[i] = received[i]  # (B, H_kv, T or size)
            if index is not None:
                layer_select(layer, index[i])

    def _alike(self, layers, sizes: list[int], stats) -> bool:
        """Whether `on_decode_step` can take every layer at once."""
        n_tokens = layers[0].get_seq_length()
        return (
            self.method.score == "sum"
            and len(set(sizes)) == 1
            and set(self.received) == set(stats.all_queries) == set(range(len(layers)))
            and all(not isinstance(layer, DynamicSlidingWindowLayer) for layer in layers)
            and all(layer.get_seq_length() == n_tokens for layer in layers)
            and len({t.shape for t in self.received.values()}) == 1
            and len({t.shape for t in stats.all_queries.values()}) == 1
        )


@METHODS.register("h2o")
@dataclass
class H2O(DecodeEviction):
    recent_ratio: float = 0.5  # share of the budget kept as the recent window (the paper: 10 % heavy + 10 % recent)
    score: str = "sum"  # sum (the original) | mean (÷ queries each key received: kvpress's ObservedAttentionPress)

    compression = H2OCompression

    def __post_init__(self):
        super().__post_init__()  # evict_every
        if not 0 <= self.recent_ratio < 1:
            raise KvbenchError(f"recent_ratio={self.recent_ratio}: must be in [0, 1) (the rest are heavy hitters)")
        check_choice("score", self.score, ("sum", "mean"))

    def stats_request(self) -> StatsRequest:
        return StatsRequest(all_queries=True)

    def min_tokens(self) -> int:
        return 2  # one heavy hitter and one recent token

    def recent_tokens(self, n_keep: int) -> int:
        return min(n_keep - 1, max(1, round(self.recent_ratio * n_keep))) if self.recent_ratio else 0
