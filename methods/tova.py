"""TOVA — Token Omission Via Attention (Oren et al. 2024, https://arxiv.org/abs/2401.06104;
schwartz-lab-NLP/TOVA src/tova_cache.py, kvpress's TOVAPress).

A token's score is the attention the *current* (last) query pays to it, averaged over all query heads of the
layer, so every KV head of a layer keeps the same positions. After prefill the cache keeps the top `n_keep`
positions by the last prompt token's attention; then, as in the original's `reduce`, every decode step appends the
new token and evicts down to the same size by the new query's head-averaged attention — the new token included
(the original does not protect it; kvpress pins it, a difference its docstring calls negligible). The size
tracking is methods/decode_eviction.py's (shared with H2O and StreamingLLM), so `evict_every` = k evicts k tokens
every k steps by that step's query; a cache left whole by compression (budget ≥ the prompt) grows, as the
original's does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvbench.methods.base import METHODS, top_k_sorted
from kvbench.methods.decode_eviction import DecodeEviction, Evicting
from kvbench.model.attention import StatsRequest


class TovaCompression(Evicting):
    """One example's TOVA: its held sizes (Evicting's); each eviction re-selects by the new query."""

    def decode_keep(self, layer_idx, layer, size, stats):
        """The new query's head-averaged attention: the least attended tokens go (the new one included)."""
        scores = self.method.scores(layer_idx, layer.keys, layer.values, stats)  # (B, H_kv, T)
        return top_k_sorted(scores, size)  # (B, H_kv, size)


@METHODS.register("tova")
@dataclass
class TOVA(DecodeEviction):
    evict_during_decode: bool = True  # the original: a constant-size cache while generating

    compression = TovaCompression
    holds_whole_prompt = False  # the original evicts only once the cache was compressed (budget < the prompt)
    stream_evicts = False  # streaming: every chunk re-selects by its last query from all a layer holds

    def __post_init__(self):
        super().__post_init__()  # evict_every
        self.caps = replace(self.caps, evicts_while_decoding=self.evict_during_decode)

    def stats_request(self) -> StatsRequest:
        return StatsRequest(windows=frozenset({1}))  # the last query's attention row

    def scores(self, layer_idx, keys, values, stats):
        row = stats.window[1][layer_idx]  # (B, H_q, T): softmax of the last query over every key
        return row.mean(dim=1, keepdim=True).expand(-1, keys.shape[1], -1)  # (B, H_kv, T), same for every head
