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

import torch

from kvbench import KvbenchError
from kvbench.model import layout as layers
from kvbench.model.kv_bytes import KVShape, predict_kv_bytes
from kvbench.model.layout import CacheLayout, cache_layout
from kvbench.model.load import model_config
from kvbench.plan.hardware import Hardware
from kvbench.plan.reuse import Reuse, batch_prefill_flops, held_bytes

NO_REUSE = Reuse()
MAX_SEARCH_CONTEXT = 1 << 24  # largest context the fit search tries (16M tokens)


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

    def layout(self, dtype: torch.dtype) -> CacheLayout:
        return cache_layout(self.config, dtype)

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

    try:  # transformers' own checks of the fields kvbench.run.model_fields does not read
        config = model_config(cfg)
        with torch.device("meta"):  # shapes only: an 8B model costs no memory
            model = AutoModelForCausalLM.from_config(config)
    except (TypeError, ValueError, AttributeError) as error:
        source = cfg.get("name_or_path") or f"conf/model/{cfg.name}.yaml"
        raise KvbenchError(
            f"the model config {source} is not one transformers can build ({str(error).splitlines()[0]}); fix "
            "the field it names"
        ) from None
    n_params = sum(p.numel() for p in model.parameters())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = cfg.name if cfg.name != "hub" else str(cfg.name_or_path)
    cache_layout(text, torch.float32)  # refuses layer types kvbench does not support, before any arithmetic
    return Arch(
        name,
        layers.n_layers(text),
        layers.n_q_heads(text),
        layers.n_kv_heads(text),
        layers.head_dim(text),
        getattr(text, "hidden_size", None) or text.n_embd,
        text.vocab_size,
        n_params,
        bool(getattr(text, "tie_word_embeddings", False)),
        int(getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", 0) or 0),
        text,
    )


def element_bytes(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


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
) -> dict:
    """Memory and roofline for `batch` requests of `context` tokens each under one configuration (sharing
    `reuse.prefix` tokens: kvbench.plan.reuse); with `limits`, also the largest batch at this context and the
    largest context at this batch."""
    shape = arch.kv_shape(dtype)
    held = held_bytes(method, budget, shape, context, reuse)
    request = predict_kv_bytes(method, budget, shape, context)
    kv_batch = held.once + batch * held.private
    weights = arch.n_params * element_bytes(dtype)
    usable = int(hw.memory_bytes * (1 - headroom))
    total = weights + kv_batch
    fits = total <= usable
    kept_q_heads = arch.n_q_heads  # head merging shares K/V across more query heads; queries are unchanged
    decode_bytes = weights + batch * held.view  # each request reads its whole view (no shared-prefix kernel)
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
        "compressible_share": cache.growing_share(context),
        "kv_bytes_per_request": held.view,
        "kv_bytes": kv_batch,
        "kv_bytes_full": full_bytes * batch,
        "kv_ratio": kv_batch / (full_bytes * batch),
        "bytes_exact": held.exact,
        "weights_bytes": weights,
        "total_bytes": total,
        "device_bytes": hw.memory_bytes,
        "usable_bytes": usable,
        "fits": fits,
        **(
            {
                "max_batch": max_batch(weights + held.once, held.private, usable),
                "max_context": max_context(shape, method, budget, weights, batch, usable, reuse, arch.max_context),
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
        "kv_bytes_shared": held.once,
        "kv_bytes_private": held.private,
        "prefill_flops_saved": prefill_saved,
        "prefill_s_saved": prefill_saved / hw.peak_flops,
    }


def max_batch(fixed: int, kv_per_request: int, usable: int) -> int:
    """The most requests that fit beside `fixed` bytes (weights, and what the batch shares once)."""
    return max(0, (usable - fixed) // kv_per_request) if kv_per_request else 0


def max_context(
    shape: KVShape, method, budget, weights: int, batch: int, usable: int, reuse: Reuse = NO_REUSE, limit: int = 0
) -> int:
    """The longest context at which `batch` requests fit (bytes grow with context: binary search; a shared prefix
    stays `reuse.prefix` tokens, or the whole context below that), at most the model's position limit `limit`."""

    def fits(tokens: int) -> bool:
        held = held_bytes(method, budget, shape, tokens, reuse)
        return weights + held.once + batch * held.private <= usable

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
