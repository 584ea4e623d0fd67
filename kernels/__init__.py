"""Attention-statistics kernels: a pure-torch reference, and Triton fast paths used on CUDA when available."""

from kvbench.kernels.attention_stats import attention_column_sums

__all__ = ["attention_column_sums"]
