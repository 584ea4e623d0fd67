"""SnapKV (Li et al. 2024, https://arxiv.org/abs/2404.14469; FasterDecoding/SnapKV).

The last `window_size` prompt tokens (the observation window; it holds the question when query_aware) vote for
the earlier positions they attend to: attention of the window's queries (fp32 softmax, causal inside the
window) summed over the window, smoothed by 1-D pooling. Each KV head keeps its top `budget − window` earlier
positions plus the whole window, once, after prefill; decode tokens are appended uncompressed. The original
repeats K/V to query heads before selecting; here the group's query-head scores are aggregated per KV head
(`aggregate=mean|max`), or, with `aggregate=none`, every query head keeps its own positions in the original's
layout: the cache holds H_q heads (G× the memory of the KV-head layout), to reproduce published numbers.
The pooling kernel must be odd (padding k//2 centres it; an even kernel would shift the votes by half a token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import repeat_kv

from kvbench import KvbenchError
from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, Method, check_choice, top_k_sorted
from kvbench.methods.compression import Compression
from kvbench.methods.scorers import per_kv_head, pool
from kvbench.model.attention import StatsRequest
from kvbench.model.cache import kv_layer


@METHODS.register("snapkv")
@dataclass
class SnapKV(Method):
    window_size: int = knob(32, min=1, tokens=True)  # observation window: at least the last token
    kernel_size: int = knob(5, min=1)  # odd; 1 = no pooling
    pooling: str = "avg"  # avg | max
    aggregate: str = "mean"  # how a KV head combines its query heads' scores: mean | max | none (per query head)

    def __post_init__(self):
        check_choice("pooling", self.pooling, ("avg", "max"))
        check_choice("aggregate", self.aggregate, ("mean", "max", "none"))
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise KvbenchError(
                f"kernel_size={self.kernel_size}: use an odd pooling kernel (1, 3, 5, 7: the paper's "
                f"5 or 7), so that padding kernel_size // 2 keeps it centred"
            )
        self.query_groups = 1  # query heads per KV head of the bound model (`bind`)

    def stats_request(self) -> StatsRequest:
        return StatsRequest(windows=frozenset({self.window_size}))

    def min_tokens(self) -> int:
        return self.window_size + 1  # the window plus at least one selected position

    def prefix_scores(self, layer_idx: int, keys: torch.Tensor, stats) -> torch.Tensor:
        """Pooled window votes for the positions before the window: (B, H_kv, T − W)."""
        votes = stats.window[self.window_size][layer_idx]  # (B, H_q, T)
        if votes.shape[1] != keys.shape[1]:  # GQA, KV-head layout (aggregate=none: keys are per query head)
            votes = per_kv_head(votes, keys.shape[1], self.aggregate)
        votes = votes[..., : keys.shape[2] - self.window_size]
        return pool(votes, self.kernel_size, self.pooling)  # (B, H_kv, T − W)

    def scores(self, layer_idx, keys, values, stats):
        """The pooled window votes, +inf on the window itself (always kept): what adakv and decoding select by."""
        prefix = self.prefix_scores(layer_idx, keys, stats)  # (B, H_kv, T − W)
        window = prefix.new_full((*prefix.shape[:2], keys.shape[2] - prefix.shape[2]), float("inf"))  # (B, H_kv, W)
        return torch.cat([prefix, window], dim=-1)  # (B, H_kv, T)

    def keep_indices(self, layer_idx, keys, values, stats, n_keep):
        n_tokens = keys.shape[2]
        chosen = top_k_sorted(self.prefix_scores(layer_idx, keys, stats), n_keep - self.window_size)
        window = torch.arange(n_tokens - self.window_size, n_tokens, device=keys.device)
        window = window.expand(keys.shape[0], keys.shape[1], -1)  # (B, H_kv, W)
        return torch.cat([chosen, window], dim=-1)  # (B, H_kv, n_keep), ascending

    def bind(self, lm) -> None:
        self.query_groups = lm.n_q_heads // lm.n_kv_heads  # G: a later chunk finds its layers per query head

    def begin(self, n_prompt, n_layers, budget):
        if self.aggregate == "none":
            return QueryHeadCompression(self, n_prompt, n_layers, budget)
        return super().begin(n_prompt, n_layers, budget)


class QueryHeadCompression(Compression):
    """SnapKV aggregate=none: every query head selects on its own, the cache in the original's layout."""

    method: SnapKV

    def layer(self, layer_idx, keys, values, stats):
        # G = H_q / H_kv; a later chunk (prefill_chunk, streaming) finds the layer already per query head: the
        # bound model's G (1 for a model never bound: then the layer was never expanded)
        n_groups = stats.window[self.method.window_size][layer_idx].shape[1] // keys.shape[1]
        groups = n_groups if n_groups > 1 else self.method.query_groups
        expanded = super().layer(layer_idx, repeat_kv(keys, n_groups), repeat_kv(values, n_groups), stats)
        if expanded.keys.shape[2] == keys.shape[2]:  # nothing evicted: the plain layer
            return kv_layer(keys, values)
        return QueryHeadLayer.holding(expanded.keys, expanded.values, groups)  # (B, H_q, n_keep, D)


class QueryHeadLayer(DynamicLayer):
    """A cache layer in the original SnapKV's layout: one K/V head per query head (new tokens repeated G times)."""

    n_groups: int  # query heads per KV head (G), set by `holding`

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, n_groups: int) -> QueryHeadLayer:
        layer = cls()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values, layer.n_groups = keys, values, n_groups  # (B, H_q, T, D) each
        return layer

    def update(self, key_states, value_states, *args, **kwargs):
        """key/value states (B, H_kv, Q, D) from the model → appended as (B, H_q, Q, D)."""
        return super().update(repeat_kv(key_states, self.n_groups), repeat_kv(value_states, self.n_groups))
