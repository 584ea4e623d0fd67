"""SnapKV (Li et al. 2024, https://arxiv.org/abs/2404.14469; FasterDecoding/SnapKV).

The last `window_size` prompt tokens (the observation window; it holds the question when query_aware) vote for
the earlier positions they attend to: attention of the window's queries (fp32 softmax, causal inside the
window) summed over the window, smoothed by 1-D pooling. Each KV head keeps its top `budget − window` earlier
positions plus the whole window, once, after prefill; decode tokens are appended uncompressed. The original
repeats K/V to query heads before selecting; here the group's query-head scores are aggregated per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.attention import StatsRequest
from kvbench.methods.base import METHODS, Method
from kvbench.methods.scoring import check_choice, per_kv_head, pool, top_k_sorted


@METHODS.register("snapkv")
@dataclass
class SnapKV(Method):
    window_size: int = 32
    kernel_size: int = 5
    pooling: str = "avg"  # avg | max
    aggregate: str = "mean"  # how a KV head combines its query heads' scores: mean | max

    def __post_init__(self):
        check_choice("pooling", self.pooling, ("avg", "max"))
        check_choice("aggregate", self.aggregate, ("mean", "max"))

    def stats_request(self) -> StatsRequest:
        return StatsRequest(windows=frozenset({self.window_size}))

    def min_tokens(self) -> int:
        return self.window_size + 1  # the window plus at least one selected position

    def prefix_scores(self, layer_idx: int, keys: torch.Tensor, stats) -> torch.Tensor:
        """Pooled window votes for the positions before the window: (B, H_kv, T − W)."""
        votes = stats.window[self.window_size][layer_idx]  # (B, H_q, T)
        votes = per_kv_head(votes, keys.shape[1], self.aggregate)[..., : keys.shape[2] - self.window_size]
        return pool(votes, self.kernel_size, self.pooling)  # (B, H_kv, T − W)

    def keep_indices(self, layer_idx, keys, stats, n_keep):
        n_tokens = keys.shape[2]
        chosen = top_k_sorted(self.prefix_scores(layer_idx, keys, stats), n_keep - self.window_size)
        window = torch.arange(n_tokens - self.window_size, n_tokens, device=keys.device)
        window = window.expand(keys.shape[0], keys.shape[1], -1)  # (B, H_kv, W)
        return torch.cat([chosen, window], dim=-1)  # (B, H_kv, n_keep), ascending
