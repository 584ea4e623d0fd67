"""Kernels (attention statistics, KIVI quantization and attention, token copies): the pure-torch references and the
public functions that dispatch — to the Triton modules on CUDA (triton/, `fast_module`), to the optional CPU
backend (cpu/, reached only through kvbench.kernels.backend), else to the torch reference.

Imports happen inside the functions on purpose: run from the repository root, this folder is also importable
as a top-level `kernels` module, which transformers probes (the Hugging Face `kernels` package has the same
name) while it is itself being imported. Importing nothing here keeps that probe harmless.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

__version__ = "N/A"  # not the Hugging Face `kernels` package: transformers' version check then ignores it


def attention_column_sums_reference(query, key, scaling: float, mask=None, softcap: float | None = None):
    from kvbench.kernels.attention_stats import attention_column_sums

    return attention_column_sums(query, key, scaling, mask, softcap)


def attention_column_sums(query, key, scaling: float, mask=None, softcap: float | None = None):
    """Σ over queries of softmax(q·kᵀ·scaling): query (B, H_q, Q, D), key (B, H_kv, T, D) -> (B, H_q, T); causal
    unless the model's `mask` is given, logits soft-capped when `softcap` is. Contract: attention_stats.

    Triton on CUDA (causal, no cap) unless KVBENCH_NO_TRITON=1; the torch reference otherwise.
    """
    if mask is not None or softcap is not None:  # the Triton kernel is causal-only and uncapped
        return attention_column_sums_reference(query, key, scaling, mask, softcap)
    fast = fast_module(query, "stats")
    if fast:
        return fast.triton_attention_column_sums(query, key, scaling)
    return attention_column_sums_reference(query, key, scaling)


def fast_module(tensor, module: str):
    """kvbench.kernels.triton.`module` (a Triton kernel module) when `tensor` is on CUDA, triton imports and
    KVBENCH_NO_TRITON != 1; else None (the caller runs the torch reference)."""
    if tensor.is_cuda and importlib.util.find_spec("triton") and os.environ.get("KVBENCH_NO_TRITON") != "1":
        fast = importlib.import_module(f"kvbench.kernels.triton.{module}")
        if fast.TRITON_AVAILABLE:  # False when triton is present but fails to import
            return fast
    return None


def quantize_pack_reference(x, bits: int, group_size: int):
    from kvbench.kernels.quantize import quantize_pack

    return quantize_pack(x, bits, group_size)


def unpack_dequantize_reference(packed, scale, zero, bits: int, group_size: int, dtype):
    from kvbench.kernels.quantize import unpack_dequantize

    return unpack_dequantize(packed, scale, zero, bits, group_size, dtype)


def quantize_pack(x, bits: int, group_size: int):
    """KIVI quantization of x (..., L) by groups on the last axis -> packed int32, scale, zero (contract: quantize).

    Triton on CUDA unless KVBENCH_NO_TRITON=1; the torch reference otherwise (bit for bit the same). The CPU
    has no C kernel for it: one would save at most 4 % of a KIVI example (measured: kvbench/kernels/cpu)."""
    fast = fast_module(x, "quant")
    if fast:
        return fast.triton_quantize_pack(x, bits, group_size)
    return quantize_pack_reference(x, bits, group_size)


def unpack_dequantize(packed, scale, zero, bits: int, group_size: int, dtype):
    """Invert quantize_pack: packed (..., n_groups·W), scale/zero (..., n_groups) -> (..., L) in dtype."""
    fast = fast_module(packed, "quant")
    if fast:
        return fast.triton_unpack_dequantize(packed, scale, zero, bits, group_size, dtype)
    return unpack_dequantize_reference(packed, scale, zero, bits, group_size, dtype)


def kivi_decode_attention(query, storage, scaling: float):
    """Decode attention of one query on a KIVI layer's packed storage (a kivi_attention.KiviStorage).

    Triton on CUDA (kvbench/kernels/triton/kivi.py, every bit width: a bits=16 part is simply empty) unless
    KVBENCH_NO_TRITON=1; on the CPU the CPU backend's C kernel (kvbench/kernels/cpu/kivi.py) unless KVBENCH_NO_CPU_EXT=1
    or no C compiler; the torch version otherwise.
    """
    from kvbench.kernels.backend import backend
    from kvbench.kernels.kivi_attention import packed_decode_attention

    fast = fast_module(query, "kivi")
    if fast:
        return fast.triton_kivi_decode_attention(query, storage, scaling)
    cpu = backend("cpu")
    out = cpu.kivi_decode_attention(query, storage, scaling) if cpu is not None else None
    return packed_decode_attention(query, storage, scaling) if out is None else out


__all__ = [
    "attention_column_sums",
    "attention_column_sums_reference",
    "kivi_decode_attention",
    "quantize_pack",
    "quantize_pack_reference",
    "unpack_dequantize",
    "unpack_dequantize_reference",
]
