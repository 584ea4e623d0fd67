"""KV-cache helpers over the transformers v5 `Cache` API.

Layout: one cache layer per decoder layer; each holds keys and values of shape (B, H_kv, T_layer, D), post-RoPE,
at KV-head granularity (never repeat_kv-expanded). T_layer may differ between layers (PyramidKV). Eviction
methods gather kept positions into new, physically smaller tensors, sorted by original position, so the most
recent tokens are always last. Bytes are measured from the storages the cache actually holds.

A sliding-window layer (kvbench.model.layout) is a `WindowLayer`: the last W − 1 token positions, as transformers'
own DynamicSlidingWindowLayer holds them, whatever the method; its mask is by position (the layer's cumulative
length), so it sees exactly the positions inside its window. Methods compress the layers that grow with the context.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import transformers
from packaging.version import Version
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from transformers import DynamicCache, cache_utils
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

# transformers' state layers (5.24+; 5.2, kvpress's pin, has none: nothing is an instance of an empty tuple)
LinearAttentionCacheLayerMixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())
# layers whose K/V are plain tensors an eviction gathers: transformers' own, and a hybrid layer's (Falcon-H1, Zamba2:
# its state rides along untouched)
_BOTH = getattr(cache_utils, "LinearAttentionAndFullAttentionLayer", None)
PLAIN_KV_LAYERS: tuple[type, ...] = (DynamicLayer,) if _BOTH is None else (DynamicLayer, _BOTH)

KV = tuple[torch.Tensor, torch.Tensor]  # (keys, values), each (B, H_kv, T, D)

# called as observer(layer, index) before each decode-time eviction: diagnostics (kvbench.guide.diagnose) follow which
# original positions a layer still holds without the cache storing anything extra
SELECT_OBSERVERS: list = []


def kv_layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    """A cache layer holding keys/values (B, H_kv, T, D) as they are (no copy)."""
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


def cache_from_kv(layers: list[KV]) -> DynamicCache:
    """A DynamicCache holding these tensors as they are (no copy); updates concatenate into new tensors."""
    cache = DynamicCache()
    cache.layers.extend(kv_layer(keys, values) for keys, values in layers)
    return cache


class WindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window layer holding exactly its last W − 1 tokens in tensors of their own (its parent
    keeps a view of each step's concatenation, whose storage is one token, or after the prompt the whole prompt,
    larger): what `nbytes` of transformers' own layer counts."""

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)  # (B, H_kv, W − 1 + n, D) each
        self.keys, self.values = self.keys.clone(), self.values.clone()  # (B, H_kv, ≤ W − 1, D): own storage
        return keys, values


class MappedLayer(DynamicLayer):
    """A cache layer that stores its own tensors (codes, scales, residuals): transformers' batch operations (beam
    reorder, row selection, repetition) as one `_map(fn)` over every tensor it holds, which each such layer defines."""

    _map: Callable[[Callable[[torch.Tensor], torch.Tensor]], None]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))


def window_layer(keys: torch.Tensor, values: torch.Tensor, window: int) -> WindowLayer:
    """A sliding layer after a prompt whose keys/values (B, H_kv, T, D) are given: the last min(T, W − 1)."""
    layer = WindowLayer(sliding_window=window)
    layer.lazy_initialization(keys, values)
    layer.keys = keys[:, :, -(window - 1) :].clone()  # (B, H_kv, min(T, W − 1), D)
    layer.values = values[:, :, -(window - 1) :].clone()
    layer.cumulative_length = keys.shape[-2]  # the mask's positions: the window ends at the prompt's last token
    return layer


def keep_windows(cache, prompt_kv: list[KV], layout) -> None:
    """Sliding layers of `cache` back to their window over the prompt (a method compresses the others)."""
    for i, kind in enumerate(layout.layers):
        if kind.kind == "sliding":
            cache.layers[i] = window_layer(*prompt_kv[i], kind.window)


def cache_kv(cache: DynamicCache) -> list[KV]:
    """The (keys, values) of every layer."""
    return [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[misc,union-attr]  # attention layers


def layer_lengths(cache: DynamicCache) -> list[int]:
    """Tokens each layer holds (a sliding layer's get_seq_length counts every token it has seen)."""
    return [
        layer.keys.shape[-2] if isinstance(layer, DynamicSlidingWindowLayer) else layer.get_seq_length()  # type: ignore[union-attr]
        for layer in cache.layers
    ]


# The transformers versions where each window layer masks from its own offset, checked token by token on Gemma 2 and 3
# and Mistral (tests/native/test_grid_decode.py); 5.2 (kvpress's venv) differs on Gemma 2 by 0.018 in a logit.
WINDOW_MASK_APART = Version(transformers.__version__).release >= (5, 25)


def one_mask(cache: DynamicCache) -> bool:
    """Whether several tokens can be fed in one forward: transformers builds one full-attention mask from the first
    full layer's length and one sliding mask from the first window layer's (each window layer tracks its own offset),
    so every layer but the window layers must hold the same number of tokens; otherwise token by token."""
    apart = WINDOW_MASK_APART  # before it, Gemma 2's window layers mask a multi-token step from another offset
    lengths = {
        n
        for n, layer in zip(layer_lengths(cache), cache.layers)
        if not (apart and isinstance(layer, DynamicSlidingWindowLayer))
    }
    return len(lengths) <= 1


def gather_kv(keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> KV:
    """Keep `index` (B, H_kv, N) positions of keys/values (B, H_kv, T, D): new, smaller tensors."""
    from kvbench.kernels.compact import gather_tokens

    return gather_tokens(keys, index), gather_tokens(values, index)  # (B, H_kv, N, D) each: the gather's bytes


def held_kv(layer) -> KV:
    """The keys and values (B, H_kv, T, D) a layer holds: a layer over shared blocks (the prefix cache's PagedLayer,
    whose `keys` are only its private tail) joins them through its `kv()`."""
    joined = getattr(layer, "kv", None)
    return joined() if joined is not None else (layer.keys, layer.values)


def layer_select(layer, index: torch.Tensor) -> None:
    """Keep only positions `index` (B, H_kv, N) of one cache layer, physically (decode-time eviction).

    Layers with storage of their own (quantized caches) implement `select(index)`; plain layers gather K/V.
    """
    if isinstance(layer, DynamicSlidingWindowLayer):
        return  # a sliding layer keeps its window (the model drops what leaves it): eviction leaves it alone
    for observer in SELECT_OBSERVERS:
        observer(layer, index)
    if hasattr(layer, "select"):
        layer.select(index)
    elif type(layer) in PLAIN_KV_LAYERS:
        layer.keys, layer.values = gather_kv(layer.keys, layer.values, index)  # type: ignore[arg-type]  # filled
    else:
        from kvbench import KvbenchError

        raise KvbenchError(f"{type(layer).__name__} cache layers cannot drop tokens while decoding")


def _tensors(obj, seen: set[int]):
    """Every tensor reachable from a cache layer's attributes (payloads, scales, zero points, residuals)."""
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if is_traceable_wrapper_subclass(obj):  # e.g. quanto's QTensor: count its inner data/scale/shift
            for name in obj.__tensor_flatten__()[0]:
                yield from _tensors(getattr(obj, name), seen)
        else:
            yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, seen)


BOOKKEEPING = ("_sliding_window_tensor", "cumulative_length_linear")  # scalar tensors a layer counts with, not content


def cache_nbytes(cache) -> int:
    """Bytes physically held by the cache: each distinct storage counted once, in full; a hybrid's states too.

    Counting storages (not views) is deliberate: a slice that keeps the whole uncompressed buffer alive holds
    all of it, so masking or slicing without copying shows no saving here.
    """
    storages: dict[int, int] = {}
    seen: set[int] = set()
    for layer in list(cache.layers) + list(getattr(cache, STATES, {}).values()):
        held = {name: value for name, value in vars(layer).items() if name not in BOOKKEEPING}
        for tensor in _tensors(held, seen):
            if tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def full_cache_nbytes(n_layers: int, n_kv_heads: int, head_dim: int, tokens: int, dtype: torch.dtype) -> int:
    """Uncompressed cache size: 2 (K and V) × layers × kv_heads × head_dim × tokens × bytes per element."""
    return 2 * n_layers * n_kv_heads * head_dim * tokens * torch.tensor([], dtype=dtype).element_size()


# ---- hybrid models: the attention layers' view and the states beside it ------------------------------------------
# kvbench's caches of a hybrid model (kvbench.model.layout: linear-attention, Mamba, convolution layers) hold the
# attention layers only, in `layers`, indexed as the layout's `layers` — what every method sees — and carry the other
# decoder layers (their state, or nothing) by decoder index in the attribute STATES. `model_cache` lays the two out
# as transformers' own cache of that model for each forward pass.
STATES = "kvbench_states"


def new_cache(layout) -> DynamicCache:
    """An empty cache for a model with `layout`: a hybrid's view with empty states (filled by its first forward)."""
    cache = DynamicCache()
    if layout.is_hybrid:
        setattr(cache, STATES, {})
    return cache


def model_cache(cache, config) -> DynamicCache:
    """The cache the model's forward reads: `cache` itself, or for a hybrid view the decoder layers in order — the
    attention layers' objects (appends and evictions act on them) with the state layers between them. An empty view
    (before the prompt) gets transformers' own layer objects for the model, which the forward then fills."""
    states = getattr(cache, STATES, None)
    if states is None:
        return cache
    full = getattr(cache, "_kvbench_full", None)
    if full is None:
        full = DynamicCache(config=config)
        cache._kvbench_full = full
        if not cache.layers:  # the prompt's forward: transformers' own layers, then the view reads them back
            return full
    layers = list(cache.layers)
    for index in sorted(states):
        layers.insert(index, states[index])
    full.layers = layers
    return full


def split_model_cache(cache, layout) -> None:
    """After a hybrid's first forward into an empty view (`model_cache`): the view takes its attention layers and its
    states from the transformers cache the forward filled."""
    full = getattr(cache, "_kvbench_full", None)
    if full is None or cache.layers or not full.layers:
        return
    attention = layout.decoder_layers
    cache.layers = [full.layers[i] for i in attention]
    setattr(cache, STATES, {i: layer for i, layer in enumerate(full.layers) if i not in set(attention)})


def state_layers(cache, layout) -> dict:
    """Every decoder layer of a hybrid view that is not plain attention, by decoder index: its state layers (and
    DummyLayers), and the attention layers that keep a state too (Falcon-H1's "hybrid"). Empty for other models."""
    states = dict(getattr(cache, STATES, {}))
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            states[layout.decoder_layer(i)] = layer
    return states


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_clone(item) for item in value]
    return value


def copy_state(layer, kv: KV | None = None):
    """A state layer of its own (its conv and recurrent states cloned: decoding updates them in place), so a prefill's
    states serve every configuration. A layer running attention too (Falcon-H1's "hybrid") takes `kv` as its K/V."""
    new = copy.copy(layer)
    for name, value in vars(layer).items():
        if name not in ("keys", "values"):
            setattr(new, name, _clone(value))
    if kv is not None:
        new.keys, new.values = kv
    return new


def attach_states(cache, states: dict, layout) -> None:
    """Give `cache` (the attention layers a method left) states of its own copied from the prefill's `states`
    (decoder index → layer). A decoder layer running both attention and a state is one transformers object: it takes
    the method's K/V for that layer, which must be plain tensors."""
    from kvbench import KvbenchError

    own = {}
    position = {decoder: i for i, decoder in enumerate(layout.decoder_layers)}
    for index, layer in states.items():
        if index not in position:
            own[index] = copy_state(layer)
            continue
        view = cache.layers[position[index]]
        if type(view) is not DynamicLayer:
            raise KvbenchError(
                f"decoder layer {index} runs attention and a state in one layer; a method holding its K/V as "
                f"{type(view).__name__} cannot be combined with it: use an eviction method"
            )
        cache.layers[position[index]] = copy_state(layer, held_kv(view))
    setattr(cache, STATES, own)
