"""TurboQuant — a random rotation, then an optimal scalar quantizer per coordinate (Zandieh et al. 2025,
https://arxiv.org/abs/2504.19874), as vLLM ships it for the KV cache (`--kv-cache-dtype turboquant_*`), codes
physically packed.

Keys (TurboQuant_mse, the paper's Algorithm 1): a key k is stored as its norm ‖k‖ (fp16) and the b-bit indices of
the rotated unit vector y = Π·k/‖k‖. Every coordinate of y, for any k, follows the marginal of a uniform point on
the unit sphere, f(x) ∝ (1 − x²)^((D−3)/2) (≈ N(0, 1/D)), so one Lloyd-Max codebook of 2^b centroids per (D, b),
solved once on that density, is optimal for every coordinate (the paper's Eq. 4); the expected error of a unit
vector is D·E[(x − c(x))²] ≈ 0.36, 0.117, 0.03, 0.009 at b = 1..4 (the paper's Theorem 1, bound √3·π/2·4^−b).
Dequantized: k̂ = ‖k‖ · Πᵀ·c, where c holds each index's centroid; with norm correction (vLLM's `_nc` presets)
c is rescaled to unit length first. The paper's optional 1-bit QJL residual (TurboQuant_prod) is left out, as vLLM
leaves it out.

The rotation Π: `rotation=hadamard` (vLLM: the Sylvester Hadamard matrix / √D, symmetric, no random signs; D a power
of two) or `rotation=random` (the paper: a random orthogonal matrix, QR of a Gaussian one drawn with `seed`).

Values: vLLM's uniform min/max quantizer per token and head (`value_quantizer=uniform`): b-bit codes with an fp16
scale and zero; `value_quantizer=turboquant` stores values as keys are stored (the paper quantizes both alike).

vLLM's four presets (`preset=`; vllm/config/cache.py CacheDType, its TurboQuant attention backend):
- `turboquant_k8v4`: keys fp8 e4m3 (no rotation, D bytes), values 4-bit uniform — 2.6× per vLLM;
- `turboquant_4bit_nc`: keys 4-bit Lloyd-Max with norm correction, values 4-bit — 3.8×;
- `turboquant_k3v4_nc`: keys 3-bit, values 4-bit — ~3.5×;
- `turboquant_3bit_nc`: keys 3-bit, values 3-bit — 4.9×;
each with vLLM's boundary protection: the first and last 2 layers (at most half the layers) stay in full precision.
Without a preset the bit widths are free (`key_bits`, `value_bits`: 1–8; 16 keeps that part in full precision).

Storage of one TurboQuantLayer, every tensor an attribute (kvbench.model.cache.cache_nbytes counts each), per token
and KV head: keys `key_codes` ⌈D·b_k/8⌉ bytes + `key_norm` 2 bytes (fp8 keys: `key_fp8`, D bytes); values
`value_codes` ⌈D·b_v/8⌉ + `value_scale`, `value_zero` 2 bytes each — vLLM's slot sizes. Every token is stored
quantized, the prompt's after its full-precision prefill (as vLLM quantizes on store after SDPA on the prompt) and
each decoded token as it arrives; attention reads a dequantized copy that is not kept. A precision method like kivi:
no budget; `compose` stacks it under an eviction method (`select` gathers the codes).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvbench import KvbenchError
from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, Capabilities, Method, check_choice
from kvbench.methods.compression import Compression
from kvbench.model.cache import MappedLayer, kv_layer

PRESETS = {  # vLLM's kv-cache dtypes: key format, bits, norm correction
    "turboquant_k8v4": {"key_bits": 8, "value_bits": 4, "norm_correction": False, "fp8_keys": True},
    "turboquant_4bit_nc": {"key_bits": 4, "value_bits": 4, "norm_correction": True, "fp8_keys": False},
    "turboquant_k3v4_nc": {"key_bits": 3, "value_bits": 4, "norm_correction": True, "fp8_keys": False},
    "turboquant_3bit_nc": {"key_bits": 3, "value_bits": 3, "norm_correction": True, "fp8_keys": False},
}
VLLM_BOUNDARY_LAYERS = 2  # vLLM keeps the first and last 2 attention layers of a dense model in full precision
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value: keys beyond it saturate


# ---- the quantizer ---------------------------------------------------------------------------------------------
@functools.cache
def lloyd_max(dim: int, bits: int, grid: int = 40000, iterations: int = 300) -> tuple[torch.Tensor, float]:
    """Lloyd-Max codebook (2^bits centroids, ascending, fp32) for one coordinate of a uniform unit vector in R^dim,
    density f(x) ∝ (1 − x²)^((dim−3)/2) on [−1, 1], and its distortion E[(x − c(x))²] per coordinate."""
    x = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid * 2 - 1  # (G,) cell midpoints: symmetric, never ±1
    log_f = (dim - 3) / 2 * torch.log1p(-x * x)
    weight = torch.exp(log_f - log_f.max())
    weight = weight / weight.sum()  # (G,) probability mass per grid point
    cdf = weight.cumsum(0)
    levels = 2**bits
    centroids = x[torch.searchsorted(cdf, (torch.arange(levels, dtype=torch.float64) + 0.5) / levels)]  # quantiles
    for _ in range(iterations):
        cell = torch.bucketize(x, (centroids[1:] + centroids[:-1]) / 2)  # (G,) nearest centroid
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, weight)
        moment = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, weight * x)
        centroids = torch.where(mass > 0, moment / mass.clamp_min(1e-300), centroids)
    centroids = (centroids - centroids.flip(0)) / 2  # exactly symmetric, as the density is
    cell = torch.bucketize(x, (centroids[1:] + centroids[:-1]) / 2)
    distortion = float((weight * (x - centroids[cell]) ** 2).sum())
    return centroids.float(), distortion


@functools.cache
def rotation_matrix(dim: int, kind: str, seed: int) -> torch.Tensor:
    """Π (dim, dim) fp32, orthogonal: Sylvester Hadamard / √dim (vLLM), or QR of a seeded Gaussian (the paper)."""
    if kind == "hadamard":
        if dim & (dim - 1):
            raise KvbenchError(
                f"turboquant rotation=hadamard needs a power-of-two head_dim (the Sylvester construction); this "
                f"model's is {dim}: use method.rotation=random"
            )
        h = torch.ones(1, 1)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # (2n, 2n)
        return h / math.sqrt(dim)
    gaussian = torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return (q * torch.sign(torch.diagonal(r))).float()  # signs fixed: Haar-distributed


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (..., D) integers in [0, 2^bits) → (..., ⌈D·bits/8⌉) uint8, least significant bit first."""
    if 8 % bits == 0:  # whole codes per byte: code c sits in byte c·bits // 8 at shift c·bits % 8
        per_byte = 8 // bits
        padded = torch.nn.functional.pad(codes.to(torch.uint8), (0, -codes.shape[-1] % per_byte))
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)  # (8/bits,)
        return (padded.unflatten(-1, (-1, per_byte)) << shifts).sum(-1, dtype=torch.uint8)  # disjoint bits: sum = or
    # `bits` bytes hold 8 codes: code 8g + m of group g sits at bit m·bits of the group's little-endian word
    padded = torch.nn.functional.pad(codes.long(), (0, -codes.shape[-1] % 8)).unflatten(-1, (-1, 8))  # (..., G, 8)
    words = (padded << torch.arange(0, 8 * bits, bits, device=codes.device)).sum(-1)  # (..., G) disjoint bits
    groups = (words.unsqueeze(-1) >> torch.arange(0, 8 * bits, 8, device=codes.device)) & 255  # (..., G, bits)
    return groups.flatten(-2)[..., : -(-codes.shape[-1] * bits // 8)].to(torch.uint8)  # (..., ⌈D·bits/8⌉)


def unpack_bits(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """(..., ⌈D·bits/8⌉) uint8 → codes (..., D) int64."""
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # (8/bits,)
        codes = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)  # (..., bytes, 8/bits) uint8
        return codes.flatten(-2)[..., :dim].long()
    groups = torch.nn.functional.pad(packed, (0, -packed.shape[-1] % bits)).unflatten(-1, (-1, bits))  # (..., G, bits)
    words = (groups.long() << torch.arange(0, 8 * bits, 8, device=packed.device)).sum(-1)  # (..., G) 8 codes each
    shifts = torch.arange(0, 8 * bits, bits, device=packed.device)  # (8,): each code's offset in its word
    codes = (words.unsqueeze(-1) >> shifts) & (2**bits - 1)  # (..., G, 8)
    return codes.flatten(-2)[..., :dim]


@dataclass(frozen=True)
class Quantizer:
    """How one part (keys or values) is stored: `mode` rotated (Lloyd-Max on Π·x/‖x‖), uniform (min/max per
    vector), fp8 or raw (full precision); its tensors are made per head_dim on first use (not cache content)."""

    mode: str
    bits: int
    norm_correction: bool = False
    rotation: str = "hadamard"
    seed: int = 0

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x (B, H, T, D) → the stored tensors, each (B, H, T, ·)."""
        if self.mode == "raw":
            return {"raw": x}
        if self.mode == "fp8":
            return {"fp8": x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)}  # (B, H, T, D) 1 byte each
        if self.mode == "uniform":
            low, high = x.float().amin(-1), x.float().amax(-1)  # (B, H, T)
            scale = ((high - low) / (2**self.bits - 1)).half()  # fp16 as stored: codes are found with it
            zero = low.half()
            step = scale.float().clamp_min(1e-8).unsqueeze(-1)
            codes = ((x.float() - zero.float().unsqueeze(-1)) / step).round().clamp(0, 2**self.bits - 1)
            return {"codes": pack_bits(codes, self.bits), "scale": scale, "zero": zero}
        dim = x.shape[-1]
        rotation = rotation_matrix(dim, self.rotation, self.seed).to(x.device)  # (D, D)
        centroids = lloyd_max(dim, self.bits)[0].to(x.device)  # (2^b,)
        norm = x.float().norm(dim=-1)  # (B, H, T)
        rotated = (x.float() / norm.clamp_min(1e-30).unsqueeze(-1)) @ rotation.T  # (B, H, T, D): y = Π·u per row
        codes = torch.bucketize(rotated, (centroids[1:] + centroids[:-1]) / 2)  # (B, H, T, D) nearest centroid
        return {"codes": pack_bits(codes, self.bits), "norm": norm.half()}

    def decode(self, stored: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
        """The stored tensors → (B, H, T, D) in `dtype` (a copy, not kept)."""
        if self.mode == "raw":
            return stored["raw"]
        if self.mode == "fp8":
            return stored["fp8"].to(dtype)
        codes = unpack_bits(stored["codes"], self.bits, dim)  # (B, H, T, D)
        if self.mode == "uniform":
            return (codes * stored["scale"].float().unsqueeze(-1) + stored["zero"].float().unsqueeze(-1)).to(dtype)
        rotation = rotation_matrix(dim, self.rotation, self.seed).to(codes.device)
        centroid = lloyd_max(dim, self.bits)[0].to(codes.device)[codes]  # (B, H, T, D)
        if self.norm_correction:  # vLLM's _nc: the reconstructed unit vector has unit length again
            centroid = centroid / centroid.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        return ((centroid @ rotation) * stored["norm"].float().unsqueeze(-1)).to(dtype)  # Πᵀ·c per row, × ‖x‖

    def bytes_per_vector(self, dim: int, element_bytes: int) -> int:
        """Bytes one token's vector of one head holds (the planner's accounting)."""
        if self.mode == "raw":
            return dim * element_bytes
        if self.mode == "fp8":
            return dim
        return -(-dim * self.bits // 8) + (4 if self.mode == "uniform" else 2)


class TurboQuantLayer(MappedLayer):
    """One decoder layer's TurboQuant cache: `key_*` and `value_*` tensors (module docstring); keys/values None."""

    is_croppable = False

    def __init__(self, keys: Quantizer, values: Quantizer):
        super().__init__()
        self.key_quantizer, self.value_quantizer = keys, values  # not tensors: not cache content
        self.stored: dict[str, dict[str, torch.Tensor]] = {}  # "key"/"value" → name → (B, H_kv, T, ·)

    @classmethod
    def from_kv(cls, keys: torch.Tensor, values: torch.Tensor, key_q: Quantizer, value_q: Quantizer):
        layer = cls(key_q, value_q)
        layer.lazy_initialization(keys, values)
        layer.stored = {"key": key_q.encode(keys), "value": value_q.encode(values)}
        return layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.head_dims = (key_states.shape[-1], value_states.shape[-1])
        self.is_initialized = True

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token dequantized, keys and values (B, H_kv, T, D): a copy."""
        return (
            self.key_quantizer.decode(self.stored["key"], self.head_dims[0], self.dtype),
            self.value_quantizer.decode(self.stored["value"], self.head_dims[1], self.dtype),
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Quantize the new tokens (B, H_kv, n, D) on store; attention reads every token dequantized."""
        new = {"key": self.key_quantizer.encode(key_states), "value": self.value_quantizer.encode(value_states)}
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.stored = new
        else:
            self.stored = {
                part: {name: torch.cat([old, new[part][name]], dim=2) for name, old in tensors.items()}
                for part, tensors in self.stored.items()
            }
        return self.kv()

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return next(iter(self.stored["key"].values())).shape[2]

    def select(self, index: torch.Tensor) -> None:
        """Keep positions `index` (B, H_kv, N) sorted ascending: the codes are gathered, never re-quantized."""
        index = index.to(self.device)

        def gather(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 3:  # (B, H, T) norms, scales, zeros
                return t.gather(2, index)
            return t.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1]))  # (B, H, N, ·)

        self.stored = {part: {k: gather(t) for k, t in tensors.items()} for part, tensors in self.stored.items()}

    def reset(self) -> None:
        self.stored = {}
        super().reset()

    def _map(self, fn) -> None:
        self.stored = {part: {k: fn(t) for k, t in tensors.items()} for part, tensors in self.stored.items()}


@METHODS.register("turboquant")
@dataclass
class TurboQuant(Method):
    """TurboQuant-quantized cache: rotated Lloyd-Max keys, uniform (or rotated) values, codes packed."""

    preset: str = knob("none", choices=("none",) + tuple(PRESETS))  # a vLLM kv-cache dtype; none: the bit widths below
    key_bits: int | None = None  # keys' bits without a preset (default 4): 1–8; 16 = full precision
    value_bits: int | None = None  # values' bits without a preset (default 4): 1–8; 16 = full precision
    norm_correction: bool | None = None  # rescale reconstructed key directions to unit length (default True)
    rotation: str = knob("hadamard", choices=("hadamard", "random"))  # vLLM's Hadamard, or the paper's random one
    seed: int = 0  # the random rotation's seed
    value_quantizer: str = knob("uniform", choices=("uniform", "turboquant"))  # vLLM's min/max, or as keys
    boundary_layers: int | None = None  # first and last layers kept in full precision (None: 2 with a preset, else 0)

    caps = Capabilities(family="precision", has_budget=False)  # keeps every token

    def __post_init__(self):
        check_choice("preset", self.preset, ("none",) + tuple(PRESETS))
        check_choice("rotation", self.rotation, ("hadamard", "random"))
        check_choice("value_quantizer", self.value_quantizer, ("uniform", "turboquant"))
        if self.preset != "none":
            fixed = [k for k in ("key_bits", "value_bits", "norm_correction") if getattr(self, k) is not None]
            if fixed:
                raise KvbenchError(
                    f"turboquant preset={self.preset} fixes {', '.join(fixed)}; drop method.{fixed[0]} or the preset "
                    f"(preset=none takes free bit widths)"
                )
        for name in ("key_bits", "value_bits"):
            bits = getattr(self, name)
            if bits is not None and not (isinstance(bits, int) and (1 <= bits <= 8 or bits == 16)):
                raise KvbenchError(f"turboquant {name}={bits!r}: give 1 to 8 bits, or 16 (that part in full precision)")
        if self.boundary_layers is not None and self.boundary_layers < 0:
            raise KvbenchError(f"turboquant boundary_layers={self.boundary_layers}: must be ≥ 0")

    # ---- what the knobs resolve to ------------------------------------------------------------------------------
    def resolved(self) -> dict:
        """key_bits, value_bits, norm_correction, fp8_keys and boundary_layers after the preset."""
        if self.preset != "none":
            out = dict(PRESETS[self.preset])
            boundary = VLLM_BOUNDARY_LAYERS if self.boundary_layers is None else self.boundary_layers
        else:
            out = {
                "key_bits": 4 if self.key_bits is None else self.key_bits,
                "value_bits": 4 if self.value_bits is None else self.value_bits,
                "norm_correction": True if self.norm_correction is None else self.norm_correction,
                "fp8_keys": False,
            }
            boundary = self.boundary_layers or 0
        return {**out, "boundary_layers": boundary}

    def quantizers(self) -> tuple[Quantizer, Quantizer]:
        r = self.resolved()
        if r["fp8_keys"]:
            keys = Quantizer("fp8", 8)
        elif r["key_bits"] == 16:
            keys = Quantizer("raw", 16)
        else:
            keys = Quantizer("rotated", r["key_bits"], r["norm_correction"], self.rotation, self.seed)
        if r["value_bits"] == 16:
            values = Quantizer("raw", 16)
        elif self.value_quantizer == "uniform":
            values = Quantizer("uniform", r["value_bits"])
        else:
            values = Quantizer("rotated", r["value_bits"], r["norm_correction"], self.rotation, self.seed)
        return keys, values

    def full_precision_layers(self, n_layers: int) -> set[int]:
        """Layers vLLM's boundary protection keeps in full precision: the first and last n, n ≤ n_layers / 2."""
        n = min(self.resolved()["boundary_layers"], n_layers // 2)
        return set(range(n)) | set(range(n_layers - n, n_layers))

    def layer_bytes(self, tokens: int, n_kv_heads: int, head_dim: int, element_bytes: int, full: bool) -> int:
        """Bytes a layer of `tokens` tokens holds (batch 1): the planner's accounting (kvbench.model.kv_bytes)."""
        if full:
            return 2 * tokens * n_kv_heads * head_dim * element_bytes
        keys, values = self.quantizers()
        per_token = keys.bytes_per_vector(head_dim, element_bytes) + values.bytes_per_vector(head_dim, element_bytes)
        return tokens * n_kv_heads * per_token

    @classmethod
    def lossless_params(cls, lm) -> dict:
        return {"key_bits": 16, "value_bits": 16}  # both parts stored as the model computed them

    # ---- the compress path --------------------------------------------------------------------------------------
    def begin(self, n_prompt, n_layers, budget) -> TurboQuantCompression:
        return TurboQuantCompression(self, n_prompt, n_layers, budget)


class TurboQuantCompression(Compression):
    """One example's TurboQuant cache: layers quantized on store, the boundary layers kept as they are."""

    method: TurboQuant

    def __init__(self, method: TurboQuant, n_prompt: int, n_layers: int, budget):
        super().__init__(method, n_prompt, n_layers, budget)
        self.full = method.full_precision_layers(n_layers)

    def layer(self, layer_idx, keys, values, stats):
        """A layer's K/V (B, H_kv, T, D), quantized on store (boundary layers kept as they are)."""
        if layer_idx in self.full:
            return kv_layer(keys, values)
        return TurboQuantLayer.from_kv(keys, values, *self.method.quantizers())
