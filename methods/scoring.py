"""Score helpers shared by attention-based eviction methods (SnapKV, PyramidKV, H2O)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbench import KvbenchError


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


def top_k_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores along the last axis, in ascending position order."""
    n = scores.shape[-1]
    if k == n - 1 > 0:  # one token dropped (per-step eviction): every position but the lowest, when it is unique
        lowest = scores.argmin(dim=-1, keepdim=True)  # (..., 1)
        if bool(((scores == scores.gather(-1, lowest)).sum(-1) == 1).all()):  # else (ties, NaN) topk decides
            positions = torch.arange(n - 1, device=scores.device)  # (n - 1,)
            return positions + (positions >= lowest).long()  # (..., n - 1): the lowest skipped
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise KvbenchError(f"{name}={value!r}: use one of {', '.join(map(str, choices))}")
