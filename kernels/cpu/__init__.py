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
