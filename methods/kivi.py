"""KIVI — tuning-free asymmetric 2-bit KV-cache quantization (Liu et al. 2024, https://arxiv.org/abs/2402.02750;
jy-yuan/KIVI), physically packed.

The prefill attends to full-precision K/V (as in KIVI); `compress` then stores each layer as a `KiviLayer`, split
exactly as KIVI's LlamaAttention_KIVI splits the prefill, and decoding follows its flush rules. Quantization is
asymmetric min/max with bit packing (kvbench/kernels/quantize.py: contract and word layout; Triton on CUDA).

Storage layout of one KiviLayer — every tensor is an attribute, so kvbench.model.cache.cache_nbytes counts it:
- keys, quantized PER CHANNEL (K has outlier channels): for each channel, groups of G = group_size consecutive
  tokens along time, i.e. the keys transposed to (B, H_kv, D, T_q) are quantized along their last axis:
    key_packed (B, H_kv, D, T_q/G·W) int32,  key_scale, key_zero (B, H_kv, D, T_q/G) in the model dtype;
  T_q is a multiple of residual_length R; the newest T mod R keys stay in  key_residual (B, H_kv, T mod R, D).
- values, quantized PER TOKEN in groups of G channels (G divides head_dim):
    value_packed (B, H_kv, T_v, D/G·W) int32,  value_scale, value_zero (B, H_kv, T_v, D/G);
  the newest min(T, R) values stay in  value_residual (B, H_kv, min(T, R), D).
W = ceil(G·bits/32) int32 words per group (G·bits/32 when G·bits is a multiple of 32, as with the defaults), bits
being key_bits for keys and value_bits for values.
Storage slot s is the s-th stored token in time order for K and V alike, although their quantized/residual split
points differ. Cache position p (what `update` returns and `select` indexes) is the p-th *live* slot.

Decode-time eviction on top of KIVI (compose with h2o / streamingllm) never re-quantizes: `select` marks slots dead
(`dead`, (B, H_kv, n_dead) int32: each head's dead slots — every head holds as many — None when none) and frees
storage that is dead in every head — whole key groups, full-precision residual tokens, quantized value tokens (one
group each) — so every kept token has been quantized exactly once. A key group with a live member stays held in
full, and its bytes are counted: kv_bytes reports what the cache physically holds.

Decoding (`update`): new tokens join the residuals; attention sees the storage *before* the flush (KIVI attends to
the block it is about to quantize in full precision); then keys flush their residual to quantized storage once it
holds R tokens, values quantize their oldest tokens beyond R. `update` hands attention a view of that storage (a
shallow copy: the same tensors) instead of K/V tensors, and kvbench's attention computes a decode step's single
query directly on the packed groups — scales and zeros folded into the query and the probabilities
(kvbench/kernels/kivi_attention.py) — so no dequantized copy of the cache is made per step; with several queries, a mask
or recorded statistics it dequantizes (`kv`) and uses sdpa. Either way nothing extra is kept.
Keys and values take their own bit widths (`key_bits`, `value_bits`; both default to `bits`), each 2, 4, 8 or 16;
16 is a passthrough for that part (nothing quantized, every token in its residual): bits=16 reproduces the full
cache exactly, for equivalence tests.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from kvbench import KvbenchError
from kvbench.config.registry import knob
from kvbench.kernels import quantize_pack, unpack_dequantize
from kvbench.kernels.kivi_attention import TENSORS, KiviStorage
from kvbench.methods.base import METHODS, Capabilities, Method
from kvbench.methods.compression import Compression
from kvbench.model.cache import MappedLayer

BITS = (2, 4, 8, 16)


def _own(t: torch.Tensor) -> torch.Tensor:
    """t with a storage of its own: a slice would keep (and be counted as) the whole buffer it views."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def check_config(bits: int, group_size: int, residual_length: int, knob: str = "bits") -> None:
    if bits not in BITS:
        raise KvbenchError(f"kivi {knob}={bits}: must be 2, 4 or 8 (packed quantization) or 16 (no quantization)")
    if group_size <= 0 or residual_length <= 0 or residual_length % group_size:
        raise KvbenchError(
            f"kivi residual_length={residual_length} must be a positive multiple of group_size={group_size} "
            f"(keys move to quantized storage in whole groups of tokens), e.g. residual_length={max(group_size, 1) * 2}"
        )


class KiviLayer(MappedLayer):
    """One decoder layer's KIVI cache (layout in the module docstring); `keys`/`values` stay None."""

    is_croppable = False  # crop goes through select

    def __init__(
        self,
        bits: int = 4,
        group_size: int = 64,
        residual_length: int = 64,
        key_bits: int | None = None,
        value_bits: int | None = None,
    ):
        super().__init__()
        self.key_bits = bits if key_bits is None else key_bits
        self.value_bits = bits if value_bits is None else value_bits
        check_config(self.key_bits, group_size, residual_length, "key_bits")
        check_config(self.value_bits, group_size, residual_length, "value_bits")
        self.group_size, self.residual_length = group_size, residual_length
        for name in TENSORS:
            setattr(self, name, None)
        self.dead: torch.Tensor | None = None  # (B, H_kv, n_dead) int32 slots evicted but still stored; None: none

    @classmethod
    def from_kv(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        bits: int,
        group_size: int,
        residual_length: int,
        key_bits: int | None = None,
        value_bits: int | None = None,
    ) -> KiviLayer:
        """A layer holding keys/values (B, H_kv, N, D), split as KIVI splits a prefill (also: already-evicted K/V)."""
        layer = cls(bits, group_size, residual_length, key_bits, value_bits)
        layer.lazy_initialization(keys, values)
        layer._store(keys, values)
        return layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, n_heads, _, head_dim = key_states.shape
        if self.value_bits < 16 and head_dim % self.group_size:
            valid = [g for g in range(1, head_dim + 1) if head_dim % g == 0]
            raise KvbenchError(
                f"kivi group_size={self.group_size} does not divide the model's head_dim={head_dim} (values are "
                f"quantized in groups of group_size channels); valid group sizes: {', '.join(map(str, valid))} "
                f"(residual_length must stay a multiple of it)"
            )
        self.device, self.dtype = key_states.device, key_states.dtype

        def empty(*shape, dtype=self.dtype):
            return torch.empty(*shape, dtype=dtype, device=self.device)

        n_groups = head_dim // self.group_size if self.value_bits < 16 else 0
        self.key_packed = empty(bsz, n_heads, head_dim, 0, dtype=torch.int32)  # (B, H_kv, D, 0)
        self.key_scale, self.key_zero = empty(bsz, n_heads, head_dim, 0), empty(bsz, n_heads, head_dim, 0)
        self.key_residual = empty(bsz, n_heads, 0, head_dim)  # (B, H_kv, 0, D)
        words = n_groups * (-(-self.group_size * self.value_bits // 32))
        self.value_packed = empty(bsz, n_heads, 0, words, dtype=torch.int32)  # (B, H_kv, 0, D/G·W)
        self.value_scale, self.value_zero = empty(bsz, n_heads, 0, n_groups), empty(bsz, n_heads, 0, n_groups)
        self.value_residual = empty(bsz, n_heads, 0, value_states.shape[-1])  # (B, H_kv, 0, D)
        self.is_initialized = True

    # ---- storage -------------------------------------------------------------------------------------------
    def _store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store full-precision tails keys/values (B, H_kv, n, D) — old residual ++ new tokens — by KIVI's rules."""
        group, residual = self.group_size, self.residual_length
        n_keys = 0 if self.key_bits == 16 else keys.shape[2] // residual * residual  # whole residual blocks
        if n_keys:
            transposed = keys[:, :, :n_keys].transpose(2, 3)  # (B, H_kv, D, n_keys)
            packed, scale, zero = quantize_pack(transposed, self.key_bits, group)  # (B, H_kv, D, ·)
            self.key_packed = torch.cat([self.key_packed, packed], dim=-1)  # (B, H_kv, D, T_q/G·W)
            self.key_scale = torch.cat([self.key_scale, scale], dim=-1)  # (B, H_kv, D, T_q/G)
            self.key_zero = torch.cat([self.key_zero, zero], dim=-1)
        self.key_residual = _own(keys[:, :, n_keys:])  # (B, H_kv, n mod R, D)
        n_values = 0 if self.value_bits == 16 else max(0, values.shape[2] - residual)  # the oldest beyond R
        if n_values:
            packed, scale, zero = quantize_pack(values[:, :, :n_values], self.value_bits, group)  # (B, H_kv, n, ·)
            self.value_packed = torch.cat([self.value_packed, packed], dim=2)  # (B, H_kv, T_v, D/G·W)
            self.value_scale = torch.cat([self.value_scale, scale], dim=2)  # (B, H_kv, T_v, D/G)
            self.value_zero = torch.cat([self.value_zero, zero], dim=2)
        self.value_residual = _own(values[:, :, n_values:])  # (B, H_kv, min(n, R), D)

    def _quantized_kv(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The quantized parts dequantized, (B, H_kv, T_q, D) and (B, H_kv, T_v, D); None where empty."""
        keys = values = None
        if self.key_scale.shape[-1]:
            keys = unpack_dequantize(
                self.key_packed, self.key_scale, self.key_zero, self.key_bits, self.group_size, self.dtype
            ).transpose(2, 3)  # (B, H_kv, D, T_q) -> (B, H_kv, T_q, D)
        if self.value_scale.shape[2]:
            values = unpack_dequantize(
                self.value_packed, self.value_scale, self.value_zero, self.value_bits, self.group_size, self.dtype
            )  # (B, H_kv, T_v, D)
        return keys, values

    @staticmethod
    def _join(quantized: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        return residual if quantized is None else torch.cat([quantized, residual], dim=2)  # (B, H_kv, T, D)

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every live token as full-precision keys, values (B, H_kv, N, D): dequantized ++ residual (a copy)."""
        keys, values = self._quantized_kv()
        return self._live(self._join(keys, self.key_residual)), self._live(self._join(values, self.value_residual))

    def _live(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, H_kv, T_stored, D) at the live slots (B, H_kv, N, D)."""
        if self.dead is None:
            return x
        return x.gather(2, self.live_slots().unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))

    def live_slots(self) -> torch.Tensor:
        """Each head's live storage slots, ascending: (B, H_kv, N) int64."""
        bsz, heads = self.key_residual.shape[:2]  # (B, H_kv, ...)
        n_stored = self.n_stored()
        if self.dead is None:
            return torch.arange(n_stored, device=self.device).expand(bsz, heads, n_stored)
        alive = torch.ones(bsz, heads, n_stored, dtype=torch.bool, device=self.device)
        alive.scatter_(-1, self.dead.long(), False)  # (B, H_kv, T_stored)
        return alive.nonzero()[:, 2].view(bsz, heads, -1)  # row-major: ascending within each head

    @staticmethod
    def _dead_of(live: torch.Tensor, n_stored: int) -> torch.Tensor | None:
        """The complement of live slots (B, H_kv, N) among n_stored: (B, H_kv, n_stored − N) int32, None if empty."""
        if live.shape[-1] == n_stored:
            return None
        alive = torch.zeros(*live.shape[:2], n_stored, dtype=torch.bool, device=live.device)
        alive.scatter_(-1, live.long(), True)
        return (~alive).nonzero()[:, 2].view(*live.shape[:2], -1).to(torch.int32)

    # ---- the transformers cache-layer protocol ---------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append key/value_states (B, H_kv, n, D). Returns, in place of both K and V, a view for attention: a
        shallow copy of this layer (the same storage tensors, nothing copied) with the new tokens in its residuals
        — the storage before the flush, which KIVI attends to. kvbench's attention function calls its `attend`
        (packed groups) or `kv` (dequantized); neither is kept."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        view = copy.copy(self)  # _store below replaces the storage tensors, never edits them in place
        view.key_residual = torch.cat([self.key_residual, key_states], dim=2)  # (B, H_kv, r_k + n, D)
        view.value_residual = torch.cat([self.value_residual, value_states], dim=2)  # (B, H_kv, r_v + n, D)
        self._store(view.key_residual, view.value_residual)
        return view, view

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """softmax(q·Kᵀ·scaling)·V of query (B, H_q, 1, D) over the live tokens, on the packed groups (no
        dequantized copy): (B, 1, H_q, D) as transformers' attention functions return it. None when nothing is
        quantized (bits=16, a short prompt): then the attention function's dense path is exact and no slower."""
        from kvbench.kernels import kivi_decode_attention

        if not (self.key_scale.shape[-1] or self.value_scale.shape[2]):
            return None

        return kivi_decode_attention(query, self.storage(), scaling)

    def storage(self) -> KiviStorage:
        """The tensors and knobs attention reads (kvbench/kernels/kivi_attention.py)."""
        tensors = {name: getattr(self, name) for name in TENSORS}
        return KiviStorage(
            **tensors, key_bits=self.key_bits, value_bits=self.value_bits, group_size=self.group_size, dead=self.dead
        )

    def n_stored(self) -> int:
        """Stored slots, live or dead."""
        if not self.is_initialized:
            return 0
        return self.key_scale.shape[-1] * self.group_size + self.key_residual.shape[2]

    def get_seq_length(self) -> int:
        return self.n_stored() - (0 if self.dead is None else self.dead.shape[-1])

    def reset(self) -> None:
        for name in TENSORS:
            setattr(self, name, None)
        self.dead = None
        super().reset()

    def select(self, index: torch.Tensor) -> None:
        """Keep only cache positions `index` (B, H_kv, N), sorted ascending (decode-time eviction on top of KIVI).

        Nothing is re-quantized: the dropped slots are marked dead, and storage dead in every head is freed.
        """
        n_stored = self.n_stored()
        live = self.live_slots().gather(-1, index.to(self.device))  # (B, H_kv, N) storage slots
        used = torch.zeros(n_stored, dtype=torch.bool, device=self.device)
        used[live.flatten()] = True  # (T_stored,): live in some head
        free = self._freeable(~used)  # (T_stored,)
        if free.any():
            self._drop(free)
            renumber = torch.cumsum(~free, 0) - 1  # old slot → new slot
            live = renumber[live]
        self.dead = self._dead_of(live, self.n_stored())

    def _freeable(self, dead: torch.Tensor) -> torch.Tensor:
        """Dead slots (T_stored,) whose key storage can go: in the residual, or in a key group dead as a whole."""
        n_quantized = self.key_scale.shape[-1] * self.group_size
        groups_dead = dead[:n_quantized].view(-1, self.group_size).all(-1)  # (T_q / G,)
        return dead & torch.cat(
            [
                groups_dead.repeat_interleave(self.group_size),
                torch.ones(dead.numel() - n_quantized, dtype=torch.bool, device=dead.device),
            ]
        )

    def _drop(self, free: torch.Tensor) -> None:
        """Remove slots `free` (T_stored,) from every storage tensor (their key groups are free as a whole)."""
        n_quantized, group = self.key_scale.shape[-1] * self.group_size, self.group_size
        if n_quantized:
            keep_groups = ~free[:n_quantized].view(-1, group)[:, 0]  # (T_q / G,)
            bsz, heads, dim = self.key_scale.shape[:3]
            packed = self.key_packed.view(bsz, heads, dim, keep_groups.numel(), -1)  # (B, H_kv, D, T_q/G, W)
            self.key_packed = packed[:, :, :, keep_groups].reshape(bsz, heads, dim, -1)  # (B, H_kv, D, T_q'/G·W)
            self.key_scale, self.key_zero = self.key_scale[..., keep_groups], self.key_zero[..., keep_groups]
        self.key_residual = self.key_residual[:, :, ~free[n_quantized:]]  # (B, H_kv, r', D)
        n_values = self.value_scale.shape[2]
        keep_values = ~free[:n_values]  # (T_v,): one quantization group per token
        self.value_packed = self.value_packed[:, :, keep_values]
        self.value_scale, self.value_zero = self.value_scale[:, :, keep_values], self.value_zero[:, :, keep_values]
        self.value_residual = self.value_residual[:, :, ~free[n_values:]]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest -tokens_to_remove tokens (transformers' convention: a negative count), via select."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): give a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = max(0, self.get_seq_length() + tokens_to_remove)
        bsz, n_heads = self.key_residual.shape[:2]
        self.select(torch.arange(keep, device=self.device).expand(bsz, n_heads, keep))

    def _map(self, fn) -> None:
        if self.is_initialized:
            for name in TENSORS:
                setattr(self, name, fn(getattr(self, name)))
            if self.dead is not None:
                self.dead = fn(self.dead)

    def offload(self):
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        self._map(lambda t: t.to(self.device, non_blocking=True))


@METHODS.register("kivi")
@dataclass
class Kivi(Method):
    """KIVI-style quantized cache: keys per channel, values per token, a full-precision residual of recent tokens."""

    bits: int = 4  # 2 or 4 as in the paper (8 a useful extra); 16 = no quantization (equivalence tests)
    # The paper used group 32 and residual 32–128. 64/64 is what meets kvbench's byte goals on head_dim-64 models:
    # at 4K tokens, with scales and zeros counted, KIVI-4 kv_ratio ≤ 0.30 and KIVI-2 ≤ 0.18 (group 32 doubles the
    # per-group overhead: two 16-bit numbers per 32 elements add 1 bit per element).
    group_size: int = 64  # channels per value group, tokens per key group; must divide head_dim
    residual_length: int = knob(64, tokens=True)  # recent tokens kept in full precision; a multiple of group_size
    key_bits: int | None = None  # keys' bit width (None: `bits`); e.g. key_bits=4 value_bits=2 (KIVI's K4V2)
    value_bits: int | None = None  # values' bit width (None: `bits`)

    caps = Capabilities(
        family="precision", has_budget=False, needs=frozenset({"kvbench_attention"})
    )  # keeps every token

    def __post_init__(self):
        check_config(self.bits, self.group_size, self.residual_length)
        check_config(self.bits_of("key"), self.group_size, self.residual_length, "key_bits")
        check_config(self.bits_of("value"), self.group_size, self.residual_length, "value_bits")

    def bits_of(self, part: str) -> int:
        """The bit width of keys (part="key") or values ("value"): its own knob, else `bits`."""
        own = self.key_bits if part == "key" else self.value_bits
        return self.bits if own is None else own

    @classmethod
    def lossless_params(cls, lm) -> dict:
        return {"bits": 16}  # passthrough: every token stays in the full-precision residual

    def begin(self, n_prompt, n_layers, budget) -> KiviCompression:
        return KiviCompression(self, n_prompt, n_layers, budget)


class KiviCompression(Compression):
    """One example's KIVI cache: every layer quantized whole (no budget)."""

    method: Kivi

    def layer(self, layer_idx, keys, values, stats):
        """A layer's K/V (B, H_kv, T, D) as a KiviLayer, split as KIVI splits a prefill (inline: as produced)."""
        method = self.method
        return KiviLayer.from_kv(
            keys,
            values,
            method.bits,
            method.group_size,
            method.residual_length,
            method.bits_of("key"),
            method.bits_of("value"),
        )
