"""Triton decode attention over ragged KV heads (kvbench.model.ragged's flat layout), one query per sequence.

Layout: flat keys/values (Σ T_s, D) with segment s = b·H_kv + h holding rows [start_s, start_s + T_s); query
(B, H_q, D) for the single new position; query head h·G + g reads segment b·H_kv + h. One program per
(segment, query head of its group): an online softmax over the segment's keys in blocks of BLOCK_K rows, fp32
maths, scores in log2 units (exp2). Output (B, H_q, D) in the query's dtype. Same contract as
kvbench.model.ragged.ragged_attention_reference for Q = 1; tested against it under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import torch

from kvbench.kernels.triton import TRITON_AVAILABLE, tl, triton

_BLOCK_K = 64

if TRITON_AVAILABLE:

    @triton.jit
    def _ragged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        starts_ptr,
        lengths_ptr,
        sq_b,
        sq_h,
        sq_d,
        so_b,
        so_h,
        so_d,
        sk_t,
        sk_d,
        sv_t,
        sv_d,
        n_kv_heads,
        group,
        head_dim,
        qk_scale,
        BLOCK_K: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        segment, g = tl.program_id(0), tl.program_id(1)
        b, h = segment // n_kv_heads, segment % n_kv_heads
        q_head = h * group + g
        start = tl.load(starts_ptr + segment)  # int64 row of the segment's first key
        n_keys = tl.load(lengths_ptr + segment)
        offs_d = tl.arange(0, BLOCK_D)  # (BD,) padded to a power of two, masked beyond head_dim
        d_mask = offs_d < head_dim
        q = tl.load(
            q_ptr + b.to(tl.int64) * sq_b + q_head.to(tl.int64) * sq_h + offs_d * sq_d, mask=d_mask, other=0.0
        ).to(tl.float32)  # (BD,)
        m = tl.max(tl.full((BLOCK_K,), float("-inf"), tl.float32), axis=0)  # running max (log2 units)
        denom = tl.sum(tl.zeros((BLOCK_K,), tl.float32), axis=0)  # running Σ exp2(s − m)
        acc = tl.zeros((BLOCK_D,), tl.float32)  # running Σ p·v
        for k0 in range(0, n_keys, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # (BK,)
            k_mask = offs_k < n_keys
            rows = start + offs_k  # (BK,)
            tile_mask = k_mask[:, None] & d_mask[None, :]  # (BK, BD)
            k = tl.load(k_ptr + rows[:, None] * sk_t + offs_d[None, :] * sk_d, mask=tile_mask, other=0.0)
            s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * qk_scale  # (BK,)
            s = tl.where(k_mask, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            p = tl.exp2(s - m_new)  # (BK,)
            alpha = tl.exp2(m - m_new)
            v = tl.load(v_ptr + rows[:, None] * sv_t + offs_d[None, :] * sv_d, mask=tile_mask, other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)  # (BD,)
            denom = denom * alpha + tl.sum(p, axis=0)
            m = m_new
        out = acc / denom
        tl.store(
            o_ptr + b.to(tl.int64) * so_b + q_head.to(tl.int64) * so_h + offs_d * so_d,
            out.to(o_ptr.dtype.element_ty),
            mask=d_mask,
        )


def triton_ragged_decode(
    query: torch.Tensor,
    flat_keys: torch.Tensor,
    flat_values: torch.Tensor,
    lengths: list[int],
    n_kv_heads: int,
    scaling: float,
) -> torch.Tensor:
    """query (B, H_q, D); flat keys/values (Σ T_s, D); lengths: B·H_kv ints → (B, H_q, D)."""
    _, n_q_heads, head_dim = query.shape  # (B, H_q, D)
    group = n_q_heads // n_kv_heads
    lengths_t = torch.tensor(lengths, dtype=torch.int64, device=query.device)  # (S,)
    starts = torch.cumsum(lengths_t, 0) - lengths_t  # (S,)
    out = torch.empty_like(query)  # (B, H_q, D)
    grid = (len(lengths), group)
    _ragged_decode_kernel[grid](
        query,
        flat_keys,
        flat_values,
        out,
        starts,
        lengths_t,
        *query.stride(),
        *out.stride(),
        *flat_keys.stride(),
        *flat_values.stride(),
        n_kv_heads,
        group,
        head_dim,
        scaling * math.log2(math.e),
        BLOCK_K=_BLOCK_K,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out
