"""Decode attention straight on KIVI's packed groups: no dequantized copy of the cache (pure torch).

Storage (methods/kivi.py, kernels/quantize.py): keys quantized per channel in groups of G tokens, values per token
in groups of G channels; k = c·s + z with integer codes c, one (scale s, zero z) per group. For one query x the
scale and zero fold out of the sums, so the codes are never scaled element by element:

    keys    x·k_t = Σ_d (x_d·s_{d,n})·c_{d,t} + Σ_d x_d·z_{d,n}          n: t's key group, so per group a
                                                                      (G_q × D)·(D × G) product + a dot product
    values  Σ_t p_t·v_{t,d} = Σ_t (p_t·s_{t,m})·c_{t,d} + Σ_t p_t·z_{t,m}   m: d's value group, so per group a
                                                                      (G_q × T)·(T × G) product + a sum

The codes are unpacked byte-wise (a uint8 view of the int32 words: each byte holds 8/bits codes, lowest bits first,
as quantize packs them, on a little-endian machine) straight into the layout the batched products read, by
permuting the small packed words instead of the codes. Dead slots (evicted on top of KIVI) get −inf scores.
Scores and softmax are fp32; the products run in fp32 (`matmul_dtype`), so the result differs from dequantize-then-
attend (which rounds every dequantized element to the model dtype) by that rounding only.
"""

from __future__ import annotations

import sys

import torch

from kvbench.kernels.quantize import words_per_group


def unpack_codes(packed: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Codes of packed (..., n_groups·W) int32 as (..., n_groups, G) in `dtype` (exact: codes are < 2^bits ≤ 256)."""
    words = words_per_group(bits, group_size)
    grouped = packed.unflatten(-1, (-1, words))  # (..., n_groups, W)
    if sys.byteorder != "little":  # the byte view below assumes the lowest bits sit in the first byte
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # (P,)
        codes = (grouped.unsqueeze(-1) >> shifts) & (2**bits - 1)  # (..., n_groups, W, P)
        return codes.flatten(-2)[..., :group_size].to(dtype)
    data = grouped.contiguous().view(torch.uint8)  # (..., n_groups, 4·W): byte k of a word holds bits [8k, 8k+8)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # (8/bits,)
    codes = (data.unsqueeze(-1) >> shifts) & (2**bits - 1)  # (..., n_groups, 4·W, 8/bits) uint8
    return codes.flatten(-2)[..., :group_size].to(dtype)  # (..., n_groups, G)


def packed_decode_attention(
    query: torch.Tensor,
    key_packed: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    key_residual: torch.Tensor,
    value_packed: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    value_residual: torch.Tensor,
    key_bits: int,
    value_bits: int,
    group_size: int,
    scaling: float,
    dead: torch.Tensor | None = None,
    matmul_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """softmax(q·Kᵀ·scaling)·V for one query per sequence over a KIVI layer's storage; returns (B, 1, H_q, D).

    query (B, H_q, 1, D); keys: key_packed (B, H_kv, D, N_k·W) int32, key_scale/zero (B, H_kv, D, N_k), then the
    full-precision key_residual (B, H_kv, r_k, D); values: value_packed (B, H_kv, T_v, D/G·W), value_scale/zero
    (B, H_kv, T_v, D/G), then value_residual (B, H_kv, r_v, D); N_k·G + r_k = T_v + r_v = T stored slots, in time
    order. dead (B, H_kv, n_dead): slots to leave out. GQA: query head h reads KV head h // (H_q / H_kv).
    """
    bsz, n_q_heads, _, head_dim = query.shape  # (B, H_q, 1, D)
    n_kv_heads = key_residual.shape[1]
    n_group = n_q_heads // n_kv_heads
    x = query.reshape(bsz, n_kv_heads, n_group, head_dim).float()  # (B, H_kv, G_q, D)
    parts = []
    n_key_groups = key_scale.shape[-1]
    if n_key_groups:
        # codes in (B, H_kv, N_k, D, G): permute the packed words, not the codes
        words = key_packed.unflatten(-1, (n_key_groups, -1)).transpose(2, 3)  # (B, H_kv, N_k, D, W)
        codes = unpack_codes(words.flatten(-2), key_bits, group_size, matmul_dtype)  # (B, H_kv, N_k, D, G)
        x_scaled = x.unsqueeze(2) * key_scale.float().transpose(2, 3).unsqueeze(3)  # (B, H_kv, N_k, G_q, D)
        scores = torch.matmul(x_scaled.to(matmul_dtype), codes).float()  # (B, H_kv, N_k, G_q, G)
        offset = torch.matmul(x, key_zero.float())  # (B, H_kv, G_q, N_k): Σ_d x_d·z_{d,n}
        scores = scores + offset.transpose(2, 3).unsqueeze(-1)  # (B, H_kv, N_k, G_q, G)
        parts.append(scores.permute(0, 1, 3, 2, 4).flatten(-2))  # (B, H_kv, G_q, N_k·G)
    parts.append(torch.matmul(x, key_residual.float().transpose(2, 3)))  # (B, H_kv, G_q, r_k)
    scores = torch.cat(parts, dim=-1).mul_(scaling)  # (B, H_kv, G_q, T)
    if dead is not None:
        dead_slots = dead.long().unsqueeze(2).expand(-1, -1, n_group, -1)  # (B, H_kv, G_q, n_dead)
        scores.scatter_(-1, dead_slots, float("-inf"))
    probs = scores.softmax(dim=-1)  # (B, H_kv, G_q, T) fp32

    n_values = value_scale.shape[2]
    out = torch.matmul(probs[..., n_values:], value_residual.float())  # (B, H_kv, G_q, D)
    if n_values:
        n_value_groups = value_scale.shape[-1]
        # codes in (B, H_kv, D/G, T_v, G): again the packed words are permuted
        words = value_packed.unflatten(-1, (n_value_groups, -1)).transpose(2, 3)  # (B, H_kv, D/G, T_v, W)
        codes = unpack_codes(words, value_bits, group_size, matmul_dtype)  # (B, H_kv, D/G, T_v, 1, G)
        codes = codes.flatten(-3, -2)  # (B, H_kv, D/G, T_v, G)
        p = probs[..., :n_values]  # (B, H_kv, G_q, T_v)
        p_scaled = p.unsqueeze(2) * value_scale.float().permute(0, 1, 3, 2).unsqueeze(3)  # (B, H_kv, D/G, G_q, T_v)
        weighted = torch.matmul(p_scaled.to(matmul_dtype), codes).float()  # (B, H_kv, D/G, G_q, G)
        offset = torch.matmul(p, value_zero.float())  # (B, H_kv, G_q, D/G): Σ_t p_t·z_{t,m}
        weighted = weighted + offset.transpose(2, 3).unsqueeze(-1)  # (B, H_kv, D/G, G_q, G)
        out = out + weighted.permute(0, 1, 3, 2, 4).flatten(-2)  # (B, H_kv, G_q, D)
    return out.reshape(bsz, n_q_heads, 1, head_dim).transpose(1, 2).to(query.dtype)  # (B, 1, H_q, D)
