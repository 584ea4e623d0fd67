"""Triton decode attention on a KIVI layer's packed storage (CUDA): the contract of kivi_attention.py, fused.

Storage (methods/kivi.py): keys per channel in groups of G tokens — key_packed (B, H_kv, D, N_k·W_k) int32,
key_scale/zero (B, H_kv, D, N_k), then key_residual (B, H_kv, r_k, D); values per token in groups of G channels —
value_packed (B, H_kv, T_v, D/G·W_v), value_scale/zero (B, H_kv, T_v, D/G), then value_residual (B, H_kv, r_v, D).
Slot t holds the t-th stored token for K and V alike; its key is packed when t < N_k·G, its value when t < T_v.

Grid: (B·H_kv, splits). A program holds the G_q query heads of one KV head (GQA: the packed words are read once for
the whole group) and runs an online softmax (log2 units, fp32) over its split of the slots, in blocks of BLOCK_T
slots; BLOCK_T divides G and N_k·G is a multiple of G, so a block's keys are all in one key group or all in the
residual. Per block:
- packed keys: the per-channel scale and zero of the block's group fold into the query, as in kivi_attention.py:
  x·k_t = Σ_d (x_d·s_d)·c_{d,t} + Σ_d x_d·z_d — a (G_q × D) multiply per block instead of dequantizing (D × BLOCK_T);
- values: each slot's codes are dequantized in registers (s·c + z, or its residual row) once and shared by the G_q
  heads; folding p·s instead (kivi_attention.py's trick against a dequantized copy in memory, which a fused kernel
  never makes) would cost G_q multiplies per element instead of one;
- dead slots (evicted on top of KIVI) come as a (B, H_kv, T) int8 mask built from the layer's dead-slot list, and
  score −inf.
Each split writes its running max, denominator and unnormalised output; a few torch ops merge the splits (flash-
decoding) and round once to the query dtype. bits = 16 (that part unquantized) needs nothing special: its packed
part is empty, so every slot reads the residual. Tested against kivi_attention.packed_decode_attention under
TRITON_INTERPRET=1 (tests/kernels/test_triton_kivi.py); no CUDA timing yet (`python -m kvbench.bench kernels
bench.kivi=true`).
"""

from __future__ import annotations

import math

import torch

from kvbench.kernels.kivi_attention import KiviStorage
from kvbench.kernels.quantize import words_per_group
from kvbench.kernels.triton import TRITON_AVAILABLE, tl, triton

# Slots per block: the (G_q, D, BLOCK_T) fp32 product tiles live in registers. Compiled for sm_90 (ptxas, D = 128,
# 4 warps) 16 slots hold G_q = 1-8 without spills (155-168 registers), 32 slots spill at G_q = 8 and G_q = 16 needs
# 8: hence at most 16 slots and 8·128·16 tile elements. Chosen from register counts, not from GPU timings.
_MAX_BLOCK_T = 16
_TILE_ELEMENTS = 8 * 128 * 16
_MIN_BLOCKS_PER_SPLIT = 4  # fewer blocks per split and the merge costs more than the parallelism gains

if TRITON_AVAILABLE:

    @triton.jit
    def _kivi_decode_kernel(
        q_ptr,
        kp_ptr,
        ks_ptr,
        kz_ptr,
        kr_ptr,
        vp_ptr,
        vs_ptr,
        vz_ptr,
        vr_ptr,
        dead_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        n_kv_heads,
        group,
        head_dim,
        n_key_quant,
        n_value_quant,
        n_slots,
        blocks_per_split,
        qk_scale,
        sq_b,
        sq_h,
        sq_d,
        skp_b,
        skp_h,
        skp_d,
        sks_b,
        sks_h,
        sks_d,
        skr_b,
        skr_h,
        skr_t,
        svp_b,
        svp_h,
        svp_t,
        svs_b,
        svs_h,
        svs_t,
        svr_b,
        svr_h,
        svr_t,
        sdead_b,
        sdead_h,
        KEY_BITS: tl.constexpr,
        VALUE_BITS: tl.constexpr,
        GROUP: tl.constexpr,
        KEY_WORDS: tl.constexpr,
        VALUE_WORDS: tl.constexpr,
        HAS_DEAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_Q: tl.constexpr,
    ):
        bh, split = tl.program_id(0), tl.program_id(1)
        b, h = (bh // n_kv_heads).to(tl.int64), (bh % n_kv_heads).to(tl.int64)
        offs_q = tl.arange(0, BLOCK_Q)  # (BQ,) query head within the KV head's group, padded to a power of two
        offs_d = tl.arange(0, BLOCK_D)  # (BD,)
        offs_j = tl.arange(0, BLOCK_T)  # (BT,)
        q_mask, d_mask = offs_q < group, offs_d < head_dim
        q = tl.load(
            q_ptr + b * sq_b + (h * group + offs_q)[:, None] * sq_h + offs_d[None, :] * sq_d,
            mask=q_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # (BQ, BD)
        # per channel d: the word and bit field of d within its value group (values are grouped along channels)
        v_group = offs_d // GROUP  # (BD,)
        v_word = v_group * VALUE_WORDS + (offs_d % GROUP) // (32 // VALUE_BITS)  # (BD,)
        v_shift = ((offs_d % GROUP) % (32 // VALUE_BITS)) * VALUE_BITS  # (BD,)

        m = tl.full((BLOCK_Q,), float("-inf"), tl.float32)  # running max of the scores (log2 units)
        denom = tl.zeros((BLOCK_Q,), tl.float32)  # running Σ exp2(score − m)
        acc = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)  # running Σ exp2(score − m)·v
        n_blocks = tl.cdiv(n_slots, BLOCK_T)
        first = split * blocks_per_split
        for block in range(first, tl.minimum(first + blocks_per_split, n_blocks)):
            t0 = block * BLOCK_T
            slots = t0 + offs_j  # (BT,)
            t_mask = slots < n_slots
            if t0 < n_key_quant:  # packed keys, all in key group t0 // G
                within = slots % GROUP  # (BT,)
                k_word = (t0 // GROUP) * KEY_WORDS + within // (32 // KEY_BITS)  # (BT,)
                k_shift = (within % (32 // KEY_BITS)) * KEY_BITS  # (BT,)
                k_words = tl.load(
                    kp_ptr + b * skp_b + h * skp_h + offs_d[:, None] * skp_d + k_word[None, :],
                    mask=d_mask[:, None],
                    other=0,
                )  # (BD, BT) int32
                k_codes = ((k_words >> k_shift[None, :]) & ((1 << KEY_BITS) - 1)).to(tl.float32)  # (BD, BT)
                k_off = b * sks_b + h * sks_h + offs_d * sks_d + t0 // GROUP  # (BD,) the group's scale/zero
                k_scale = tl.load(ks_ptr + k_off, mask=d_mask, other=0.0).to(tl.float32)  # (BD,)
                k_zero = tl.load(kz_ptr + k_off, mask=d_mask, other=0.0).to(tl.float32)  # (BD,)
                folded = q * k_scale[None, :]  # (BQ, BD): x_d·s_d
                scores = tl.sum(folded[:, :, None] * k_codes[None, :, :], axis=1)  # (BQ, BT)
                scores += tl.sum(q * k_zero[None, :], axis=1)[:, None]  # + Σ_d x_d·z_d
            else:  # full-precision residual keys
                k_rows = slots - n_key_quant  # (BT,)
                keys = tl.load(
                    kr_ptr + b * skr_b + h * skr_h + k_rows[None, :] * skr_t + offs_d[:, None],
                    mask=t_mask[None, :] & d_mask[:, None],
                    other=0.0,
                ).to(tl.float32)  # (BD, BT)
                scores = tl.sum(q[:, :, None] * keys[None, :, :], axis=1)  # (BQ, BT)
            live = t_mask
            if HAS_DEAD:
                dead = tl.load(dead_ptr + b * sdead_b + h * sdead_h + slots, mask=t_mask, other=1)  # (BT,) int8
                live = live & (dead == 0)
            scores = tl.where(live[None, :], scores * qk_scale, float("-inf"))  # (BQ, BT)

            m_new = tl.maximum(m, tl.max(scores, axis=1))  # (BQ,)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing live yet: keep exp2 away from −inf − −inf
            p = tl.exp2(scores - m_safe[:, None])  # (BQ, BT)
            alpha = tl.exp2(m - m_safe)  # (BQ,)

            packed = t_mask & (slots < n_value_quant)  # (BT,)
            residual = t_mask & (slots >= n_value_quant)
            p_mask = packed[:, None] & d_mask[None, :]  # (BT, BD)
            v_words = tl.load(
                vp_ptr + b * svp_b + h * svp_h + slots[:, None] * svp_t + v_word[None, :], mask=p_mask, other=0
            )  # (BT, BD) int32
            v_codes = ((v_words >> v_shift[None, :]) & ((1 << VALUE_BITS) - 1)).to(tl.float32)  # (BT, BD)
            v_off = b * svs_b + h * svs_h + slots[:, None] * svs_t + v_group[None, :]  # (BT, BD) per-token group
            v_scale = tl.load(vs_ptr + v_off, mask=p_mask, other=0.0).to(tl.float32)  # (BT, BD)
            v_zero = tl.load(vz_ptr + v_off, mask=p_mask, other=0.0).to(tl.float32)  # (BT, BD)
            v_rows = slots - n_value_quant  # (BT,)
            exact = tl.load(
                vr_ptr + b * svr_b + h * svr_h + v_rows[:, None] * svr_t + offs_d[None, :],
                mask=residual[:, None] & d_mask[None, :],
                other=0.0,
            ).to(tl.float32)  # (BT, BD)
            values = tl.where(packed[:, None], v_codes * v_scale + v_zero, exact)  # (BT, BD)

            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * values[None, :, :], axis=1)  # (BQ, BD)
            denom = denom * alpha + tl.sum(p, axis=1)
            m = m_new

        part = (bh * tl.num_programs(1) + split).to(tl.int64) * group + offs_q  # (BQ,) row of this split's partials
        tl.store(m_ptr + part, m, mask=q_mask)
        tl.store(l_ptr + part, denom, mask=q_mask)
        tl.store(acc_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=q_mask[:, None] & d_mask[None, :])


def _block_slots(group_size: int, block_q: int, block_d: int) -> int:
    """Slots per block: a power of two dividing group_size (a block never straddles a key group), at most
    _MAX_BLOCK_T and _TILE_ELEMENTS / (G_q · D) (both padded to powers of two)."""
    return min(group_size & -group_size, _MAX_BLOCK_T, max(1, _TILE_ELEMENTS // (block_q * block_d)))


def _n_splits(n_programs: int, n_blocks: int, device: torch.device) -> int:
    """Splits of the slots per (sequence, KV head) so that the grid fills the GPU about twice (flash-decoding)."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-target // n_programs), n_blocks // _MIN_BLOCKS_PER_SPLIT))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t with a unit stride along its last axis, which the kernel reads without a stride (a copy only if needed)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _pointer(t: torch.Tensor) -> torch.Tensor:
    """t, or one element of its dtype when empty (a bits = 16 part): never read, but a launch wants real memory."""
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)


def triton_kivi_decode_attention(
    query: torch.Tensor, storage: KiviStorage, scaling: float, n_splits: int | None = None
) -> torch.Tensor:
    """kivi_attention.packed_decode_attention in one Triton kernel: query (B, H_q, 1, D) -> (B, 1, H_q, D) in the
    query's dtype. n_splits: slot ranges per (sequence, KV head) merged afterwards; None picks one for the GPU."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("triton is not installed")
    query = _unit_last(query)
    key_packed, key_scale, key_zero, key_residual, value_packed, value_scale, value_zero, value_residual = (
        _unit_last(t) for t in storage[:8]
    )
    key_bits, value_bits, group_size, dead = storage[8:]
    bsz, n_q_heads, _, head_dim = query.shape  # (B, H_q, 1, D)
    n_kv_heads = key_residual.shape[1]
    group = n_q_heads // n_kv_heads
    n_key_quant = key_scale.shape[-1] * group_size  # packed key slots, whole groups
    n_value_quant = value_scale.shape[2]
    n_slots = n_key_quant + key_residual.shape[2]
    block_q, block_d = triton.next_power_of_2(group), triton.next_power_of_2(head_dim)
    block_t = _block_slots(group_size, block_q, block_d)
    n_blocks = -(-n_slots // block_t)
    splits = n_splits or _n_splits(bsz * n_kv_heads, n_blocks, query.device)
    blocks_per_split = -(-n_blocks // splits)
    if key_scale.stride() != key_zero.stride() or value_scale.stride() != value_zero.stride():
        key_scale, key_zero = key_scale.contiguous(), key_zero.contiguous()  # one set of strides serves both
        value_scale, value_zero = value_scale.contiguous(), value_zero.contiguous()
    dead_mask = None
    if dead is not None and dead.shape[-1]:
        dead_mask = torch.zeros(bsz, n_kv_heads, n_slots, dtype=torch.int8, device=query.device)  # (B, H_kv, T)
        dead_mask.scatter_(-1, dead.long(), 1)
    stats = torch.empty(2, bsz, n_kv_heads, splits, group, dtype=torch.float32, device=query.device)
    acc = torch.empty(bsz, n_kv_heads, splits, group, head_dim, dtype=torch.float32, device=query.device)
    q3 = query[:, :, 0]  # (B, H_q, D)
    _kivi_decode_kernel[(bsz * n_kv_heads, splits)](
        q3,
        *(_pointer(t) for t in (key_packed, key_scale, key_zero, key_residual)),
        *(_pointer(t) for t in (value_packed, value_scale, value_zero, value_residual)),
        stats if dead_mask is None else dead_mask,  # a placeholder when HAS_DEAD is off
        stats[0],
        stats[1],
        acc,
        n_kv_heads,
        group,
        head_dim,
        n_key_quant,
        n_value_quant,
        n_slots,
        blocks_per_split,
        scaling * math.log2(math.e),
        *q3.stride(),
        *key_packed.stride()[:3],
        *key_scale.stride()[:3],
        *key_residual.stride()[:3],
        *value_packed.stride()[:3],
        *value_scale.stride()[:3],
        *value_residual.stride()[:3],
        *((0, 0) if dead_mask is None else dead_mask.stride()[:2]),
        KEY_BITS=key_bits,
        VALUE_BITS=value_bits,
        GROUP=group_size,
        KEY_WORDS=words_per_group(key_bits, group_size),
        VALUE_WORDS=words_per_group(value_bits, group_size),
        HAS_DEAD=dead_mask is not None,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        BLOCK_Q=block_q,
        enable_fp_fusion=True,  # FMAs welcome (nothing must match torch bit for bit); Triton 3.10 turns them off
    )
    return merge_splits(stats[0], stats[1], acc).reshape(bsz, 1, n_q_heads, head_dim).to(query.dtype)


def merge_splits(maxima: torch.Tensor, denominators: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted merge of per-split partials: maxima/denominators (..., S, G_q) in log2 units, outputs
    (..., S, G_q, D) unnormalised -> (..., G_q, D) fp32. A split with nothing live (max −inf) weighs 0."""
    top = maxima.amax(-2, keepdim=True)  # (..., 1, G_q)
    weight = torch.exp2(maxima - top.clamp_min(torch.finfo(torch.float32).min))  # (..., S, G_q); exp2(−inf) = 0
    total = (denominators * weight).sum(-2)  # (..., G_q)
    return (outputs * weight.unsqueeze(-1)).sum(-3) / total.unsqueeze(-1)  # (..., G_q, D)
