"""Decode-time eviction inside a tensor's own storage: kernels/csrc/compact_tokens.c, or torch (gather + copy).

`compact_tokens(t, index)` leaves in slots [0, N) of t (1, H, T, D) exactly what `t.gather(2, index)` would give
(positions sorted ascending), without a new tensor; the caller then views t[:, :, :N]. Used for the rows of a grid
(kvbench/grid_decode.py), whose caches are slots of one batch tensor.
"""

from __future__ import annotations

import torch


def _kernel():
    from kvbench.kernels import cpu_ext

    return cpu_ext.function("compact_tokens", "plllllpl")


def compact_tokens(tensor: torch.Tensor, index: torch.Tensor) -> None:
    """Keep positions `index` (1, H, N) of `tensor` (1, H, T, D), in its slots [0, N)."""
    batch, heads, n_old, dim = tensor.shape
    n_keep = index.shape[-1]
    if index.shape != (batch, heads, n_keep) or batch != 1:
        raise ValueError(f"index {tuple(index.shape)} does not select tokens of one row of {tuple(tensor.shape)}")
    kernel = _kernel() if tensor.device.type == "cpu" and tensor.stride(-1) == 1 and tensor.stride(2) == dim else None
    if kernel is not None:
        positions = index.to(torch.int64).contiguous()  # (1, H, N)
        status = kernel(
            tensor.data_ptr(), tensor.element_size(), heads, tensor.stride(1), dim, n_old, positions.data_ptr(), n_keep
        )
        if status == 0:
            return  # else positions not strictly increasing or outside the cache: torch's gather says which
    kept = tensor.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, dim))  # (1, H, N, D): a copy, then back in place
    tensor[:, :, :n_keep].copy_(kept)


def compact_kv(keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's eviction in place: keys and values (1, H, T, D) compacted to `index` (1, H, N); returns their
    views (1, H, N, D) of the kept tokens."""
    compact_tokens(keys, index)
    compact_tokens(values, index)
    n_keep = index.shape[-1]
    return keys[:, :, :n_keep], values[:, :, :n_keep]
