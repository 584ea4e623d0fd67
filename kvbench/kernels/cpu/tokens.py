"""Keeping a cache tensor's tokens in place by runs of consecutive positions (csrc/compact_tokens.c): the C side of
kvbench.kernels.compact's `compact_tokens`, which says what the copy means and runs torch's gather where it declines."""

from __future__ import annotations

import torch


def _function(symbol: str, signature: str):
    from kvbench.kernels.cpu import build

    return build.function("compact_tokens", signature, symbol)


def _by_runs(tensor: torch.Tensor) -> bool:
    """Whether the C kernels can copy this tensor's tokens (CPU, each token's D values contiguous, tokens D apart)."""
    return tensor.device.type == "cpu" and tensor.stride(-1) == 1 and tensor.stride(2) == tensor.shape[-1]


def compact_tokens(tensor: torch.Tensor, index: torch.Tensor) -> bool:
    """Keep positions `index` (1, H, N) of `tensor` (1, H, T, D) in its slots [0, N); False (nothing moved) where the
    kernel declines: not copyable by runs, positions not strictly increasing or outside the cache, no kernel."""
    kernel = _function("compact_tokens", "plllllpl") if _by_runs(tensor) else None
    if kernel is None:
        return False
    heads, n_old, dim = tensor.shape[1:]
    positions = index.to(torch.int64).contiguous()  # (1, H, N)
    status = kernel(
        tensor.data_ptr(), tensor.element_size(), heads, tensor.stride(1), dim, n_old, positions.data_ptr(),
        index.shape[-1],
    )  # fmt: skip
    return status == 0
