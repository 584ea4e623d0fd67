"""ChunkKV — contiguous chunks instead of single tokens (Liu et al. 2025, https://arxiv.org/abs/2502.00299;
kvpress's ChunkKVPress), over any scorer.

The `scorer` method's per-head scores (B, H_kv, T) are summed over the layer's KV heads and averaged over each chunk
of `chunk_size` consecutive positions (the last chunk may be shorter), as kvpress's ChunkKVPress does; the chunks
are kept in the order of their scores, so every KV head of a layer keeps the same whole chunks. kvpress keeps
int(n_chunks · (1 − ratio)) whole chunks (its cache then holds a multiple of the chunk size, not the budget);
kvbench keeps exactly the layer's budget, n_keep tokens: the ⌊·⌋ best chunks whole, and of the next one its
highest-scored positions to fill the count — the same chunks as kvpress whenever n_keep is the chunk count × the
chunk size. Positions the scorer always keeps (+inf: SnapKV's observation window) rank their chunks first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, Capabilities
from kvbench.methods.scorers import WrapsScorer


def chunk_keep(scores: torch.Tensor, chunk_size: int, n_keep: int) -> torch.Tensor:
    """(B, H_kv, T) scores → (B, H_kv, n_keep) positions, ascending, the same for every head: whole chunks in
    the order of their head-summed mean score, the last one taken partly (its best positions)."""
    bsz, n_heads, n_tokens = scores.shape
    summed = scores.float().sum(1)  # (B, T): kvpress sums the heads, then averages each chunk
    starts = torch.arange(0, n_tokens, chunk_size, device=scores.device)  # (C,)
    chunk_of = torch.arange(n_tokens, device=scores.device) // chunk_size  # (T,)
    sizes = torch.bincount(chunk_of, minlength=len(starts)).float()  # (C,) the last may be shorter
    means = torch.zeros(bsz, len(starts), device=scores.device).index_add_(1, chunk_of, summed) / sizes  # (B, C)
    means = torch.where(torch.isnan(means), torch.full_like(means, float("inf")), means)  # inf − inf: always kept
    rows = []
    for b in range(bsz):
        order = means[b].argsort(descending=True, stable=True)  # (C,) best chunk first; ties: the earlier
        taken = sizes[order].cumsum(0)  # (C,) tokens held after each chunk in rank order
        whole = order[taken <= n_keep]  # (W,) chunks kept whole
        mask = torch.zeros(n_tokens, dtype=torch.bool, device=scores.device)
        mask[torch.isin(chunk_of, whole)] = True
        short = n_keep - int(mask.sum())
        if short:  # the next chunk in rank order fills the budget with its best positions
            part = order[len(whole)]
            inside = (chunk_of == part).nonzero().squeeze(-1)  # (c,)
            mask[inside[summed[b, inside].topk(short).indices]] = True
        rows.append(mask.nonzero().squeeze(-1))  # (n_keep,) ascending
    return torch.stack(rows).unsqueeze(1).expand(bsz, n_heads, n_keep)  # (B, H_kv, n_keep)


@METHODS.register("chunkkv")
@dataclass
class ChunkKV(WrapsScorer):
    scorer: str = "snapkv"  # the per-head scores chunks are ranked by (any scorer: scorer_names())
    chunk_size: int = knob(10, min=1, tokens=True)  # tokens per chunk (the paper's 10; kvpress's default 20)
    scorer_params: dict = field(default_factory=dict)  # the scorer's knobs over its defaults, e.g. {window_size: 64}

    caps = Capabilities(chunk_limit="its chunks are positions of the whole prompt", stream_limit="use its scorer")

    def __post_init__(self):
        self.wrap(self.scorer, self.scorer_params)

    def keep_indices(self, layer_idx, keys, values, stats, n_keep):
        scores = self._scorer.scores(layer_idx, keys, values, stats)  # (B, H_kv, T)
        return chunk_keep(scores, self.chunk_size, n_keep)  # (B, H_kv, n_keep)
