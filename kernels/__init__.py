"""Attention-statistics kernels: a pure-torch reference, and Triton fast paths used on CUDA when available."""

from __future__ import annotations

import importlib.util
import os

import torch

from kvbench.kernels.attention_stats import attention_column_sums as attention_column_sums_reference

# find_spec, not import: triton_stats loads on the first CUDA call, so CPU runs never import or decorate its kernels.
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def attention_column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Σ over queries of causal softmax(q·kᵀ·scaling): query (B, H_q, Q, D), key (B, H_kv, T, D) -> (B, H_q, T).

    Triton on CUDA unless KVBENCH_NO_TRITON=1; the torch reference otherwise. Contract: attention_stats.
    """
    if query.is_cuda and TRITON_AVAILABLE and os.environ.get("KVBENCH_NO_TRITON") != "1":
        from kvbench.kernels import triton_stats

        if triton_stats.TRITON_AVAILABLE:  # False when triton is present but fails to import
            return triton_stats.triton_attention_column_sums(query, key, scaling)
    return attention_column_sums_reference(query, key, scaling)


__all__ = ["attention_column_sums", "attention_column_sums_reference"]
