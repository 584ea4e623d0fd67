"""Decode-time eviction without two copies of the cache per step (Engine.decode, one configuration alone).

A plain layer evicting one token per step (H2O, StreamingLLM, TOVA as the papers run them) pays twice per step: the
gather of the kept tokens into a new tensor, then the next step's append, a concatenation into another. Here each
layer's tokens live in the first n slots of a buffer with room for the step's tokens: an append writes the next
slot, an eviction compacts the kept tokens in place (kernels/compact.py, one memmove per run in the CPU backend) —
the same tokens in the same order, so decoding is bit for bit what the gather gives (the C decode kernels read
values, not layout; tested). At the end the layers become plain exact-size tensors again, so `kv_bytes` (storage
bytes) is unchanged.

Used on the CPU with the C decode kernels, for methods that act on each decode step, on plain batch-1 layers; not
for StreamingLLM's ring (it turns plain layers into ring layers itself).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvbench.kernels.backend import backend
from kvbench.kernels.compact import compact_kv
from kvbench.methods.compression import Compression
from kvbench.model.cache import kv_layer


class SlotLayer(DynamicLayer):
    """keys/values (1, H_kv, n, D): views of the first n slots of a (1, H_kv, capacity, D) buffer."""

    keys: torch.Tensor  # never None once built
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, spare: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.spare, n = spare, keys.shape[2]
        self._keys, self._values = self._buffers(keys, values, n + spare)
        self._hold(n)

    @staticmethod
    def _buffers(keys: torch.Tensor, values: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = keys.shape[2]
        out = []
        for tensor in (keys, values):
            buffer = tensor.new_empty(*tensor.shape[:2], capacity, tensor.shape[3])  # (1, H_kv, capacity, D)
            buffer[:, :, :n] = tensor
            out.append(buffer)
        return out[0], out[1]

    def _hold(self, n: int) -> None:
        self.keys, self.values = self._keys[:, :, :n], self._values[:, :, :n]  # (1, H_kv, n, D)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append (1, H_kv, new, D) after the held tokens (a new buffer only when there is no room)."""
        n, new = self.keys.shape[2], key_states.shape[2]
        if n + new > self._keys.shape[2]:
            self._keys, self._values = self._buffers(self.keys, self.values, n + new + self.spare)
        self._keys[:, :, n : n + new], self._values[:, :, n : n + new] = key_states, value_states
        self._hold(n + new)
        return self.keys, self.values

    def select(self, index: torch.Tensor) -> None:
        """Keep positions `index` (1, H_kv, N), sorted: compacted into slots [0, N) (cache.layer_select calls it)."""
        compact_kv(self.keys, self.values, index)
        self._hold(index.shape[-1])


def use_slots(cache, hooks: Compression, model) -> bool:
    """Turn the cache's plain batch-1 layers into SlotLayers when its compression (`hooks`) acts on every decode
    step (returns whether it did). Only with the C decode kernels installed, where the layout cannot change a
    result."""
    layers = list(getattr(cache, "layers", []))
    if not hooks.acts_while_decoding or hooks.method.caps.decodes_alone:  # no decode step acts, or on its own layers
        return False
    if not (layers and decode_kernels(model)):
        return False
    if not all(type(layer) is DynamicLayer and layer.keys is not None and layer.keys.shape[0] == 1 for layer in layers):
        return False
    spare = hooks.slack() + 2  # the step's token, and a block's slack (evict_every − 1) + 1
    cache.layers[:] = [SlotLayer(layer.keys, layer.values, spare) for layer in layers]
    return True


def decode_kernels(model) -> bool:
    """Whether the model's decode steps run the CPU backend's row-independent kernels (kvbench/kernels/cpu)."""
    cpu = backend("cpu")
    return cpu is not None and cpu.rows_independent(model)


def plain_layers(cache: DynamicCache) -> None:
    """SlotLayers back to plain exact-size layers (what the cache holds is then what it measures)."""
    cache.layers[:] = [
        kv_layer(layer.keys.clone(), layer.values.clone()) if isinstance(layer, SlotLayer) else layer
        for layer in cache.layers
    ]
