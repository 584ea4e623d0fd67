"""Triton, when installed: the one import guard the kernel modules share (CPU-only installs have no triton and
kvbench.kernels falls back to the torch references)."""

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:
    triton = tl = None
    TRITON_AVAILABLE = False

__all__ = ["TRITON_AVAILABLE", "tl", "triton"]
