"""The Triton kernels for CUDA (stats: attention column sums; quant: KIVI's packing; kivi: decode attention on the
packed groups; ragged: AdaKV's ragged decode), reached through kvbench.kernels.fast_module. This package is their one
import guard: CPU-only installs have no triton, and kvbench.kernels falls back to the torch references."""

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:
    triton = tl = None
    TRITON_AVAILABLE = False

__all__ = ["TRITON_AVAILABLE", "tl", "triton"]
