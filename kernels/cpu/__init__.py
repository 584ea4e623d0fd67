"""The CPU backend: C kernels, built on first use with the machine's C compiler (build.py) and called through
ctypes. Optional: kvbench reaches it only through kvbench.kernels.backend (`backend("cpu")`, the CpuKernels
interface there); without this folder, or with KVBENCH_NO_CPU_EXT=1, every path runs torch.

The operations (each answers None / False where its kernel does not apply or did not build):
- install, rows_independent: the decode step's linear layers (decode_linear.py), row-independent;
- decode_attention: one query per row (single_query.py);
- prefill_attention, prefill_attention_supported: a bf16 prompt's causal attention with AVX512-BF16 (causal_prompt.py);
- causal_column_sums: H2O's / SnapKV's attention statistics (column_sums.py);
- compact_tokens, gather_tokens: eviction's token copies by runs (tokens.py);
- kivi_quantize, kivi_decode_attention: KIVI's per-step quantization and packed-group attention (kivi.py).

What each kernel earns, end to end (`python scripts/bench_cpu_kernels.py --clock cpu`: one example = prefill +
compression + 24 decode tokens on the bundled model, CPU time at 1 thread, best of 2; Intel(R) Xeon(R) Processor,
avx512_bf16 and AMX, 2 cores shared with other work, load average 5-10). Example time with every kernel on but
this one / with all on (> 1: the kernel saves that share):

| kernel (workload) | fp32 1K | fp32 4K | bf16 1K | bf16 4K | what moves |
|---|---|---|---|---|---|
| decode_linear (full) | 1.02 | 0.98 | 1.31 | 1.05 | bf16 decode 73 → 113 ms/token at 1K |
| decode_linear (grid, 8 rows) | 1.18 | | | | bf16 grids decode one by one without it |
| decode_attention (full) | 1.01 | 0.99 | 0.99 | 0.99 | nothing: torch's sdpa is as fast here |
| decode_attention (grid) | 1.07 | | | | one call per layer instead of one per row |
| prefill_attention (full) | | | 0.89 | 0.52 | a loss: bf16 4K prefill 10.3 s vs sdpa's 4.2 s |
| softmax_column_sums (h2o) | 1.09 | 1.21 | 1.08 | 1.14 | H2O's prefill 17.8 → 22.0 s fp32 4K |
| softmax_column_sums (snapkv) | 1.00 | 1.05 | 1.00 | 0.97 | a 32-query window: noise |
| compact_tokens (h2o, per step) | 1.08 | 1.07 | 1.06 | 1.09 | bf16 4K decode 82 → 146 ms/token |
| compact_tokens (grid) | 1.17 | | | | |
| gather_tokens (snapkv) | 1.04 | 1.00 | 1.05 | 0.99 | noise (one gather per compression) |
| kivi_quantize (kivi-4) | 1.00 | 1.01 | 1.04 | 1.02 | ≤ 4 % |
| kivi_decode_attention (kivi-4) | 1.11 | 1.07 | 1.19 | 1.10 | bf16 4K decode 70 → 124 ms/token |
| all off (full) | 0.98 | 0.94 | 1.16 | 0.56 | |

Grid rows: fp32 1K only (a second run stopped there). Not yet acted on: prefill_attention (and with it the bf16 dot
products of the column sums and the `bf16_kernels` hash key), kivi_quantize, gather_tokens and decode_attention
measure as losses or within noise here; decode_linear, softmax_column_sums, compact_tokens and kivi_decode_attention
earn their place. To confirm at 2 threads on a quiet machine (wall clock) before deleting.
"""

from __future__ import annotations

from torch import nn

from kvbench.kernels.cpu import build
from kvbench.kernels.cpu.build import enabled
from kvbench.kernels.cpu.causal_prompt import prefill_attention
from kvbench.kernels.cpu.causal_prompt import supported as prefill_attention_supported
from kvbench.kernels.cpu.column_sums import causal_column_sums
from kvbench.kernels.cpu.decode_linear import rows_independent
from kvbench.kernels.cpu.kivi import kivi_decode_attention, kivi_quantize
from kvbench.kernels.cpu.single_query import decode_attention
from kvbench.kernels.cpu.tokens import compact_tokens, gather_tokens


def install(model: nn.Module) -> int:
    """Build every kernel now (so a first build's second never lands in a timed step), then swap the model's plain
    nn.Linear layers to the decode-step kernel's DecodeLinear; returns how many layers are DecodeLinear."""
    from kvbench.kernels.cpu import decode_linear

    build.load_all()
    return decode_linear.install(model)


__all__ = [
    "causal_column_sums",
    "compact_tokens",
    "decode_attention",
    "enabled",
    "gather_tokens",
    "install",
    "kivi_decode_attention",
    "kivi_quantize",
    "prefill_attention",
    "prefill_attention_supported",
    "rows_independent",
]
