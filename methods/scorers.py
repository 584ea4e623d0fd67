"""Per-head scores: the (B, H_kv, T) tensors scoring methods return, the operations they share, and the wrappers
that select by any scorer's.

A method is a scorer by defining `Method.scores` (TOVA, Knorm, KeyDiff, Expected Attention, KVzip, SnapKV and
PyramidKV do); `kvbench.methods.base.scorer_names()` lists them from the registry. Here: turning query-head
attention into KV-head scores (`per_kv_head`), SnapKV's pooling (`pool`), and `WrapsScorer`, the base of the
methods built around another scoring method (adakv redistributes a layer's budget across heads by its scores;
decoding re-selects with them while generating), as kvpress's AdaKVPress and DecodingPress wrap a ScorerPress.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from kvbench import KvbenchError
from kvbench.methods.base import Method, build_method, check_choice, method_defaults, scorer_names
from kvbench.model.attention import StatsRequest


def per_kv_head(scores: torch.Tensor, n_kv_heads: int, aggregate: str) -> torch.Tensor:
    """(B, H_q, T) query-head scores → (B, H_kv, T): mean/max/sum over each KV head's query group."""
    bsz, n_q_heads, n_tokens = scores.shape
    grouped = scores.view(bsz, n_kv_heads, n_q_heads // n_kv_heads, n_tokens)  # (B, H_kv, G, T)
    if aggregate == "mean":
        return grouped.mean(2)
    if aggregate == "max":
        return grouped.amax(2)
    if aggregate == "sum":
        return grouped.sum(2)
    raise KvbenchError(f"aggregate={aggregate!r}: use mean, max or sum")


def pool(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """SnapKV's 1-D smoothing along positions (stride 1, padding k//2), so neighbours of a hit are kept too."""
    if kernel_size <= 1:
        return scores
    bsz, heads, n_tokens = scores.shape
    flat = scores.reshape(bsz * heads, 1, n_tokens)  # (B·H, 1, T)
    if pooling == "avg":
        out = F.avg_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
    elif pooling == "max":
        out = F.max_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
    else:
        raise KvbenchError(f"pooling={pooling!r}: use avg or max")
    return out[..., :n_tokens].reshape(bsz, heads, n_tokens)  # (B, H, T)


class WrapsScorer(Method):
    """A method built around another scoring method, `_scorer` (AdaKV, decoding): binding, the statistics it
    records and its token counts (minimum, per layer) are the scorer's."""

    _scorer: Method  # built by `wrap` from the subclass's `scorer` knob

    def wrap(self, scorer: str, params: dict | None = None) -> None:
        """Build the wrapped scorer from its conf/method/<scorer>.yaml defaults and `params` over them (the
        subclass's `scorer_params`, e.g. {window_size: 64}); one line naming the scorers or its knobs else."""
        check_choice("scorer", scorer, scorer_names())
        if params is not None and not isinstance(params, Mapping):
            raise KvbenchError(f"{self.name}.scorer_params={params!r} is not a mapping; use e.g. {{window_size: 64}}")
        # the scorer's knobs by the scorer's own rules, as if given as method.<knob> (window_size ≥ 1, beta > 0, ...)
        self._scorer = build_method(
            scorer, {**method_defaults(scorer), **dict(params or {})}, where=f"{self.name}.scorer_params"
        )

    def bind(self, lm) -> None:
        self._scorer.bind(lm)

    def stats_request(self) -> StatsRequest:
        return self._scorer.stats_request()

    def min_tokens(self) -> int:
        return self._scorer.min_tokens()

    def layer_tokens(self, n_keep, n_layers, n_prompt):
        return self._scorer.layer_tokens(n_keep, n_layers, n_prompt)
