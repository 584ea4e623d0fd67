"""A model's cache layout, layer by layer, read from its config: what transformers' own cache holds for it.

Each decoder layer has a kind:
- `global`   full attention: holds every token, K and V of (B, H_kv, T, D) each;
- `sliding`  a sliding window of W (`layer_types` "sliding_attention" / "chunked_attention", or `sliding_window` on
             a config without `layer_types`): transformers' DynamicSlidingWindowLayer keeps the last W − 1 tokens
             (cache_utils.DynamicSlidingWindowLayer.update: a query sees itself and W − 1 earlier tokens);
- `latent`   multi-head latent attention (DeepSeek-V2/V3, `kv_lora_rank`): the cache's keys are the normalised latent
             (B, 1, T, kv_lora_rank), its values the shared RoPE key part (B, 1, T, qk_rope_head_dim) — where the
             installed transformers caches the latent (`caches_latent`); older ones (5.2) cache every query head's
             K and V, and those layers are `global` of that width;
- `linear`   linear-attention / state-space layers of hybrid models (Qwen3-Next, Jamba, ...): a constant-size state,
             no K/V. kvbench refuses such models (one line naming the layer type): its methods select tokens.

The full cache of a model at T tokens is Σ_layers width · held(T) · bytes, width = the K plus V elements per token
(2 · H_kv · D for attention, kv_lora_rank + qk_rope_head_dim for latent layers), held(T) = T, or min(T, W − 1) for a
sliding layer. `dense_bytes` is every token in every layer (sliding layers as if global), the figure a formula
without windows gives. The planner (kvbench.plan.model) and the rows' kv_bytes_full use this one module.

KV heads as cached: `num_key_value_heads`, else Falcon's rule (multi_query without new_decoder_architecture caches
one head; new_decoder_architecture broadcasts K/V to every query head before caching), else one per query head
(GPT-2, GPT-NeoX). MoE routing does not touch the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench import KvbenchError

SLIDING_TYPES = ("sliding_attention", "chunked_attention")
GLOBAL_TYPES = ("full_attention", "attention", "global")
LINEAR_TYPES = ("linear_attention", "conv", "mamba", "hybrid", "hybrid_sliding", "recurrent")


@dataclass(frozen=True)
class LayerKind:
    kind: str  # global | sliding | latent
    key_width: int  # key elements per token: H_kv · D_k (latent: kv_lora_rank)
    value_width: int  # value elements per token: H_kv · D_v (latent: qk_rope_head_dim)
    window: int | None = None  # sliding: W (the layer holds the last W − 1 tokens)

    def held(self, tokens: int) -> int:
        """Tokens transformers' cache layer holds after `tokens` tokens went through it."""
        return min(tokens, self.window - 1) if self.kind == "sliding" and self.window else tokens

    @property
    def grows(self) -> bool:
        """Whether the layer's cache grows with the context (what a budget compresses by default)."""
        return self.kind != "sliding"


@dataclass(frozen=True)
class CacheLayout:
    layers: tuple[LayerKind, ...]
    dtype: torch.dtype
    n_q_heads: int
    mha_width: int  # K + V elements per token of one layer with one KV head per query head (the MHA reference)

    @property
    def element_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    def layer_bytes(self, layer: int, tokens: int, batch: int = 1) -> int:
        kind = self.layers[layer]
        return batch * (kind.key_width + kind.value_width) * kind.held(tokens) * self.element_bytes

    def full_bytes(self, tokens: int, batch: int = 1) -> int:
        """What the model's own uncompressed transformers cache holds at `tokens` tokens (sliding layers at W − 1)."""
        return sum(self.layer_bytes(i, tokens, batch) for i in range(len(self.layers)))

    def dense_bytes(self, tokens: int, batch: int = 1) -> int:
        """Every token in every layer (no window): the figure a formula without layer types gives."""
        return batch * sum(k.key_width + k.value_width for k in self.layers) * tokens * self.element_bytes

    def mha_bytes(self, tokens: int, batch: int = 1) -> int:
        """The same layers with one KV head per query head (what GQA/MQA/latent caching already saved)."""
        held = sum(k.held(tokens) for k in self.layers)
        return batch * self.mha_width * held * self.element_bytes

    def growing_share(self, tokens: int) -> float:
        """The share of the full cache in layers that grow with the context (a budget's reach by default)."""
        full = self.full_bytes(tokens)
        grows = sum(self.layer_bytes(i, tokens) for i, k in enumerate(self.layers) if k.grows)
        return grows / full if full else 0.0

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k.kind for k in self.layers)

    @property
    def has_sliding(self) -> bool:
        return "sliding" in self.kinds


def _get(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def n_q_heads(config) -> int:
    return int(_get(config, "num_attention_heads", "n_head"))


def head_dim(config) -> int:
    """Per-head width of K (and V): `head_dim`, else hidden / query heads (GPT-2, GPT-NeoX, Phi-3)."""
    hidden = _get(config, "hidden_size", "n_embd")
    return int(_get(config, "head_dim", default=hidden // n_q_heads(config)))


def n_kv_heads(config) -> int:
    """KV heads as the cache holds them (see the module docstring for Falcon, GPT-2 and GPT-NeoX)."""
    if getattr(config, "model_type", "") == "falcon":
        if getattr(config, "new_decoder_architecture", False):
            return n_q_heads(config)  # K/V broadcast to every query head before caching
        return 1 if getattr(config, "multi_query", False) else n_q_heads(config)
    return int(_get(config, "num_key_value_heads", default=n_q_heads(config)))


def n_layers(config) -> int:
    return int(_get(config, "num_hidden_layers", "n_layer"))


def layer_types(config) -> list[str]:
    """transformers' own per-layer types (cache_utils.get_layer_types_and_kwargs): `layer_types`, else sliding for
    every layer when `sliding_window` (or `attention_chunk_size`) is set, else full attention."""
    declared = getattr(config, "layer_types", None)
    if declared:
        return list(declared)
    if getattr(config, "sliding_window", None) is not None or getattr(config, "attention_chunk_size", None):
        return ["sliding_attention"] * n_layers(config)
    return ["full_attention"] * n_layers(config)


def window_of(config, layer_type: str) -> int:
    if layer_type == "chunked_attention":
        return int(config.attention_chunk_size)
    return int(config.sliding_window)


def caches_latent(config) -> bool:
    """Whether the installed transformers caches this latent-attention model's latent (its attention class expands
    K/V from the cache: `expand_kv`, as DeepSeek-V3 has in 5.24) or the per-head K and V (5.2, kvpress's pin).
    A model type transformers does not ship is taken to cache its latent."""
    import importlib

    kind = getattr(config, "model_type", "")
    try:
        module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    except ImportError:
        return True
    attention = [c for n, c in vars(module).items() if n.endswith("Attention") and isinstance(c, type)]
    return not attention or any(hasattr(c, "expand_kv") for c in attention)


def cache_layout(config, dtype: torch.dtype) -> CacheLayout:
    """The layout of `config` (a transformers config; multimodal configs give their text config)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    heads = n_q_heads(config)
    if getattr(config, "kv_lora_rank", None):  # multi-head latent attention
        latent, rope = int(config.kv_lora_rank), int(config.qk_rope_head_dim)
        qk = int(_get(config, "qk_head_dim", default=config.qk_nope_head_dim + rope))
        expanded = heads * (qk + int(config.v_head_dim))  # per-head K (qk) and V (v_head_dim) of every query head
        if not caches_latent(config):  # this transformers caches the expanded heads: that is the model's cache
            kinds = tuple(
                LayerKind("global", heads * qk, heads * int(config.v_head_dim)) for _ in range(n_layers(config))
            )
            return CacheLayout(kinds, dtype, heads, expanded)
        kinds = tuple(LayerKind("latent", latent, rope) for _ in range(n_layers(config)))  # one latent + RoPE key
        return CacheLayout(kinds, dtype, heads, expanded)
    width = n_kv_heads(config) * head_dim(config)
    kinds_list = []
    for i, layer_type in enumerate(layer_types(config)):
        if layer_type in SLIDING_TYPES:
            kinds_list.append(LayerKind("sliding", width, width, window_of(config, layer_type)))
        elif layer_type in GLOBAL_TYPES:
            kinds_list.append(LayerKind("global", width, width))
        elif layer_type in LINEAR_TYPES:
            raise KvbenchError(
                f"layer {i} is a {layer_type!r} layer (a hybrid model, {type(config).__name__}): kvbench compresses "
                "attention caches token by token and does not support models with linear-attention or state-space "
                "layers yet; use a model whose layers are all attention"
            )
        else:
            raise KvbenchError(
                f"layer {i} has layer type {layer_type!r}, which kvbench does not know; supported: "
                f"{', '.join(GLOBAL_TYPES + SLIDING_TYPES)}"
            )
    return CacheLayout(tuple(kinds_list), dtype, heads, 2 * heads * head_dim(config))
