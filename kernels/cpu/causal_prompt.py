"""Causal attention of a whole bfloat16 prompt on CPUs with AVX512-BF16: csrc/prefill_attention.c.

Why: on such a CPU torch's flash attention runs bf16 no faster than float32 (~110 GFLOP/s on 2 cores at the
bundled model's shapes, where its bf16 matrix products reach ~400), and in bf16 the prefill attention is most of a
long prompt's forward pass. The kernel does torch's arithmetic (bf16 products summed in float32, an online softmax
in float32 over key chunks, the exponentials rounded to bf16 for P·V, one rounding of the output) with vdpbf16ps
dot products; its last bits differ from torch's (its own order of additions), so rows computed with it hash apart
(kvbench/run/config_hash.py `bf16_kernels`).

kvbench/model/attention.py calls `prefill_attention` (through kvbench.kernels.backend) for what it can take — a
prefill (Q = T > 1, no mask: is_causal), bf16, CPU, head size 64 or 128, no soft cap, sinks, dropout or shorter
sliding window — and sdpa does the rest. CPUs without
AVX512-BF16 (where bf16 itself is slow), KVBENCH_NO_CPU_EXT=1 or no C compiler: sdpa everywhere.
"""

from __future__ import annotations

import functools

import torch

_SIGNATURE = "pppp" + "l" * 14 + "dpi"  # q k v out, B H_q H_kv T D, 9 strides, scale work threads


def _kernel():
    from kvbench.kernels.cpu import build

    return build.function("prefill_attention", _SIGNATURE)


def supported(head_dim: int) -> bool:
    """Whether the kernel is built for this CPU (AVX512-BF16), takes this head size, and C kernels are on now
    (KVBENCH_NO_CPU_EXT may change within a process: benchmarks switch it)."""
    from kvbench.kernels.cpu import build

    return build.enabled() and _built_for(head_dim)


@functools.cache
def _built_for(head_dim: int) -> bool:
    from kvbench.kernels.cpu import build

    check = build.function("prefill_attention", "l", "prefill_attention_supported")
    return check is not None and _kernel() is not None and bool(check(head_dim))


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """query (B, H_q, T, D), key/value (B, H_kv, T, D): whether `attend` can take this causal prefill."""
    n_q, n_kv, n_tokens, dim = query.shape[1], key.shape[1], query.shape[2], query.shape[-1]
    return (
        query.device.type == key.device.type == value.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype == torch.bfloat16
        and n_tokens > 1
        and key.shape == value.shape
        and key.shape[0] == query.shape[0]
        and key.shape[2] == n_tokens
        and key.shape[-1] == dim
        and n_kv > 0
        and n_q % n_kv == 0
        and all(t.stride(-1) == 1 for t in (query, key, value))
        and supported(dim)
    )


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor | None:
    """softmax(q·kᵀ·scale, causal)·v → (B, T, H_q, D), the layout transformers' attention functions return; None
    if the kernel declined (then the caller runs sdpa)."""
    from kvbench.kernels.cpu import build

    batch, n_q, n_tokens, dim = query.shape
    n_kv, threads = key.shape[1], torch.get_num_threads()
    sizes = ("prefill_attention", "llllip", "prefill_attention_work_bytes")
    kernel, work = _kernel(), build.scratch(*sizes, (batch, n_kv, n_tokens, dim, threads), torch.uint8)
    if kernel is None or work is None:  # work: K and V repacked for the dot products + each thread's tiles
        return None
    out = torch.empty(batch, n_tokens, n_q, dim, dtype=query.dtype)  # (B, T, H_q, D)
    status = kernel(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(),
        batch, n_q, n_kv, n_tokens, dim,
        *query.stride()[:3], *key.stride()[:3], *value.stride()[:3],
        float(scale), work.data_ptr(), threads,
    )  # fmt: skip
    return out if status == 0 else None


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor | None:
    """`attend` where the kernel `applies`, else None (the caller runs sdpa)."""
    return attend(query, key, value, scale) if applies(query, key, value) else None
