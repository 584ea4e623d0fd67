"""Ada-KV — head-wise adaptive budgets (Feng et al. 2024, https://arxiv.org/abs/2407.11550; kvpress's AdaKVPress).

A layer's budget (H_kv × n_keep tokens) is shared by its KV heads: the positions with the highest scores of the
`scorer` method over all heads of the layer together are kept, so heads whose scores concentrate keep few tokens and
heads that attend broadly keep many. A safeguard keeps at least ⌊alpha_safeguard · n_keep⌋ top positions in every
head (kvpress's default 0.2). Layer budgets come from the scorer (PyramidKV's pyramid, uniform otherwise), so
`scorer=snapkv` is the paper's Ada-SnapKV and `scorer=pyramidkv` its Ada-Pyramid.

kvpress only masks the evicted entries (the cache keeps its full size); here each layer is stored ragged and
physically (kvbench.model.ragged: flat (Σ T_h, D) keys and values), so the measured kv_bytes equal the budget exactly.
Decode tokens are appended to every head; there is no decode-time eviction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench import KvbenchError
from kvbench.methods.base import METHODS, Capabilities
from kvbench.methods.compression import Compression
from kvbench.methods.scorers import WrapsScorer
from kvbench.model.ragged import RaggedLayer


def adaptive_keep(scores: torch.Tensor, n_keep: int, alpha_safeguard: float) -> torch.Tensor:
    """(B, H_kv, T) scores → (B, H_kv, T) bool: the layer's top H_kv·n_keep positions over all heads together,
    after each head's top ⌊alpha·n_keep⌋ are guaranteed (kvpress: scatter finfo.max, then one top-k)."""
    bsz, n_heads, n_tokens = scores.shape
    scores = scores.float().clone()
    n_safe = int(n_keep * alpha_safeguard)
    if n_safe:
        safe = scores.topk(n_safe, dim=-1).indices  # (B, H_kv, n_safe)
        scores.scatter_(-1, safe, torch.finfo(scores.dtype).max)  # inf (always-kept windows) stays above
    chosen = scores.reshape(bsz, n_heads * n_tokens).topk(n_heads * n_keep, dim=-1).indices  # (B, H_kv·n_keep)
    keep = torch.zeros(bsz, n_heads * n_tokens, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, chosen, True)
    return keep.view(bsz, n_heads, n_tokens)  # (B, H_kv, T)


@METHODS.register("adakv")
@dataclass
class AdaKV(WrapsScorer):
    scorer: str = "snapkv"  # the per-head scores redistributed: snapkv | pyramidkv | tova | knorm | keydiff | ...
    alpha_safeguard: float = 0.2  # share of each head's uniform budget it keeps whatever the other heads score
    scorer_params: dict = field(default_factory=dict)  # the scorer's knobs over its defaults, e.g. {window_size: 64}

    caps = Capabilities(
        chunk_limit="its ragged layers give no attention statistics to a later chunk",
        stream_limit="use its scorer",
    )

    def __post_init__(self):
        self.wrap(self.scorer, self.scorer_params)
        if not 0 <= self.alpha_safeguard <= 1:
            raise KvbenchError(f"alpha_safeguard={self.alpha_safeguard}: must be in [0, 1]")

    def begin(self, n_prompt, n_layers, budget) -> RaggedCompression:
        return RaggedCompression(self, n_prompt, n_layers, budget)


class RaggedCompression(Compression):
    """One example's Ada-KV: each layer over its count becomes ragged (its heads' own kept positions)."""

    method: AdaKV
    ragged: torch.Tensor | None = None  # (B, H_kv, T) bool: the layer being compressed, once selected

    def select(self, layer_idx, keys, values, stats, n_keep):
        """Records the layer's ragged choice; the dense gather the base class does with the returned (empty)
        index costs nothing and is replaced by the ragged layer in `layer`."""
        scores = self.method._scorer.scores(layer_idx, keys, values, stats)  # (B, H_kv, T)
        self.ragged = adaptive_keep(scores, n_keep, self.method.alpha_safeguard)  # (B, H_kv, T) bool
        return torch.empty(*keys.shape[:2], 0, dtype=torch.long, device=keys.device)  # (B, H_kv, 0)

    def layer(self, layer_idx, keys, values, stats):
        """The base class resolves the budget (fractions, minimums, nothing to evict) and calls `select`;
        a layer it left whole stays dense, the others become ragged."""
        self.ragged = None
        dense = super().layer(layer_idx, keys, values, stats)
        return dense if self.ragged is None else RaggedLayer.gather(keys, values, self.ragged)
