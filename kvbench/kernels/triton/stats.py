"""Triton kernels for attention column sums: same contract as attention_stats.attention_column_sums, O(block) memory.

Layouts: query (B, H_q, Q, D), the last Q positions of a sequence whose keys are key (B, H_kv, T, D), T ≥ Q;
query head h reads KV head h // (H_q / H_kv). Output (B, H_q, T) fp32. Any strides; fp32/bf16/fp16 in, fp32 maths.

Two passes, each recomputing q·kᵀ tile by tile:
1. one program per (query block, query head): online softmax over the visible keys -> row log-sum-exp (B, H_q, Q);
2. one program per (key block, query head): Σ over the queries that see the block of exp(s - lse). Each program owns
   its output columns, so no atomics and the result is deterministic.
Scores are kept in log2 units (scaled by log2 e) so the kernels use exp2.
"""

from __future__ import annotations

import math

import torch

from kvbench.kernels.triton import TRITON_AVAILABLE, tl, triton

_BLOCK_Q = 64
_BLOCK_K = 64

if TRITON_AVAILABLE:

    @triton.jit
    def _row_lse_kernel(
        q_ptr,
        k_ptr,
        lse_ptr,
        sq_b,
        sq_h,
        sq_t,
        sq_d,
        sk_b,
        sk_h,
        sk_t,
        sk_d,
        n_q_heads,
        group,
        n_queries,
        n_keys,
        head_dim,
        qk_scale,
        DOT_DTYPE: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_q, pid_bh = tl.program_id(0), tl.program_id(1)
        b, h = pid_bh // n_q_heads, pid_bh % n_q_heads
        offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BQ,) index within the Q queries
        offs_d = tl.arange(0, BLOCK_D)  # (BD,) padded to a power of two, masked beyond head_dim
        q_pos = n_keys - n_queries + offs_q  # (BQ,) absolute positions
        q_base = q_ptr + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
        k_base = k_ptr + b.to(tl.int64) * sk_b + (h // group).to(tl.int64) * sk_h
        q_mask = (offs_q[:, None] < n_queries) & (offs_d[None, :] < head_dim)  # (BQ, BD)
        q = tl.load(q_base + offs_q[:, None] * sq_t + offs_d[None, :] * sq_d, mask=q_mask, other=0.0)  # (BQ, BD)
        q = q.to(DOT_DTYPE)
        m = tl.full((BLOCK_Q,), float("-inf"), tl.float32)  # running row max, log2 units
        denom = tl.zeros((BLOCK_Q,), tl.float32)  # running Σ exp2(s - m)
        # Keys past the block's last query are invisible to all of it; key 0 is visible to every row, so m is finite
        # after the first tile (padding rows have q_pos ≥ T and see every key, also finite).
        k_end = tl.minimum(n_keys, n_keys - n_queries + (pid_q + 1) * BLOCK_Q)
        for k0 in range(0, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # (BK,)
            k_mask = (offs_k[:, None] < n_keys) & (offs_d[None, :] < head_dim)  # (BK, BD)
            k = tl.load(k_base + offs_k[:, None] * sk_t + offs_d[None, :] * sk_d, mask=k_mask, other=0.0)  # (BK, BD)
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale  # (BQ, BK) fp32
            visible = (offs_k[None, :] <= q_pos[:, None]) & (offs_k[None, :] < n_keys)  # (BQ, BK) causal
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # (BQ,)
            denom = denom * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
            m = m_new
        tl.store(lse_ptr + pid_bh.to(tl.int64) * n_queries + offs_q, m + tl.log2(denom), mask=offs_q < n_queries)

    @triton.jit
    def _column_sum_kernel(
        q_ptr,
        k_ptr,
        lse_ptr,
        out_ptr,
        sq_b,
        sq_h,
        sq_t,
        sq_d,
        sk_b,
        sk_h,
        sk_t,
        sk_d,
        n_q_heads,
        group,
        n_queries,
        n_keys,
        head_dim,
        qk_scale,
        DOT_DTYPE: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_k, pid_bh = tl.program_id(0), tl.program_id(1)
        b, h = pid_bh // n_q_heads, pid_bh % n_q_heads
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # (BK,)
        offs_d = tl.arange(0, BLOCK_D)  # (BD,)
        q_base = q_ptr + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
        k_base = k_ptr + b.to(tl.int64) * sk_b + (h // group).to(tl.int64) * sk_h
        lse_base = lse_ptr + pid_bh.to(tl.int64) * n_queries
        k_mask = (offs_k[:, None] < n_keys) & (offs_d[None, :] < head_dim)  # (BK, BD)
        k = tl.load(k_base + offs_k[:, None] * sk_t + offs_d[None, :] * sk_d, mask=k_mask, other=0.0)  # (BK, BD)
        k_t = tl.trans(k.to(DOT_DTYPE))  # (BD, BK)
        acc = tl.zeros((BLOCK_K,), tl.float32)  # (BK,) column sums
        # Queries before index (first key - (T - Q)) cannot see this block; start at the block holding the first one.
        q_first = tl.maximum(pid_k * BLOCK_K - (n_keys - n_queries), 0)
        for q0 in range((q_first // BLOCK_Q) * BLOCK_Q, n_queries, BLOCK_Q):
            offs_q = q0 + tl.arange(0, BLOCK_Q)  # (BQ,)
            q_mask = (offs_q[:, None] < n_queries) & (offs_d[None, :] < head_dim)  # (BQ, BD)
            q = tl.load(q_base + offs_q[:, None] * sq_t + offs_d[None, :] * sq_d, mask=q_mask, other=0.0)  # (BQ, BD)
            lse = tl.load(lse_base + offs_q, mask=offs_q < n_queries, other=0.0)  # (BQ,)
            s = tl.dot(q.to(DOT_DTYPE), k_t, input_precision=PRECISION) * qk_scale  # (BQ, BK) fp32
            q_pos = n_keys - n_queries + offs_q  # (BQ,)
            visible = (offs_k[None, :] <= q_pos[:, None]) & (offs_q[:, None] < n_queries)  # (BQ, BK)
            # -inf before exp2 (not after) so masked entries never overflow
            acc += tl.sum(tl.exp2(tl.where(visible, s, float("-inf")) - lse[:, None]), axis=0)
        tl.store(out_ptr + pid_bh.to(tl.int64) * n_keys + offs_k, acc, mask=offs_k < n_keys)


def triton_attention_column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Σ over queries of causal softmax(q·kᵀ·scaling), per query head, in fp32; see attention_column_sums."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("triton is not installed")
    bsz, n_q_heads, n_queries, head_dim = query.shape
    n_kv_heads, n_keys = key.shape[1], key.shape[2]
    out = torch.zeros(bsz, n_q_heads, n_keys, dtype=torch.float32, device=query.device)  # (B, H_q, T)
    if out.numel() == 0 or n_queries == 0:
        return out
    if key.dtype != query.dtype:  # tl.dot wants one operand dtype
        key = key.to(query.dtype)
    lse = torch.empty(bsz, n_q_heads, n_queries, dtype=torch.float32, device=query.device)  # (B, H_q, Q) log2 units
    # 16-bit tiles go to tl.dot as they are: their products are exact in its fp32 accumulator. Anything else is cast
    # to fp32 with "ieee" precision (the default would round it to tf32). Off CUDA we are in the interpreter, whose
    # dot multiplies bf16 tiles' raw uint16 bits, so there bf16 takes the fp32 path too (still exact).
    native = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16} if query.is_cuda else {torch.float16: tl.float16}
    dot_dtype = native.get(query.dtype, tl.float32)
    common = dict(
        n_q_heads=n_q_heads,
        group=n_q_heads // n_kv_heads,
        n_queries=n_queries,
        n_keys=n_keys,
        head_dim=head_dim,
        qk_scale=scaling * math.log2(math.e),
        DOT_DTYPE=dot_dtype,
        PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        BLOCK_Q=_BLOCK_Q,
        BLOCK_K=_BLOCK_K,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    strides = (*query.stride(), *key.stride())
    _row_lse_kernel[(triton.cdiv(n_queries, _BLOCK_Q), bsz * n_q_heads)](query, key, lse, *strides, **common)
    _column_sum_kernel[(triton.cdiv(n_keys, _BLOCK_K), bsz * n_q_heads)](query, key, lse, out, *strides, **common)
    return out
