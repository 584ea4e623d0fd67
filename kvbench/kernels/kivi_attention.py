"""Decode attention straight on KIVI's packed groups: no dequantized copy of the cache (the torch reference; its C
version is the CPU backend's, kvbench/kernels/cpu/kivi.py).

Storage (methods/kivi.py, quantize.py): keys quantized per channel in groups of G tokens, values per token
in groups of G channels; k = c·s + z with integer codes c, one (scale s, zero z) per group. For one query x the
scale and zero fold out of the sums, so the codes are never scaled element by element:

    keys    x·k_t = Σ_d (x_d·s_{d,n})·c_{d,t} + Σ_d x_d·z_{d,n}          n: t's key group, so per group a
                                                                      (G_q × D)·(D × G) product + a dot product
    values  Σ_t p_t·v_{t,d} = Σ_t (p_t·s_{t,m})·c_{t,d} + Σ_t p_t·z_{t,m}   m: d's value group, so per group a
                                                                      (G_q × T)·(T × G) product + a sum

The codes are unpacked in *bit planes* (`unpack_planes`): on a uint8 view of the packed words, plane j holds field j
of every byte — one mask (and one shift) per plane, one concatenation, one conversion — so a group's codes come out in
the order (plane, byte) instead of time/channel order. Why: a broadcast shift producing the codes in order costs ~10×
more per byte on CPU than these whole-tensor ops. The products are computed in plane order and only their small
outputs (scores, per-channel sums) are put back in order (`_in_order`, one copy); the packed words are permuted (keys:
group axis before channels), never the codes. Dead slots (evicted on top of KIVI) get −inf scores. Scores and
softmax are fp32; the products run in fp32, so the result differs from dequantize-then-attend (which rounds every
dequantized element to the model dtype) by that rounding only. The one large temporary is the codes in fp32, at most
CHUNK_SLOTS slots of them at a time (freed as the layer's attention returns).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from kvbench.kernels.quantize import words_per_group


def unpack_planes(words: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Codes of packed words (..., W) int32 (one group; any strides, the last axis contiguous) in bit-plane order:
    (..., 8/bits · 4W) in `dtype`.

    Column j·4W + m holds code m·(8/bits) + j of the group: field j of byte m (byte m of the words' little-endian
    bytes; quantize packs the lowest bits first). `from_planes` puts columns in this order back in code order.
    """
    if sys.byteorder != "little":  # the byte view assumes the lowest bits sit in the first byte
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)  # (P,)
        codes = (words.unsqueeze(-1) >> shifts) & (2**bits - 1)  # (..., W, P) in code order
        return codes.flatten(-2).unflatten(-1, (-1, 8 // bits)).transpose(-1, -2).flatten(-2).to(dtype)
    data = words.view(torch.uint8)  # (..., 4W): byte m of word w is byte 4w + m
    if bits == 8:
        return data.to(dtype)
    mask, top = 2**bits - 1, 8 - bits
    planes = [data & mask] + [(data >> shift) & mask for shift in range(bits, top, bits)] + [data >> top]
    return torch.cat(planes, dim=-1).to(dtype)  # (..., 8/bits · 4W) in (plane, byte) order


def from_planes(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """x (..., 8/bits · 4W) in bit-plane order -> code order, padding dropped: (..., G) (a view)."""
    return x.unflatten(-1, (8 // bits, -1)).transpose(-1, -2).flatten(-2)[..., :group_size]


def unpack_codes(packed: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Codes of packed (..., n_groups·W) int32 as (..., n_groups, G) in `dtype` (exact: codes are < 2^bits ≤ 256)."""
    words = packed.unflatten(-1, (-1, words_per_group(bits, group_size)))  # (..., n_groups, W)
    return from_planes(unpack_planes(words, bits, dtype), bits, group_size)  # (..., n_groups, G)


def _in_order(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Per-group products x (B, H_kv, n, G_q, 8/bits · 4W) in bit-plane order -> (B, H_kv, G_q, n·G) in code order
    (time for keys, channels for values): one copy of a small tensor."""
    return from_planes(x, bits, group_size).transpose(2, 3).flatten(-2)  # (B, H_kv, G_q, n·G)


# Quantized slots unpacked at once. The codes' temporary (slots · D · 4 bytes per KV head in fp32) then stays bounded on
# long contexts (8192 slots: 2 MiB per head at D = 64); up to 8K slots it is one pass (chunks were slower at 1K–4K).
CHUNK_SLOTS = 8192


class KiviStorage(NamedTuple):
    """What attention reads of a KIVI layer (methods/kivi.py KiviLayer.storage); shapes: packed_decode_attention."""

    key_packed: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    key_residual: torch.Tensor
    value_packed: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    value_residual: torch.Tensor
    key_bits: int
    value_bits: int
    group_size: int
    dead: torch.Tensor | None = None  # (B, H_kv, n_dead) slots to leave out


TENSORS = KiviStorage._fields[:8]  # the layer's tensor attributes, by these names


def _key_scores(x, key_packed, key_scale, key_zero, bits, group_size) -> torch.Tensor:
    """x (B, H_kv, G_q, D) (scaling folded in) against the quantized keys: (B, H_kv, G_q, N_k·G) fp32."""
    n_key_groups = key_scale.shape[-1]
    grouped = key_packed.unflatten(-1, (n_key_groups, -1))  # (B, H_kv, D, N_k, W)
    per_chunk = max(1, CHUNK_SLOTS // group_size)
    chunks = []
    for start in range(0, n_key_groups, per_chunk):
        part = slice(start, start + per_chunk)
        words = grouped[:, :, :, part].transpose(2, 3)  # (B, H_kv, n, D, W): groups first
        codes = unpack_planes(words, bits, torch.float32)  # (B, H_kv, n, D, G') in bit-plane order
        x_scaled = x.unsqueeze(2) * key_scale[..., part].transpose(2, 3).unsqueeze(3)  # (B, H_kv, n, G_q, D) fp32
        offset = torch.matmul(x, key_zero[..., part].float()).transpose(2, 3).unsqueeze(-1)  # (B, H_kv, n, G_q, 1)
        scores = torch.matmul(x_scaled, codes) + offset  # (B, H_kv, n, G_q, G')
        chunks.append(_in_order(scores, bits, group_size))  # (B, H_kv, G_q, n·G)
    return torch.cat(chunks, dim=-1) if len(chunks) > 1 else chunks[0]


def _value_sums(probs, value_packed, value_scale, value_zero, bits, group_size) -> torch.Tensor:
    """probs (B, H_kv, G_q, T_v) over the quantized values: Σ_t p_t·v_t, (B, H_kv, G_q, D) fp32."""
    n_values, n_value_groups = value_scale.shape[2:]
    total: torch.Tensor | None = None
    for start in range(0, n_values, CHUNK_SLOTS):
        part = slice(start, start + CHUNK_SLOTS)
        words = value_packed[:, :, part].unflatten(-1, (n_value_groups, -1)).transpose(2, 3)  # (B, H_kv, D/G, t, W)
        codes = unpack_planes(words, bits, torch.float32)  # (B, H_kv, D/G, t, G') in bit-plane order
        p = probs[..., part]  # (B, H_kv, G_q, t)
        p_scaled = p.unsqueeze(2) * value_scale[:, :, part].permute(0, 1, 3, 2).unsqueeze(3)  # (B, H_kv, D/G, G_q, t)
        offset = torch.matmul(p, value_zero[:, :, part].float()).transpose(2, 3).unsqueeze(-1)  # (B, H_kv, D/G, G_q, 1)
        sums = torch.matmul(p_scaled, codes) + offset  # (B, H_kv, D/G, G_q, G')
        total = sums if total is None else total.add_(sums)
    assert total is not None  # called with n_values > 0
    return _in_order(total, bits, group_size)  # (B, H_kv, G_q, D)


def packed_decode_attention(query: torch.Tensor, storage: KiviStorage, scaling: float) -> torch.Tensor:
    """softmax(q·Kᵀ·scaling)·V for one query per sequence over a KIVI layer's storage; returns (B, 1, H_q, D).

    query (B, H_q, 1, D); keys: key_packed (B, H_kv, D, N_k·W) int32, key_scale/zero (B, H_kv, D, N_k), then the
    full-precision key_residual (B, H_kv, r_k, D); values: value_packed (B, H_kv, T_v, D/G·W), value_scale/zero
    (B, H_kv, T_v, D/G), then value_residual (B, H_kv, r_v, D); N_k·G + r_k = T_v + r_v = T stored slots, in time
    order. dead (B, H_kv, n_dead): slots to leave out. GQA: query head h reads KV head h // (H_q / H_kv).
    """
    key_packed, key_scale, key_zero, key_residual, value_packed, value_scale, value_zero, value_residual = storage[:8]
    key_bits, value_bits, group_size, dead = storage[8:]
    bsz, n_q_heads, _, head_dim = query.shape  # (B, H_q, 1, D)
    n_kv_heads = key_residual.shape[1]
    n_group = n_q_heads // n_kv_heads
    x = query.reshape(bsz, n_kv_heads, n_group, head_dim).float() * scaling  # (B, H_kv, G_q, D), scaling folded in
    n_key_groups = key_scale.shape[-1]  # N_k
    scores = torch.matmul(x, key_residual.float().transpose(2, 3))  # (B, H_kv, G_q, r_k)
    if n_key_groups:
        quantized = _key_scores(x, key_packed, key_scale, key_zero, key_bits, group_size)
        scores = torch.cat([quantized, scores], dim=-1)  # (B, H_kv, G_q, T)
    if dead is not None:
        dead_slots = dead.long().unsqueeze(2).expand(-1, -1, n_group, -1)  # (B, H_kv, G_q, n_dead)
        scores.scatter_(-1, dead_slots, float("-inf"))
    probs = scores.softmax(dim=-1)  # (B, H_kv, G_q, T) fp32

    n_values = value_scale.shape[2]
    out = torch.matmul(probs[..., n_values:], value_residual.float())  # (B, H_kv, G_q, D)
    if n_values:
        probs = probs[..., :n_values]  # (B, H_kv, G_q, T_v)
        out = out + _value_sums(probs, value_packed, value_scale, value_zero, value_bits, group_size)
    return out.reshape(bsz, n_q_heads, 1, head_dim).transpose(1, 2).to(query.dtype)  # (B, 1, H_q, D)
