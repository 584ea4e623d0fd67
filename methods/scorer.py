"""Score-based eviction: a method defines one score per (KV head, position); each head keeps its top scores.

The interface the new scorers share (TOVA, Knorm, KeyDiff, Expected Attention) and that composite methods read
(AdaKV redistributes a layer's budget across heads by these scores; `decoding` re-selects with them while
generating): `head_scores(method, layer_idx, keys, values, stats)` → (B, H_kv, T), where +inf marks positions
the method always keeps (sinks, observation windows). SnapKV and PyramidKV are adapted here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench import KvbenchError
from kvbench.methods.base import Method
from kvbench.methods.scoring import top_k_sorted
from kvbench.model.attention import StatsRequest


@dataclass
class ScoreEviction(Method):
    """Keeps each KV head's `n_keep` highest `scores`, once after prefill (decode tokens are appended)."""

    def scores(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, stats) -> torch.Tensor:
        """(B, H_kv, T) fp32; keys/values (B, H_kv, T, D) as cached (post-RoPE keys)."""
        raise NotImplementedError  # abstract: every scorer implements it

    def keep_indices(self, layer_idx, keys, stats, n_keep):
        values = self._layer_values  # the base hook passes keys only; compress_layer sets the layer's values
        return top_k_sorted(self.scores(layer_idx, keys, values, stats), n_keep)  # (B, H_kv, n_keep)


def head_scores(method: Method, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, stats) -> torch.Tensor:
    """Any scoring method's per-head scores (B, H_kv, T); +inf where it always keeps the position."""
    from kvbench.methods.snapkv import SnapKV

    if isinstance(method, ScoreEviction):
        return method.scores(layer_idx, keys, values, stats)
    if isinstance(method, SnapKV):  # SnapKV, PyramidKV: pooled window votes, the window itself always kept
        prefix = method.prefix_scores(layer_idx, keys, stats)  # (B, H_kv, T − W)
        window = prefix.new_full((*prefix.shape[:2], keys.shape[2] - prefix.shape[2]), float("inf"))  # (B, H_kv, W)
        return torch.cat([prefix, window], dim=-1)  # (B, H_kv, T)
    raise KvbenchError(f"{method.name} has no per-head scores; use a scorer: {', '.join(SCORERS)}")


class WrapsScorer(Method):
    """A method built around another scoring method, `_scorer` (AdaKV, decoding): binding, the statistics it
    records and its token counts (minimum, per layer) are the scorer's."""

    _scorer: Method  # built by the subclass's __post_init__ from its `scorer` field

    def bind(self, lm) -> None:
        self._scorer.bind(lm)

    def stats_request(self) -> StatsRequest:
        return self._scorer.stats_request()

    def min_tokens(self) -> int:
        return self._scorer.min_tokens()

    def layer_tokens(self, n_keep, n_layers, n_prompt):
        return self._scorer.layer_tokens(n_keep, n_layers, n_prompt)


SCORERS = ("snapkv", "pyramidkv", "tova", "knorm", "keydiff", "expected_attention", "kvzip")
