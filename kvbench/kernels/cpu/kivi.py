"""KIVI's decode attention on the packed groups in C (csrc/kivi_decode_attention.c). The torch reference — and what
the numbers mean — is kvbench.kernels.kivi_attention; its dispatcher (kvbench.kernels) calls this through the
backend."""

from __future__ import annotations

import torch

from kvbench.kernels.cpu import build
from kvbench.kernels.kivi_attention import KiviStorage

_NO_DEAD = torch.empty(0, dtype=torch.int32)  # what the C kernel reads as "no dead slots"


def kivi_decode_attention(query: torch.Tensor, storage: KiviStorage, scaling: float) -> torch.Tensor | None:
    """kvbench.kernels.kivi_attention.packed_decode_attention in one C call (csrc/kivi_decode_attention.c: the codes
    unpacked in registers and L1, never written out), or None where it does not apply: not on the CPU, a model dtype
    other than fp32 or bf16, no C compiler. Same shapes and result (to fp32 summation order); deterministic, whatever
    the thread count."""
    dtype = query.dtype
    if query.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    floats = (storage.key_scale, storage.key_zero, storage.key_residual, storage.value_scale, storage.value_zero,
              storage.value_residual)  # fmt: skip
    if any(t.dtype != dtype for t in floats):
        return None
    kernel = build.function("kivi_decode_attention", "ppidlllllpppliplpppliplpli")
    if kernel is None:
        return None
    key_packed, key_scale, key_zero, key_residual, value_packed, value_scale, value_zero, value_residual = (
        t.contiguous() for t in storage[:8]
    )
    query, dead = query.contiguous(), storage.dead  # (B, H_q, 1, D): the layout of (B, H_kv, G_q, D)
    dead = _NO_DEAD if dead is None else dead.to(torch.int32).contiguous()  # (B, H_kv, n_dead)
    bsz, n_q_heads, _, head_dim = query.shape
    n_kv_heads = key_residual.shape[1]
    out = torch.empty(bsz, 1, n_q_heads, head_dim, dtype=dtype)  # (B, 1, H_q, D): the layout of (B, H_kv, G_q, D)
    failed = kernel(
        query.data_ptr(), out.data_ptr(), dtype == torch.bfloat16, scaling, bsz, n_kv_heads, n_q_heads // n_kv_heads,
        head_dim, storage.group_size,
        key_packed.data_ptr(), key_scale.data_ptr(), key_zero.data_ptr(), key_scale.shape[-1], storage.key_bits,
        key_residual.data_ptr(), key_residual.shape[2],
        value_packed.data_ptr(), value_scale.data_ptr(), value_zero.data_ptr(), value_scale.shape[2],
        storage.value_bits, value_residual.data_ptr(), value_residual.shape[2],
        dead.data_ptr(), dead.shape[-1] if dead.dim() == 3 else 0, torch.get_num_threads(),
    )  # fmt: skip
    return None if failed else out
