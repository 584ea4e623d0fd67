"""Asymmetric min/max uniform quantization with bit packing (KIVI's scheme): the pure-torch reference.

Contract (the Triton kernels in triton/quant.py follow it bit for bit):
- groups of `group_size` consecutive elements along the LAST axis; per group zero = min,
  scale = (max − min)/(2^bits − 1), q = floor((x − zero)/scale + 0.5) clamped to [0, 2^bits − 1] (round half up,
  which torch and Triton compute alike);
- scale and zero are stored in x's dtype, rounded *outward* (zero ≤ min — exact anyway, min is an element of x —
  and scale rounded up) so that every element lies inside [zero, zero + (2^bits − 1)·scale]: the dequantization
  error is then ≤ scale/2 per element (plus fp32 arithmetic and the final rounding to the output dtype) in bf16 too;
- a constant group has scale 0: it quantizes to q = 0 and dequantizes exactly to zero (no 0/0);
- dequantized = q·scale + zero, computed in fp32 and rounded once to the requested dtype.

Storage layout, for x (..., L) with L = n_groups · group_size:
- packed (..., n_groups · W) int32, W = ceil(group_size · bits / 32) words per group: element j of group g is bits
  [(j mod P)·bits, (j mod P + 1)·bits) of word g·W + j div P, P = 32/bits values per word (16 two-bit, 8 four-bit,
  4 eight-bit; lowest bits first, as KIVI packs). Each group owns whole words, so quantized chunks concatenate along the
  last axis (KIVI's key flushes) without repacking; when group_size·bits is a multiple of 32 nothing is padded.
- scale, zero (..., n_groups) in x's dtype.
"""

from __future__ import annotations

import functools

import torch

BITS = (2, 4, 8)


def words_per_group(bits: int, group_size: int) -> int:
    """int32 words one packed group occupies."""
    per_word = 32 // bits
    return -(-group_size // per_word)


def _check(bits: int, group_size: int, length: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits={bits}: packed quantization supports {BITS}")
    if group_size <= 0 or length % group_size:
        raise ValueError(f"the last axis ({length}) must be a positive multiple of group_size={group_size}")


def quant_params(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (scale, zero), each (..., n_groups) in x's dtype, rounded outward (see the module docstring)."""
    _check(bits, group_size, x.shape[-1])
    scale, zero, _, _ = _params(x.float().unflatten(-1, (-1, group_size)), bits, x.dtype)
    return scale, zero


def _params(
    groups: torch.Tensor, bits: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quant_params of fp32 groups (..., n_groups, G): scale, zero in `dtype` and both in fp32 (..., n_groups).

    Few ops on purpose: KIVI quantizes one value token per decode step, where each op's fixed cost dominates."""
    low, high = torch.aminmax(groups, dim=-1)  # (..., n_groups) fp32; low is one of x's elements: exact in dtype
    exact = (high - low).div_(2**bits - 1)  # (..., n_groups) fp32
    if dtype == torch.float32:
        scale_f32 = exact
    elif dtype == torch.bfloat16:  # bf16 is fp32's top half: round up by carrying into it, then truncate (exact)
        scale_f32 = ((exact.view(torch.int32) + 0xFFFF) & -0x10000).view(torch.float32)
    else:  # round up where the dtype rounded down, so zero + levels·scale still reaches the group's max
        scale = exact.to(dtype)
        scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
        scale_f32 = scale.float()
    # reductions over a transposed x may come back strided
    return scale_f32.to(dtype).contiguous(), low.to(dtype).contiguous(), scale_f32, low


def quantize_pack(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize x (..., L) by groups on the last axis: packed (..., n_groups·W) int32, scale, zero (..., n_groups)"""
    _check(bits, group_size, x.shape[-1])
    groups = x.float().unflatten(-1, (-1, group_size))  # (..., n_groups, G) fp32
    scale, zero, scale_f32, zero_f32 = _params(groups, bits, x.dtype)
    per_word, words = 32 // bits, words_per_group(bits, group_size)
    # a constant group has scale 0 and x − zero = 0 there: dividing by the smallest subnormal instead gives q = 0,
    # and leaves every positive scale as it is
    safe = scale_f32.clamp_min(torch.finfo(torch.float32).smallest_normal * 2**-23)  # (..., n_groups)
    q = groups - zero_f32.unsqueeze(-1)  # (..., n_groups, G); then q = floor((x − zero)/scale + 0.5), clamped
    q = q.div_(safe.unsqueeze(-1)).add_(0.5).floor_().clamp_(0, 2**bits - 1).to(torch.int32)
    if words * per_word != group_size:  # pad each group to whole words (zeros are never read back)
        q = torch.nn.functional.pad(q, (0, words * per_word - group_size))  # (..., n_groups, W·P)
    # the bit fields are disjoint, so their sum is their OR and never carries (int32 shifts wrap the top field into
    # the sign bit; the two's-complement sum keeps it there)
    packed = (q.unflatten(-1, (words, per_word)) << _shifts(bits, x.device)).sum(-1, dtype=torch.int32)
    return packed.flatten(-2), scale, zero  # (..., n_groups·W), (..., n_groups) ×2


@functools.cache
def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    """Each field's bit offset in its word: (32/bits,) int32 (cached: built once per width and device)."""
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Invert quantize_pack: packed (..., n_groups·W) int32, scale/zero (..., n_groups) -> (..., L) in dtype."""
    _check(bits, group_size, group_size * scale.shape[-1])
    words = words_per_group(bits, group_size)
    shifts = _shifts(bits, packed.device)  # (P,)
    words_ = packed.unflatten(-1, (-1, words)).unsqueeze(-1)  # (..., n_groups, W, 1)
    q = words_ >> shifts  # (..., n_groups, W, P) int32; >> is arithmetic, hence the mask
    q &= 2**bits - 1
    out = q.flatten(-2)[..., :group_size].float()  # (..., n_groups, G) fp32; in place below (decode runs this per step)
    out.mul_(scale.float().unsqueeze(-1)).add_(zero.float().unsqueeze(-1))  # q·scale, then + zero: two roundings
    return out.flatten(-2).to(dtype)  # (..., L)


def packed_nbytes(shape: tuple[int, ...], bits: int, group_size: int, dtype: torch.dtype) -> int:
    """Bytes quantize_pack holds for x of `shape` (..., L): payload words + one scale and one zero per group."""
    *lead, length = shape
    rows = 1
    for n in lead:
        rows *= n
    n_groups = length // group_size
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return rows * n_groups * (4 * words_per_group(bits, group_size) + 2 * itemsize)
