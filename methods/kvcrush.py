"""KVCrush — representative tokens beside an importance policy (Jha et al. 2025, https://arxiv.org/abs/2503.00022;
OpenVINO GenAI's KVCrush, src/cpp/src/continuous_batching/kvcrush.cpp).

Of a layer's n_keep tokens per KV head, the share `representative_share` goes to representatives of the tokens the
importance policy (`scorer`, e.g. snapkv) would evict, the rest to the scorer's top positions. Each token gets a
binary signature of its attention pattern, one bit per KV head of the layer: 1 where the token is in that head's top
half by the scorer's scores (OpenVINO's indicators: the top ⌊T/2⌋ scores). An anchor signature (`anchor`: mean —
each bit the majority over the candidates, as OpenVINO's MEAN; zeros; ones; alternate; random with `seed`) orders
the candidates by Hamming distance to it (then by position), and the representatives are spaced uniformly along that
order (index i·⌊m/r⌋ of the m candidates, r representatives), so every group of similar head behaviour keeps a
proxy. OpenVINO selects blocks of tokens and its signature is over a block's tokens; the paper's per-token form with
per-head bits is followed here. The paper's exact bit threshold and defaults were not found in a readable source:
the top-half rule is OpenVINO's, the share 0.1 kvbench's choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench import KvbenchError
from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, Capabilities, check_choice
from kvbench.methods.scorers import WrapsScorer

ANCHORS = ("mean", "zeros", "ones", "alternate", "random")


def signatures(scores: torch.Tensor) -> torch.Tensor:
    """(B, H_kv, T) scores → (B, T, H_kv) bits: 1 where the token is among its head's top ⌊T/2⌋."""
    n_tokens = scores.shape[-1]
    top = scores.float().topk(n_tokens // 2, dim=-1).indices  # (B, H_kv, T/2)
    bits = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)  # (B, H_kv, T)
    return bits.transpose(1, 2)  # (B, T, H_kv)


def crush_keep(
    scores: torch.Tensor, n_keep: int, n_rep: int, anchor: str, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(B, H_kv, T) scores → (B, H_kv, n_keep) ascending positions: each head's top n_keep − n_rep by score, then
    n_rep representatives of the rest, uniformly spaced along the Hamming-distance order to the anchor."""
    bsz, n_heads, n_tokens = scores.shape
    n_imp = n_keep - n_rep
    important = scores.float().topk(n_imp, dim=-1).indices  # (B, H_kv, n_imp)
    if not n_rep:
        return important.sort(-1).values
    bits = signatures(scores)  # (B, T, H_kv)
    kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, important, True)  # (B, H_kv, T)
    candidates = ~kept.all(1)  # (B, T): evicted in some head
    if anchor == "mean":  # the majority bit per head over the candidates
        share = (bits & candidates[..., None]).sum(1) / candidates.sum(1, keepdim=True).clamp_min(1)  # (B, H_kv)
        point = share > 0.5
    elif anchor == "random":
        point = torch.randint(0, 2, (bsz, n_heads), generator=generator).bool().to(scores.device)
    else:
        point = torch.zeros(bsz, n_heads, dtype=torch.bool, device=scores.device)
        if anchor == "ones":
            point[:] = True
        elif anchor == "alternate":
            point[:, 1::2] = True
    distance = (bits != point[:, None, :]).sum(-1)  # (B, T) Hamming distance to the anchor
    order_key = distance * n_tokens + torch.arange(n_tokens, device=scores.device)  # (B, T): distance, then position
    order_key = order_key[:, None, :].expand(bsz, n_heads, n_tokens).masked_fill(kept, 2**62)  # (B, H_kv, T)
    order = order_key.argsort(-1)  # (B, H_kv, T): each head's candidates first, nearest the anchor first
    step = (n_tokens - n_imp) // n_rep  # ≥ 1: n_keep ≤ T
    reps = order[..., torch.arange(n_rep, device=scores.device) * step]  # (B, H_kv, n_rep)
    return torch.cat([important, reps], dim=-1).sort(-1).values  # (B, H_kv, n_keep)


@METHODS.register("kvcrush")
@dataclass
class KVCrush(WrapsScorer):
    scorer: str = "snapkv"  # the importance policy (any scorer: scorer_names())
    representative_share: float = knob(0.1, max=1.0)  # share of each head's budget given to representatives
    anchor: str = knob("mean", choices=ANCHORS)  # the anchor signature Hamming distances are measured to
    seed: int = 0  # anchor=random
    scorer_params: dict = field(default_factory=dict)  # the scorer's knobs over its defaults

    caps = Capabilities(stream_limit="use its scorer")

    def __post_init__(self):
        self.wrap(self.scorer, self.scorer_params)
        check_choice("anchor", self.anchor, ANCHORS)
        if not 0 <= self.representative_share < 1:
            raise KvbenchError(
                f"representative_share={self.representative_share}: must be in [0, 1) (the rest is the scorer's)"
            )

    def keep_indices(self, layer_idx, keys, values, stats, n_keep):
        scores = self._scorer.scores(layer_idx, keys, values, stats)  # (B, H_kv, T)
        always = int(torch.isinf(scores).sum(-1).max())  # the scorer's always-kept positions (windows, sinks)
        n_rep = min(int(n_keep * self.representative_share), max(0, n_keep - always))
        generator = torch.Generator().manual_seed(self.seed + layer_idx)
        return crush_keep(scores, n_keep, n_rep, self.anchor, generator)  # (B, H_kv, n_keep)
