"""Triton kernels for KIVI's packed quantization: the same contract and storage layout as quantize.py, bit for bit.

Layout (see quantize.py): x (..., L) in groups of G along the last axis; packed (..., n_groups·W) int32 with W words
per group, P = 32/bits values per word, lowest bits first; scale, zero (..., n_groups) in x's dtype.

- unpack-dequantize: one program per (block of rows, block of output columns); output column c reads word
  (c div G)·W + (c mod G) div P of its row and shifts it by ((c mod G) mod P)·bits. Neighbouring columns read the same
  word, which the cache serves; maths in fp32, q·scale + zero, rounded once to the output dtype.
- quantize-pack: scale and zero come from quantize.quant_params (two reductions and the outward rounding, cheap in
  torch); one program per (block of rows, group) rounds its (rows × G) tile with IEEE division (div_rn, as torch
  divides) and ORs each word's P fields together.
Both launch with enable_fp_fusion=False so that q·scale + zero is not contracted into an FMA: the results then equal
the torch reference exactly on CUDA too.
"""

from __future__ import annotations

import torch

from kvbench.kernels.quantize import _check, quant_params, words_per_group
from kvbench.kernels.triton import TRITON_AVAILABLE, tl, triton

_BLOCK_R = 32
_BLOCK_C = 128

if TRITON_AVAILABLE:

    @triton.jit
    def _unpack_dequantize_kernel(
        p_ptr,
        s_ptr,
        z_ptr,
        out_ptr,
        n_rows,
        length,
        sp_row,
        ss_row,
        sz_row,
        so_row,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        WORDS: tl.constexpr,
        PER_WORD: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        pid_r, pid_c = tl.program_id(0), tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # (BR,)
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)  # (BC,) output columns
        group, within = cols // GROUP, cols % GROUP  # (BC,) each
        word = group * WORDS + within // PER_WORD  # (BC,) packed column holding each output
        shift = (within % PER_WORD) * BITS  # (BC,)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < length)  # (BR, BC)
        r = rows.to(tl.int64)[:, None]  # (BR, 1)
        w = tl.load(p_ptr + r * sp_row + word[None, :], mask=mask, other=0)  # (BR, BC) int32
        s = tl.load(s_ptr + r * ss_row + group[None, :], mask=mask, other=0.0).to(tl.float32)  # (BR, BC)
        z = tl.load(z_ptr + r * sz_row + group[None, :], mask=mask, other=0.0).to(tl.float32)  # (BR, BC)
        q = (w >> shift[None, :]) & ((1 << BITS) - 1)  # arithmetic shift, then masked: the field as 0..2^bits-1
        out = q.to(tl.float32) * s + z
        tl.store(out_ptr + r * so_row + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bit_or(a, b):
        return a | b

    @triton.jit
    def _quantize_pack_kernel(
        x_ptr,
        s_ptr,
        z_ptr,
        p_ptr,
        n_rows,
        sx_row,
        sx_col,
        ss_row,
        sp_row,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        WORDS: tl.constexpr,
        PER_WORD: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        pid_r, g = tl.program_id(0), tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # (BR,)
        offs = tl.arange(0, BLOCK_W * PER_WORD)  # (BW·P,) element within the group, padded to whole (pow-2) words
        row_mask = rows < n_rows  # (BR,)
        mask = row_mask[:, None] & (offs[None, :] < GROUP)  # (BR, BW·P)
        r = rows.to(tl.int64)
        x = tl.load(
            x_ptr + r[:, None] * sx_row + (g * GROUP + offs)[None, :].to(tl.int64) * sx_col, mask=mask, other=0.0
        ).to(tl.float32)  # (BR, BW·P)
        s = tl.load(s_ptr + r * ss_row + g, mask=row_mask, other=1.0).to(tl.float32)  # (BR,)
        z = tl.load(z_ptr + r * ss_row + g, mask=row_mask, other=0.0).to(tl.float32)  # (BR,)
        s = tl.where(s == 0.0, 1.0, s)  # constant group: x − z is 0, q = 0
        q = tl.floor(tl.math.div_rn(x - z[:, None], s[:, None]) + 0.5)  # (BR, BW·P)
        q = tl.minimum(tl.maximum(q, 0.0), (1 << BITS) - 1)
        q = tl.where(mask, q, 0.0).to(tl.int32)  # padding fields stay 0
        fields = tl.reshape(q, (BLOCK_R, BLOCK_W, PER_WORD)) << (tl.arange(0, PER_WORD) * BITS)[None, None, :]
        packed = tl.reduce(fields, 2, _bit_or)  # (BR, BW) int32
        w = tl.arange(0, BLOCK_W)  # (BW,)
        tl.store(
            p_ptr + r[:, None] * sp_row + g * WORDS + w[None, :], packed, mask=row_mask[:, None] & (w[None, :] < WORDS)
        )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, last) with a unit last stride (a view when possible)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def triton_unpack_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """quantize.unpack_dequantize on the GPU: packed (..., n_groups·W) -> (..., n_groups·G) in dtype."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("triton is not installed")
    n_groups = scale.shape[-1]
    _check(bits, group_size, group_size * n_groups)
    length = n_groups * group_size
    out = torch.empty(*scale.shape[:-1], length, dtype=dtype, device=packed.device)  # (..., L)
    if out.numel() == 0:
        return out
    p2, s2, z2, o2 = _rows(packed), _rows(scale), _rows(zero), out.view(-1, length)  # (R, ·) each
    grid = (triton.cdiv(o2.shape[0], _BLOCK_R), triton.cdiv(length, _BLOCK_C))
    _unpack_dequantize_kernel[grid](
        p2,
        s2,
        z2,
        o2,
        o2.shape[0],
        length,
        p2.stride(0),
        s2.stride(0),
        z2.stride(0),
        o2.stride(0),
        BITS=bits,
        GROUP=group_size,
        WORDS=words_per_group(bits, group_size),
        PER_WORD=32 // bits,
        BLOCK_R=_BLOCK_R,
        BLOCK_C=_BLOCK_C,
        enable_fp_fusion=False,
    )
    return out


def triton_quantize_pack(x: torch.Tensor, bits: int, group_size: int):
    """quantize.quantize_pack on the GPU: x (..., L) -> packed (..., n_groups·W) int32, scale, zero (..., n_groups)."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("triton is not installed")
    scale, zero = quant_params(x, bits, group_size)  # (..., n_groups) each, contiguous
    words = words_per_group(bits, group_size)
    n_groups = scale.shape[-1]
    packed = torch.zeros(*x.shape[:-1], n_groups * words, dtype=torch.int32, device=x.device)  # (..., n_groups·W)
    if packed.numel() == 0:
        return packed, scale, zero
    x2 = x.reshape(-1, x.shape[-1])  # (R, L): a view when the leading axes collapse (any last stride is fine)
    s2, z2, p2 = scale.view(-1, n_groups), zero.view(-1, n_groups), packed.view(-1, n_groups * words)
    grid = (triton.cdiv(x2.shape[0], _BLOCK_R), n_groups)
    _quantize_pack_kernel[grid](
        x2,
        s2,
        z2,
        p2,
        x2.shape[0],
        x2.stride(0),
        x2.stride(1),
        s2.stride(0),
        p2.stride(0),
        BITS=bits,
        GROUP=group_size,
        WORDS=words,
        PER_WORD=32 // bits,
        BLOCK_R=_BLOCK_R,
        BLOCK_W=triton.next_power_of_2(words),
        enable_fp_fusion=False,
    )
    return packed, scale, zero
