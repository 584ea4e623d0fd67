"""Keeping some tokens of a cache tensor by runs of consecutive positions: kernels/csrc/compact_tokens.c, or torch.

`compact_tokens(t, index)` leaves in slots [0, N) of t (1, H, T, D) exactly what `t.gather(2, index)` would give
(positions sorted ascending), without a new tensor; the caller then views t[:, :, :N]. Used for the rows of a grid
(kvbench/engine/grid_decode.py), whose caches are slots of one batch tensor.
`gather_tokens(t, index)` is `t.gather(2, index)` (B, H, N, D) as a new tensor, copied by runs instead of through a
per-element index: compression (kvbench/model/cache.py `gather_kv`).
"""

from __future__ import annotations

import torch


def _function(symbol: str, signature: str):
    from kvbench.kernels import cpu_ext

    return cpu_ext.function("compact_tokens", signature, symbol)


def _by_runs(tensor: torch.Tensor) -> bool:
    """Whether the C kernels can copy this tensor's tokens (CPU, each token's D values contiguous, tokens D apart)."""
    return tensor.device.type == "cpu" and tensor.stride(-1) == 1 and tensor.stride(2) == tensor.shape[-1]


def compact_tokens(tensor: torch.Tensor, index: torch.Tensor) -> None:
    """Keep positions `index` (1, H, N) of `tensor` (1, H, T, D), in its slots [0, N)."""
    batch, heads, n_old, dim = tensor.shape
    n_keep = index.shape[-1]
    if index.shape != (batch, heads, n_keep) or batch != 1:
        raise ValueError(f"index {tuple(index.shape)} does not select tokens of one row of {tuple(tensor.shape)}")
    kernel = _function("compact_tokens", "plllllpl") if _by_runs(tensor) else None
    if kernel is not None:
        positions = index.to(torch.int64).contiguous()  # (1, H, N)
        status = kernel(
            tensor.data_ptr(), tensor.element_size(), heads, tensor.stride(1), dim, n_old, positions.data_ptr(), n_keep
        )
        if status == 0:
            return  # else positions not strictly increasing or outside the cache: torch's gather says which
    kept = tensor.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, dim))  # (1, H, N, D): a copy, then back in place
    tensor[:, :, :n_keep].copy_(kept)


def gather_tokens(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor (B, H, T, D), index (B, H, N) → the kept tokens (B, H, N, D), a new contiguous tensor."""
    batch, heads, n_old, dim = tensor.shape
    kernel = _function("gather_tokens", "pplllllllpl") if _by_runs(tensor) and index.dim() == 3 else None
    if kernel is not None and index.shape[:2] == (batch, heads):
        positions = index.to(torch.int64).contiguous()  # (B, H, N)
        out = tensor.new_empty(batch, heads, index.shape[-1], dim)  # (B, H, N, D)
        status = kernel(
            tensor.data_ptr(), out.data_ptr(), tensor.element_size(), batch, heads, tensor.stride(0),
            tensor.stride(1), dim, n_old, positions.data_ptr(), index.shape[-1],
        )  # fmt: skip
        if status == 0:
            return out
    return tensor.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, dim))  # (B, H, N, D); bad positions: torch says


def compact_kv(keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's eviction in place: keys and values (1, H, T, D) compacted to `index` (1, H, N); returns their
    views (1, H, N, D) of the kept tokens."""
    compact_tokens(keys, index)
    compact_tokens(values, index)
    n_keep = index.shape[-1]
    return keys[:, :, :n_keep], values[:, :, :n_keep]
