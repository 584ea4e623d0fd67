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

from collections.abc import Callable

import torch
import transformers
from packaging.version import Version
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

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
# and Mistral (tests/engine/test_grid_decode.py); 5.2 (kvpress's venv) differs on Gemma 2 by 0.018 in a logit.
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
    elif type(layer) is DynamicLayer:
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


def cache_nbytes(cache) -> int:
    """Bytes physically held by the cache: each distinct storage counted once, in full.

    Counting storages (not views) is deliberate: a slice that keeps the whole uncompressed buffer alive holds
    all of it, so masking or slicing without copying shows no saving here.
    """
    storages: dict[int, int] = {}
    seen: set[int] = set()
    for layer in cache.layers:
        # a sliding layer's window size is a scalar tensor too: not cache content
        held = {name: value for name, value in vars(layer).items() if name != "_sliding_window_tensor"}
        for tensor in _tensors(held, seen):
            if tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def full_cache_nbytes(n_layers: int, n_kv_heads: int, head_dim: int, tokens: int, dtype: torch.dtype) -> int:
    """Uncompressed cache size: 2 (K and V) × layers × kv_heads × head_dim × tokens × bytes per element."""
    return 2 * n_layers * n_kv_heads * head_dim * tokens * torch.tensor([], dtype=dtype).element_size()
