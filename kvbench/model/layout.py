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
  DeepSeek-V3.2's `indexed_attention` layers are latent layers that also cache one indexer key of
             `index_head_dim` per token (transformers' DynamicIndexedLayer): `extra_width`;
- `shared`   a layer that reuses another layer's K/V (Gemma 3n / Gemma 4 `num_kv_shared_layers`, transformers'
             `kv_sharing_modes` "reuse": a DummyLayer): it caches nothing;
Hybrid models (Qwen3.5, Qwen3-Next, Nemotron-H, Granite 4.0-H, Bamba, Jamba, Falcon-H1, Zamba2, LFM2, OLMo-hybrid)
also have linear-attention, Mamba or convolution layers: each keeps a constant-size state per request, no K/V
(kvbench.model.states). The layout's `layers` are the layers that cache K/V, in order — what every method sees and
compresses, indexed 0..A−1 — and `decoder_index` maps each to its decoder layer; `states` lists every layer's
state (a Falcon-H1 "hybrid" layer has both). The full cache is the attention layers' K/V plus the states.

Whether a layer grows depends on the context, not only on its type: a sliding layer whose window is longer than every
token the run sees (W − 1 ≥ tokens: Mistral-7B-v0.1's 4,096 below 4K tokens) holds every token and is masked like a
global layer, so `CacheLayout.at(tokens)` types it `global` and a budget compresses it. Its bytes are the same either
way (held(T) = T for T ≤ W − 1), so the full cache's accounting does not change.

The full cache of a model at T tokens is Σ_layers width · held(T) · bytes (+ the states, per request), width = the K
plus V elements per token
(2 · H_kv · D for attention, kv_lora_rank + qk_rope_head_dim for latent layers), held(T) = T, or min(T, W − 1) for a
sliding layer. `dense_bytes` is every token in every layer (sliding layers as if global), the figure a formula
without windows gives. The planner (kvbench.plan.model) and the rows' kv_bytes_full use this one module.

KV heads as cached: `num_key_value_heads`, else Falcon's rule (multi_query without new_decoder_architecture caches
one head; new_decoder_architecture broadcasts K/V to every query head before caching), else one per query head
(GPT-2, GPT-NeoX). MoE routing does not touch the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvbench import KvbenchError
from kvbench.model import states as model_states
from kvbench.model.states import LayerState

SLIDING_TYPES = ("sliding_attention", "chunked_attention")
GLOBAL_TYPES = ("full_attention", "attention", "global")
INDEXED_TYPES = ("indexed_attention",)  # DeepSeek-V3.2: latent K/V plus one indexer key per token
MAX_LAYERS = 4096  # the most decoder layers a config may declare (the largest published models have ~130)
LINEAR_TYPES = model_states.STATE_TYPES + tuple(model_states.HYBRID_TYPES)  # layers keeping a state


@dataclass(frozen=True)
class LayerKind:
    kind: str  # global | sliding | latent | shared
    key_width: int  # key elements per token: H_kv · D_k (latent: kv_lora_rank)
    value_width: int  # value elements per token: H_kv · D_v (latent: qk_rope_head_dim)
    window: int | None = None  # sliding: W (the layer holds the last W − 1 tokens)
    extra_width: int = 0  # further elements cached per token (DeepSeek-V3.2's indexer key)

    @property
    def width(self) -> int:
        """Elements cached per token: K + V (+ the indexer key)."""
        return self.key_width + self.value_width + self.extra_width

    def held(self, tokens: int) -> int:
        """Tokens transformers' cache layer holds after `tokens` tokens went through it."""
        if self.kind == "shared":
            return 0
        return min(tokens, self.window - 1) if self.kind == "sliding" and self.window else tokens

    @property
    def grows(self) -> bool:
        """Whether the layer's cache grows with the context at any length (`CacheLayout.at` decides per context)."""
        return self.kind not in ("sliding", "shared")


@dataclass(frozen=True)
class CacheLayout:
    layers: tuple[LayerKind, ...]  # the layers caching K/V (all decoder layers but a hybrid's state-only ones)
    dtype: torch.dtype
    n_q_heads: int
    mha_width: int  # K + V elements per token of one layer with one KV head per query head (the MHA reference)
    states: tuple[tuple[int, LayerState], ...] = ()  # (decoder layer, its state) for each layer keeping one
    decoder_index: tuple[int, ...] | None = None  # decoder layer of each entry of `layers`; None: the same index
    n_decoder_layers: int = 0  # decoder layers in all (0: len(layers))

    @property
    def element_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a constant-size state (linear attention, Mamba, convolution)."""
        return bool(self.states)

    def state_bytes(self, batch: int = 1) -> int:
        """Bytes of every layer's state for `batch` requests: constant in the context, out of a KV method's reach."""
        return batch * sum(state.nbytes(self.dtype) for _, state in self.states)

    def layer_bytes(self, layer: int, tokens: int, batch: int = 1) -> int:
        kind = self.layers[layer]
        return batch * kind.width * kind.held(tokens) * self.element_bytes

    def attention_bytes(self, tokens: int, batch: int = 1) -> int:
        """The attention layers' K/V at `tokens` tokens (sliding layers at W − 1), without the states."""
        return sum(self.layer_bytes(i, tokens, batch) for i in range(len(self.layers)))

    def full_bytes(self, tokens: int, batch: int = 1) -> int:
        """What the model's own uncompressed transformers cache holds at `tokens` tokens (sliding layers at W − 1,
        a hybrid's states included)."""
        return self.attention_bytes(tokens, batch) + self.state_bytes(batch)

    def dense_bytes(self, tokens: int, batch: int = 1) -> int:
        """Every token in every layer (no window): the figure a formula without layer types gives."""
        return batch * sum(k.width for k in self.layers) * tokens * self.element_bytes + self.state_bytes(batch)

    def mha_bytes(self, tokens: int, batch: int = 1) -> int:
        """The same layers with one KV head per query head (what GQA/MQA/latent caching already saved)."""
        held = sum(k.held(tokens) for k in self.layers)
        return batch * self.mha_width * held * self.element_bytes + self.state_bytes(batch)

    def growing_share(self, tokens: int) -> float:
        """The share of the full cache in layers that grow with the context (a budget's reach by default)."""
        full = self.full_bytes(tokens)
        grows = sum(self.layer_bytes(i, tokens) for i, k in enumerate(self.layers) if k.grows)
        return grows / full if full else 0.0

    def decoder_layer(self, layer: int) -> int:
        """The decoder layer of entry `layer` of `layers`."""
        return layer if self.decoder_index is None else self.decoder_index[layer]

    @property
    def decoder_layers(self) -> tuple[int, ...]:
        """The decoder layer of each entry of `layers`, in order."""
        return tuple(range(len(self.layers))) if self.decoder_index is None else self.decoder_index

    def at(self, tokens: int) -> CacheLayout:
        """This layout for a run that sees at most `tokens` tokens (prompt, appended question and decoded ones): a
        sliding layer whose window never fills (W − 1 ≥ tokens) holds and sees every token, as a global layer does,
        so it is typed global and a budget compresses it; its bytes at ≤ `tokens` tokens are unchanged."""
        kinds = tuple(
            LayerKind("global", k.key_width, k.value_width, None, k.extra_width)
            if k.kind == "sliding" and k.window and k.window - 1 >= tokens
            else k
            for k in self.layers
        )
        return replace(self, layers=kinds)

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


def layer_configs(config) -> list:
    """One config per decoder layer: transformers' `per_layer_config` where a model's layers differ (Gemma 4's
    global layers have their own head_dim), else the config itself for every layer."""
    try:
        per_layer = getattr(config, "per_layer_config", None)
    except Exception:  # a config class whose per-layer view does not build: the config itself
        per_layer = None
    return list(per_layer) if per_layer else [config] * n_layers(config)


def layer_types(config) -> list[str]:
    """transformers' own per-layer types (cache_utils.get_layer_types_and_kwargs): `layer_types`, else per layer
    sliding when `sliding_window` is set, chunked when `attention_chunk_size` is, else full attention; a layer whose
    `kv_sharing_modes` is "reuse" reads another layer's K/V and caches nothing ("shared")."""
    declared = getattr(config, "layer_types", None)
    if declared:
        types = list(declared)
    else:
        types = [
            "sliding_attention"
            if getattr(layer, "sliding_window", None) is not None
            else "chunked_attention"
            if getattr(layer, "attention_chunk_size", None)
            else "full_attention"
            for layer in layer_configs(config)
        ]
    try:
        sharing = getattr(config, "kv_sharing_modes", None)
    except (ValueError, TypeError) as error:  # transformers' own check of num_kv_shared_layers
        raise KvbenchError(
            f"{type(config).__name__}: num_kv_shared_layers does not fit its layer_types ({str(error).splitlines()[0]})"
            "; fix num_kv_shared_layers"
        ) from None
    if sharing:
        types = ["shared" if mode == "reuse" else t for t, mode in zip(types, sharing)]
    return types


def window_of(config, layer_type: str) -> int:
    name = "attention_chunk_size" if layer_type == "chunked_attention" else "sliding_window"
    window = getattr(config, name, None)
    if window is None and name == "attention_chunk_size":  # transformers' chunked layers without a chunk size
        window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 2:
        raise KvbenchError(
            f"{type(config).__name__}: {name}={window} for a {layer_type} layer, which holds its last {name} − 1 "
            f"tokens; set {name} to an integer ≥ 2"
        )
    return window


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


def _layer_width(config, layer: int, layer_config) -> int:
    """K (= V) elements per token of one attention layer: its KV heads × head_dim (read from the layer's own config
    where layers differ)."""
    try:
        return n_kv_heads(layer_config) * head_dim(layer_config)
    except (AttributeError, TypeError, ValueError) as error:
        raise KvbenchError(
            f"layer {layer} of {type(config).__name__}: its KV width cannot be read from the config "
            f"({str(error).splitlines()[0]}); set num_key_value_heads and head_dim"
        ) from None


def _latent_layout(config, dtype: torch.dtype, heads: int, layers: int) -> CacheLayout:
    """Multi-head latent attention (DeepSeek-V2/V3/V3.2, Kimi Linear's attention layers beside its KDA states)."""
    latent, rope = int(config.kv_lora_rank), int(config.qk_rope_head_dim)
    qk = int(_get(config, "qk_head_dim", default=config.qk_nope_head_dim + rope))
    expanded = heads * (qk + int(config.v_head_dim))  # per-head K (qk) and V (v_head_dim) of every query head
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
    states = [(i, model_states.layer_state(config)) for i, t in enumerate(types) if t in model_states.STATE_TYPES]
    attention = [(i, t) for i, t in enumerate(types) if t not in model_states.STATE_TYPES]  # Kimi Linear: KDA
    decoders = tuple(i for i, _ in attention) if states else None
    if not caches_latent(config):  # this transformers caches the expanded heads: that is the model's cache
        kinds = tuple(LayerKind("global", heads * qk, heads * int(config.v_head_dim)) for _ in attention)
        return CacheLayout(kinds, dtype, heads, expanded, tuple(states), decoders, layers)
    index = int(getattr(config, "index_head_dim", 0) or 0)  # DeepSeek-V3.2: one indexer key per token
    kinds = tuple(
        LayerKind("latent", latent, rope, None, index if t in INDEXED_TYPES else 0) for _, t in attention
    )  # one latent + RoPE key (+ the indexer key)
    return CacheLayout(kinds, dtype, heads, expanded, tuple(states), decoders, layers)


def cache_layout(config, dtype: torch.dtype) -> CacheLayout:
    """The layout of `config` (a transformers config; multimodal configs give their text config)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    layers = n_layers(config)
    if layers > MAX_LAYERS:
        raise KvbenchError(
            f"{type(config).__name__}: num_hidden_layers={layers} is beyond {MAX_LAYERS} (the largest published "
            "models have about 130); fix num_hidden_layers"
        )
    heads = n_q_heads(config)
    if getattr(config, "kv_lora_rank", None):  # multi-head latent attention
        return _latent_layout(config, dtype, heads, layers)
    per_layer = layer_configs(config)
    kinds_list: list[LayerKind] = []
    states: list[tuple[int, LayerState]] = []
    decoders: list[int] = []  # the decoder layer of each entry of kinds_list
    types = layer_types(config)
    for i, layer_type in enumerate(types):
        if layer_type in model_states.STATE_TYPES or layer_type in model_states.HYBRID_TYPES:
            states.append((i, model_states.layer_state(config)))
        layer_type = model_states.HYBRID_TYPES.get(layer_type, layer_type)  # a hybrid layer's attention part
        if layer_type in model_states.STATE_TYPES or layer_type in model_states.NO_CACHE_TYPES:
            continue  # no K/V: out of the methods' view
        decoders.append(i)
        if layer_type == "shared":
            kinds_list.append(LayerKind("shared", 0, 0))
            continue
        layer_config = per_layer[i] if i < len(per_layer) else config
        if layer_type in SLIDING_TYPES:
            width = _layer_width(config, i, layer_config)
            kinds_list.append(LayerKind("sliding", width, width, window_of(layer_config, layer_type)))
        elif layer_type in GLOBAL_TYPES:
            width = _layer_width(config, i, layer_config)
            kinds_list.append(LayerKind("global", width, width))
        else:
            raise KvbenchError(
                f"layer {i} has layer type {layer_type!r}, which kvbench does not know; supported: "
                f"{', '.join(GLOBAL_TYPES + SLIDING_TYPES + LINEAR_TYPES)}"
            )
    if not kinds_list:
        raise KvbenchError(
            f"{type(config).__name__} has no attention layer (layer_types {sorted(set(types))}): its cache is a "
            "constant-size state with nothing for a KV method to compress; give a model with attention layers"
        )
    mha = 2 * heads * max((head_dim(c) for c in per_layer), default=0) if per_layer is not None else 0
    hybrid = len(decoders) != len(types)
    return CacheLayout(
        tuple(kinds_list), dtype, heads, mha, tuple(states), tuple(decoders) if hybrid else None, len(types)
    )
