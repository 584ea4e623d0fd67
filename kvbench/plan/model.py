"""The planner's arithmetic: a model's shape without its weights, memory fit, and the decode/prefill roofline.

Decode step of a batch of B requests at context T (every weight and every cached byte read once per step):
    bytes  = weights + B · kv_bytes(T)                    (kv bytes as compressed: kvbench.model.kv_bytes)
    FLOPs  = B · (2 · matmul params + 4 · H_q · head_dim · Σ_layers T_layer)   (QKᵀ and AV over the kept tokens)
    bound  = max(bytes / bandwidth, FLOPs / peak)        → bandwidth- or compute-bound
Prefill of B prompts of T tokens: B · (2 · matmul params · T + 2 · H_q · head_dim · L · T²) FLOPs / peak (causal).
Requests sharing a prefix (prefix caching): bytes held once and prefill saved by kvbench.plan.reuse.
Quantized caches are counted at their compressed bytes (a fused dequantizing kernel); dequantization FLOPs and
activation traffic are not modelled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench import KvbenchError
from kvbench.model import layout as layers
from kvbench.model.kv_bytes import KVShape, predict_kv_bytes
from kvbench.model.layout import CacheLayout, cache_layout
from kvbench.model.load import model_config, transformers_reason
from kvbench.plan.hardware import Hardware
from kvbench.plan.quant import quant_bits, quantized_params, weights_bytes
from kvbench.plan.reuse import Reuse, batch_prefill_flops, held_bytes

NO_REUSE = Reuse()
MAX_SEARCH_CONTEXT = 1 << 24  # largest context the fit search tries (16M tokens)
MAX_BATCH = 1 << 20  # the largest batch planned (kvbench.plan.inputs): max_batch's cap


@dataclass(frozen=True)
class Arch:
    name: str
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    n_params: int  # distinct parameters (tied embeddings once)
    tied_embeddings: bool
    max_context: int
    config: object = None  # the transformers config: its per-layer cache layout (kvbench.model.layout)
    quantized_params: int = 0  # weights stored quantized by the checkpoint (`quantization_config`: kvbench.plan.quant)
    quant_method: str | None = None
    quant_bits: float | None = None  # bits per quantized element, its scales included

    def layout(self, dtype: torch.dtype) -> CacheLayout:
        return cache_layout(self.config, dtype)

    def weights_bytes(self, dtype: torch.dtype) -> int:
        """The weights as the checkpoint holds them: quantized matrices at their bits, the rest in `dtype`."""
        return weights_bytes(self.n_params, self.quantized_params, element_bytes(dtype), self.quant_bits)

    def kv_shape(self, dtype: torch.dtype) -> KVShape:
        return KVShape(
            self.n_layers, self.n_kv_heads, self.head_dim, dtype, self.layout(dtype) if self.config else None
        )

    @property
    def matmul_params(self) -> int:
        """Parameters multiplied per token: all but the input embedding lookup (the LM head reuses it when tied)."""
        embedding = self.vocab_size * self.hidden_size
        return self.n_params - embedding + (embedding if self.tied_embeddings else 0)


def arch_of(cfg) -> Arch:
    from transformers import AutoModelForCausalLM

    source = cfg.get("name_or_path") or f"conf/model/{cfg.name}.yaml"
    try:  # transformers' own checks of the fields kvbench.preflight.model_fields does not read
        config = model_config(cfg)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        cache_layout(text, torch.float32)  # bounds and layer types first: 2^40 layers never reach the meta build
        with torch.device("meta"):  # shapes only: an 8B model costs no memory
            model = AutoModelForCausalLM.from_config(config)
    except KvbenchError:
        raise
    except Exception as error:  # any of transformers' refusals (strict fields, unknown classes)
        raise KvbenchError(
            f"the model config {source} is not one transformers can build ({transformers_reason(error)}); fix the "
            "field it names"
        ) from None
    n_params = sum(p.numel() for p in model.parameters())
    written: Any = getattr(config, "quantization_config", None)
    qc: dict = written.to_dict() if hasattr(written, "to_dict") else written if isinstance(written, dict) else {}
    method, bits = quant_bits(qc) if qc else (None, None)
    quantized = quantized_params(model, qc) if bits is not None else 0
    name = cfg.name if cfg.name != "hub" else str(cfg.name_or_path)
    first = layers.layer_configs(text)[0]  # Gemma 4's layers differ: the first layer's heads (the cache: its layout)
    return Arch(
        name,
        layers.n_layers(text),
        layers.n_q_heads(text),
        layers.n_kv_heads(first),
        layers.head_dim(first),
        getattr(text, "hidden_size", None) or text.n_embd,
        text.vocab_size,
        n_params,
        bool(getattr(text, "tie_word_embeddings", False)),
        int(getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", 0) or 0),
        text,
        quantized,
        method,
        bits,
    )


def element_bytes(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


@dataclass(frozen=True)
class Options:
    """How the cache is stored and filled: `kv_bits` per cached element (None: the compute dtype's; fp8/int8 = 8,
    int4 = 4, DeepSeek-V2's deployment 6), `prefill` shared (the whole prompt's K/V exists before a method
    compresses it) or inline (one layer's, or with `prefill_chunk` one layer's chunk, at a time)."""

    kv_bits: int | None = None
    prefill: str = "shared"
    prefill_chunk: int | None = None

    def kv(self, nbytes: int, element: int) -> int:
        """`nbytes` of cache in the compute dtype (`element` bytes each) at `kv_bits` per element, rounded up."""
        return nbytes if self.kv_bits is None else -(-nbytes * self.kv_bits // (8 * element))


DEFAULT = Options()


def prefill_extra(arch: Arch, method, dtype: torch.dtype, context: int, options: Options) -> int:
    """Uncompressed K/V one request holds while its prompt is prefilled, beside the compressed caches: with
    `prefill=shared` every layer's whole prompt (kvbench.native: the methods compress after the forward), inline the
    largest layer's prompt (compressed right after its attention), chunked the largest layer's chunk. The full
    cache compresses nothing: its prefill is its cache."""
    if method.name == "full":
        return 0
    layout = arch.layout(dtype)
    if options.prefill == "shared":
        return layout.full_bytes(context)
    tokens = min(context, options.prefill_chunk or context)
    return max((layout.layer_bytes(i, tokens) for i in range(len(layout.layers))), default=0)


def plan_point(
    arch: Arch,
    hw: Hardware,
    method,
    budget,
    dtype: torch.dtype,
    context: int,
    batch: int,
    headroom: float,
    limits: bool = True,
    reuse: Reuse = NO_REUSE,
    options: Options = DEFAULT,
) -> dict:
    """Memory and roofline for `batch` requests of `context` tokens each under one configuration (sharing
    `reuse.prefix` tokens: kvbench.plan.reuse); with `limits`, also the largest batch at this context and the
    largest context at this batch. Fits: weights + the compressed caches + one prompt's prefill peak ≤ usable, the
    rule `max_batch` and `max_context` follow (so `fits` is `batch ≤ max_batch`)."""
    shape = arch.kv_shape(dtype)
    eb = element_bytes(dtype)
    held = held_bytes(method, budget, shape, context, reuse)
    once, private, view = (options.kv(n, eb) for n in (held.once, held.private, held.view))
    request = predict_kv_bytes(method, budget, shape, context)
    kv_batch = once + batch * private
    weights = arch.weights_bytes(dtype)
    usable = int(hw.memory_bytes * (1 - headroom))
    extra = prefill_extra(arch, method, dtype, context, options)
    total = weights + kv_batch + extra
    fits = total <= usable
    kept_q_heads = arch.n_q_heads  # head merging shares K/V across more query heads; queries are unchanged
    decode_bytes = weights + batch * view  # each request reads its whole view (no shared-prefix kernel)
    decode_flops = batch * (2 * arch.matmul_params + 4 * kept_q_heads * arch.head_dim * sum(request.layer_tokens))
    memory_s, compute_s = decode_bytes / hw.bandwidth_bytes_s, decode_flops / hw.peak_flops
    decode_s = max(memory_s, compute_s)
    prefill, prefill_saved = batch_prefill_flops(arch, method, context, batch, reuse)
    cache = arch.layout(dtype)
    full_bytes = cache.full_bytes(context)  # the model's own cache: sliding layers at their window
    return {
        "context": context,
        "batch": batch,
        "kv_bytes_per_token_full": full_bytes / context,  # averaged over the context (sliding layers stop growing)
        "kv_bytes_full_dense": cache.dense_bytes(context) * batch,
        "compressible_share": cache.at(context).growing_share(context),
        "kv_bytes_per_request": view,
        "kv_bytes": kv_batch,
        "kv_bytes_full": full_bytes * batch,
        "kv_ratio": kv_batch / (full_bytes * batch) if full_bytes else float("nan"),
        "bytes_exact": held.exact,
        "weights_bytes": weights,
        "prefill_peak_bytes": extra,
        "total_bytes": total,
        "device_bytes": hw.memory_bytes,
        "usable_bytes": usable,
        "fits": fits,
        **(
            {
                "max_batch": max_batch(weights + once + extra, private, usable),
                "max_context": max_context(
                    arch, method, budget, dtype, batch, usable, reuse, arch.max_context, options
                ),
            }
            if limits
            else {}
        ),
        "decode_bytes": decode_bytes,
        "decode_flops": decode_flops,
        "arithmetic_intensity": decode_flops / decode_bytes,
        "decode_bound": ("bandwidth" if memory_s >= compute_s else "compute") if fits else "oom",
        "decode_s_bound": decode_s,
        "decode_tokens_per_s_bound": batch / decode_s,
        "prefill_flops": prefill,
        "prefill_s_bound": prefill / hw.peak_flops,
        "reuse": reuse.label,
        "prefix_tokens": held.shared_tokens,
        "kv_bytes_shared": once,
        "kv_bytes_private": private,
        "prefill_flops_saved": prefill_saved,
        "prefill_s_saved": prefill_saved / hw.peak_flops,
    }


def max_batch(fixed: int, kv_per_request: int, usable: int) -> int:
    """The most requests that fit beside `fixed` bytes (weights, what the batch shares once, one prefill's peak);
    requests holding nothing of their own are bounded by the planner's batch limit, never 0 beside a fit."""
    if fixed > usable:
        return 0
    return min(MAX_BATCH, (usable - fixed) // kv_per_request) if kv_per_request else MAX_BATCH


def max_context(
    arch: Arch,
    method,
    budget,
    dtype: torch.dtype,
    batch: int,
    usable: int,
    reuse: Reuse = NO_REUSE,
    limit: int = 0,
    options: Options = DEFAULT,
) -> int:
    """The longest context at which `batch` requests fit by `plan_point`'s rule (bytes grow with context: binary
    search; a shared prefix stays `reuse.prefix` tokens, or the whole context below that), at most the model's
    position limit `limit`."""
    shape, eb, weights = arch.kv_shape(dtype), element_bytes(dtype), arch.weights_bytes(dtype)

    def fits(tokens: int) -> bool:
        held = held_bytes(method, budget, shape, tokens, reuse)
        kv = options.kv(held.once, eb) + batch * options.kv(held.private, eb)
        return weights + kv + prefill_extra(arch, method, dtype, tokens, options) <= usable

    if not fits(1):
        return 0
    low, high = 1, min(MAX_SEARCH_CONTEXT, limit) if limit else MAX_SEARCH_CONTEXT
    if fits(high):
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def write_json(path: Path, payload: dict) -> None:
    from kvbench.store.results import write_atomic

    write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=1, default=str)))
