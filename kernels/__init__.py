"""Attention-statistics kernels: a pure-torch reference, and Triton fast paths used on CUDA when available.

Imports happen inside the functions on purpose: run from the repository root, this folder is also importable
as a top-level `kernels` module, which transformers probes (the Hugging Face `kernels` package has the same
name) while it is itself being imported. Importing nothing here keeps that probe harmless.
"""

from __future__ import annotations

import importlib.util
import os

__version__ = "N/A"  # not the Hugging Face `kernels` package: transformers' version check then ignores it


def attention_column_sums_reference(query, key, scaling: float):
    from kvbench.kernels.attention_stats import attention_column_sums

    return attention_column_sums(query, key, scaling)


def attention_column_sums(query, key, scaling: float):
    """Σ over queries of causal softmax(q·kᵀ·scaling): query (B, H_q, Q, D), key (B, H_kv, T, D) -> (B, H_q, T).

    Triton on CUDA unless KVBENCH_NO_TRITON=1; the torch reference otherwise. Contract: attention_stats.
    """
    if query.is_cuda and importlib.util.find_spec("triton") and os.environ.get("KVBENCH_NO_TRITON") != "1":
        from kvbench.kernels import triton_stats

        if triton_stats.TRITON_AVAILABLE:  # False when triton is present but fails to import
            return triton_stats.triton_attention_column_sums(query, key, scaling)
    return attention_column_sums_reference(query, key, scaling)


__all__ = ["attention_column_sums", "attention_column_sums_reference"]
