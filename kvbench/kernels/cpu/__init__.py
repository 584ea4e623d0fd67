"""The CPU backend: C kernels, built on first use with the machine's C compiler (build.py) and called through
ctypes. Optional: kvbench reaches it only through kvbench.kernels.backend (`backend("cpu")`, the CpuKernels
interface there); without this folder, or with KVBENCH_NO_CPU_EXT=1, every path runs torch.

The operations (each answers None / False where its kernel does not apply or did not build):
- install, rows_independent: the decode step's linear layers (decode_linear.py), row-independent;
- decode_attention: one query per row (single_query.py);
- causal_column_sums, bf16_column_sums: H2O's / SnapKV's attention statistics (column_sums.py);
- compact_tokens: decode-time eviction's in-place token copies by runs (tokens.py);
- kivi_decode_attention: KIVI's decode attention on its packed groups (kivi.py).

Each kernel is here because it earns its place end to end (`python -m kvbench.bench cpu_kernels bench.clock=cpu`: one
example = prefill + compression + 24 decode tokens on the bundled model, CPU time at 1 thread, best of 2; Intel(R)
Xeon(R) Processor, avx512_bf16 and AMX). Example time with every kernel on but this one / with all on (> 1: the kernel
saves that share):

| kernel (workload) | fp32 1K | fp32 4K | bf16 1K | bf16 4K | what moves |
|---|---|---|---|---|---|
| decode_linear (full) | 1.02 | 0.98 | 1.31 | 1.05 | bf16 decode 73 → 113 ms/token at 1K |
| decode_linear (grid, 8 rows) | 1.18 | | | | bf16 grids decode one by one without it |
| decode_attention (grid) | 1.07 | | | | one call per layer instead of one per row |
| softmax_column_sums (h2o) | 1.09 | 1.21 | 1.08 | 1.14 | H2O's prefill 17.8 → 22.0 s fp32 4K |
| compact_tokens (h2o, per step) | 1.08 | 1.07 | 1.06 | 1.09 | bf16 4K decode 82 → 146 ms/token |
| compact_tokens (grid) | 1.17 | | | | |
| kivi_decode_attention (kivi-4) | 1.11 | 1.07 | 1.19 | 1.10 | bf16 4K decode 70 → 124 ms/token |

Measured in the same run and left to torch: a bf16 causal prefill attention (0.89 at 1K, 0.52 at 4K: sdpa is twice
as fast), a gather by runs for compression (1.00–1.05: noise), KIVI's per-step quantization (1.00–1.04), decode
attention for a single row (0.99–1.01: sdpa is as fast).
"""

from __future__ import annotations

from torch import nn

from kvbench.kernels.cpu import build
from kvbench.kernels.cpu.build import enabled
from kvbench.kernels.cpu.column_sums import bf16_column_sums, causal_column_sums
from kvbench.kernels.cpu.decode_linear import rows_independent
from kvbench.kernels.cpu.kivi import kivi_decode_attention
from kvbench.kernels.cpu.single_query import decode_attention
from kvbench.kernels.cpu.tokens import compact_tokens


def install(model: nn.Module) -> int:
    """Build every kernel now (so a first build's second never lands in a timed step), then swap the model's plain
    nn.Linear layers to the decode-step kernel's DecodeLinear; returns how many layers are DecodeLinear."""
    from kvbench.kernels.cpu import decode_linear

    build.load_all()
    return decode_linear.install(model)


__all__ = [
    "bf16_column_sums",
    "causal_column_sums",
    "compact_tokens",
    "decode_attention",
    "enabled",
    "install",
    "kivi_decode_attention",
    "rows_independent",
]
