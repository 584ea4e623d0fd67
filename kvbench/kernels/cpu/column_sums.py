"""Causal softmax column sums in one C call per layer (csrc/softmax_column_sums.c): the CPU side of
kvbench.kernels.attention_stats.attention_column_sums (which says what they are, and runs its torch loop where this
declines: a model mask, soft-capped logits, float16, no kernel)."""

from __future__ import annotations

import functools

import torch

from kvbench.kernels.cpu import build

# Queries per work item of the C kernel: its (chunk × T) fp32 score tile stays within ~2 MiB (L2/L3), so scratch does
# not grow with the context. At 4K, one layer, 1 thread: 32 / 64 / 128 / 256 queries 158 / 146 / 142 / 143 ms in fp32
# (the torch loop: 200 ms).
_TILE_FLOATS = 2**19


def _kernel_chunk(n_keys: int) -> int:
    return max(16, min(128, _TILE_FLOATS // max(n_keys, 1)))


def causal_column_sums(rows: torch.Tensor, key: torch.Tensor, out: torch.Tensor) -> bool:
    """out (B, H_kv, G, T) += Σ_i causal softmax(rows_i · Kᵀ), for rows (B, H_kv, G, Q, D) contiguous, in log2 units
    and in the product dtype (fp32, or bf16: exact products with fp32 sums), key (B, H_kv, T, D). bf16 rows by
    AVX512-BF16 dot products where this CPU's build has them, else widened to fp32 for torch's MKL sgemm_ (MKL's bf16
    GEMM was slower here: 151 vs 142 ms). False (nothing added) where neither applies."""
    if rows.device.type != "cpu" or rows.dtype not in (torch.float32, torch.bfloat16):
        return False
    if rows.dtype == torch.bfloat16 and _causal_column_sums_bf16(rows, key.contiguous(), out):
        return True
    fused = _sgemm_kernel()
    if fused is None:
        return False
    keys_t = key.to(rows.dtype).transpose(-1, -2).contiguous()  # (B, H_kv, D, T)
    kernel, sgemm = fused
    _causal_column_sums(kernel, sgemm, rows.float(), keys_t.float(), out)
    return True


def _sgemm_kernel():
    """(C kernel, sgemm_ address), or None: no kernel, or a torch without MKL."""
    kernel = build.function("softmax_column_sums", "ppllllllpppi")
    gemm = build.torch_blas("sgemm_")
    return (kernel, gemm) if kernel is not None and gemm is not None else None


def _work(n_kv: int, n_keys: int, head_dim: int, chunk: int, threads: int, is_bf16: bool) -> torch.Tensor | None:
    """The C kernel's scratch (its size from the kernel itself: packed keys, per-thread tiles, head ids)."""
    sizes = ("softmax_column_sums", "lllliip", "softmax_column_sums_work")
    return build.scratch(*sizes, (n_kv, n_keys, head_dim, chunk, threads, int(is_bf16)), torch.float32)


def _causal_column_sums(kernel, gemm: int, rows: torch.Tensor, keys_t: torch.Tensor, out: torch.Tensor) -> None:
    """`causal_column_sums` for fp32 rows (B, H_kv, G, Q, D) and keys_t (B, H_kv, D, T), contiguous, through sgemm."""
    bsz, n_kv_heads, group, n_queries, head_dim = rows.shape
    n_keys, threads, chunk = keys_t.shape[-1], torch.get_num_threads(), _kernel_chunk(keys_t.shape[-1])
    work = _work(bsz * n_kv_heads, n_keys, head_dim, chunk, threads, False)
    assert work is not None  # the kernel is loaded, so is its size function
    kernel(
        rows.data_ptr(), keys_t.data_ptr(), bsz * n_kv_heads, group, n_queries, n_keys, head_dim, chunk, gemm,
        out.data_ptr(), work.data_ptr(), threads,
    )  # fmt: skip


def _causal_column_sums_bf16(rows: torch.Tensor, keys: torch.Tensor, out: torch.Tensor) -> bool:
    """`causal_column_sums` for bf16 rows (B, H_kv, G, Q, D) and keys (B, H_kv, T, D), contiguous, by AVX512-BF16
    dot products; False (nothing added) where this CPU's build has none."""
    kernel = build.function("softmax_column_sums", "ppllllllppi", "softmax_column_sums_bf16")
    bsz, n_kv_heads, group, n_queries, head_dim = rows.shape
    n_keys, threads, chunk = keys.shape[2], torch.get_num_threads(), _kernel_chunk(keys.shape[2])
    work = _work(bsz * n_kv_heads, n_keys, head_dim, chunk, threads, True) if kernel is not None else None
    if kernel is None or work is None:
        return False
    status = kernel(
        rows.data_ptr(), keys.data_ptr(), bsz * n_kv_heads, group, n_queries, n_keys, head_dim, chunk,
        out.data_ptr(), work.data_ptr(), threads,
    )  # fmt: skip
    return status == 0


def bf16_column_sums() -> bool:
    """Whether bf16 rows take the AVX512-BF16 dot products here (this CPU's build has them, C kernels on now:
    KVBENCH_NO_CPU_EXT may change within a process). Their sums come in their own order: the config hash says so."""
    return build.enabled() and _has_bf16_dot()


@functools.cache
def _has_bf16_dot() -> bool:
    probe = build.function("softmax_column_sums", "", "softmax_column_sums_has_bf16_dot")
    return probe is not None and bool(probe())
