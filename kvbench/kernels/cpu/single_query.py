"""One decode step's attention (a single query per row) on the CPU: csrc/decode_attention.c.

Why: each row's output is the same bits whatever the other rows and the thread count (the contract is in the C
file's header), so a grid of configurations decoded as one batch (kvbench/native/grid_decode.py) attends in one call per
layer and still gets what each configuration gets alone; and torch's CPU sdpa for one query is slow in bf16 (~10×
this kernel at 1K–4K tokens on the bundled model's shapes, ~1.5× in fp32: the README's decode table).

kvbench/model/attention.py calls `decode_attention` (through kvbench.kernels.backend) for the steps it can take —
one query, no mask, no soft cap or sinks, CPU, float32/bfloat16, K/V with contiguous tokens — single decodes and grid
steps alike; everything else stays sdpa.
KVBENCH_NO_CPU_EXT=1 (or no C compiler) → sdpa everywhere.
"""

from __future__ import annotations

import torch

from kvbench.kernels.cpu.decode_linear import DTYPES

MAX_GROUP, MAX_DIM = 16, 256  # query heads per KV head, head size: the C kernel's register/stack bounds


def _kernel():
    from kvbench.kernels.cpu import build

    return build.function("decode_attention", "ppppillllplllldi")


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """query (B, H_q, 1, D), key/value (B, H_kv, T, D): whether `attend` can take this step."""
    n_q, n_kv, dim = query.shape[1], key.shape[1], query.shape[-1]
    return (
        query.device.type == key.device.type == value.device.type == "cpu"
        and n_kv > 0
        and query.shape[2] == 1
        and query.dtype == key.dtype == value.dtype
        and query.dtype in DTYPES
        and key.shape == value.shape
        and key.shape[0] == query.shape[0]
        and key.shape[-1] == dim <= MAX_DIM
        and n_q % n_kv == 0
        and n_q // n_kv <= MAX_GROUP
        and all(t.stride(-1) == 1 and (t.shape[2] <= 1 or t.stride(2) == dim) for t in (key, value))
        and _kernel() is not None
    )


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, lengths: list[int] | None = None
) -> torch.Tensor | None:
    """softmax(q·kᵀ·scale)·v over each row's first lengths[b] tokens (all T by default) → (B, 1, H_q, D), the
    layout transformers' attention functions return; None if the kernel could not allocate its scratch."""
    batch, n_q, _, dim = query.shape
    n_kv, n_tokens = key.shape[1], key.shape[2]
    counts = torch.tensor(lengths if lengths is not None else [n_tokens] * batch, dtype=torch.int64)  # (B,)
    if counts.numel() != batch or bool((counts < 0).any()) or bool((counts > n_tokens).any()):
        raise ValueError(f"lengths {lengths} do not fit {batch} rows of {n_tokens} slots")
    q = query.contiguous()  # (B, H_q, 1, D)
    out = torch.empty(batch, 1, n_q, dim, dtype=query.dtype)  # (B, 1, H_q, D): same memory as (B, H_q, 1, D)
    status = _kernel()(
        q.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        out.data_ptr(),
        int(query.dtype == torch.bfloat16),
        batch,
        n_q,
        n_kv,
        dim,
        counts.data_ptr(),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        float(scale),
        torch.get_num_threads(),
    )
    return out if status == 0 else None


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, lengths: list[int] | None = None
) -> torch.Tensor | None:
    """`attend` where the kernel `applies`, else None (the caller runs sdpa)."""
    return attend(query, key, value, scale, lengths) if applies(query, key, value) else None
