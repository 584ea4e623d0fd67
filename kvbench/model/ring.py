"""StreamingLLM's window as a ring buffer: a bounded cache layer whose decode step copies one token, not the layer.

Per-step eviction on a plain layer (methods/decode_eviction.py) copies the whole layer twice per step: the append
(DynamicLayer.update concatenates into a new tensor) and the eviction (a gather of the kept positions). With
absolute positions each key carries the RoPE of its own position, and a decode step's single query attends to
every held key with no mask, so the attention does not depend on the keys' order: the layer can allocate its slots
once and write each new token, in place, over the token StreamingLLM drops next.

Layout (B, H_kv, size + 1, D): slots [0, sinks) hold the attention sinks, the others the recent window in rotation.
Per-step eviction attends over size + 1 tokens (the held size plus the new token), then drops the oldest non-sink
one. The ring attends over all its size + 1 slots; the slot it writes next holds exactly that dropped token (dead:
held until the next step overwrites it). So every step attends to per-step eviction's tokens, only in another order
(the sums inside the attention add up in another order: equal up to rounding). The layer physically holds size + 1
tokens throughout — one more than per-step eviction keeps between steps, which allocates size + 1 during each step.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from kvbench import KvbenchError


class RingLayer(DynamicLayer):
    """One decoder layer's sinks + recent window in size + 1 preallocated slots; `update` writes one slot in place
    and returns the whole buffer (`keys`/`values`: what attention sees, no copy)."""

    is_croppable = False
    keys: torch.Tensor  # (B, H_kv, size + 1, D), set at construction (DynamicLayer declares them Optional)
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, n_sinks: int, positions: list[int]):
        """keys/values (B, H_kv, size, D): the held tokens, sorted by position (sinks first); positions: theirs."""
        super().__init__()
        self.lazy_initialization(keys, values)
        batch, heads, size, head_dim = keys.shape
        self.keys = keys.new_empty(batch, heads, size + 1, head_dim)  # (B, H_kv, size + 1, D)
        self.values = values.new_empty(batch, heads, size + 1, values.shape[-1])  # (B, H_kv, size + 1, D_v)
        self.keys[:, :, :size] = keys  # the one copy: into the preallocated slots
        self.values[:, :, :size] = values
        self.n_sinks = n_sinks
        self.positions = [*positions, -1]  # per slot, the token's absolute position (-1: not yet written)
        self._next = size  # the slot the next token goes to: the free last one, then always the oldest non-sink
        self._next_position = positions[-1] + 1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states/value_states (B, H_kv, 1, D): written over the oldest non-sink slot; returns the buffers."""
        if key_states.shape[2] != 1:
            raise KvbenchError(
                f"a StreamingLLM ring layer takes one token per forward (a decode step), got {key_states.shape[2]}; "
                "ring=true decodes through Engine.decode only"
            )
        slot = self._next
        self.keys[:, :, slot : slot + 1] = key_states  # (B, H_kv, 1, D), in place
        self.values[:, :, slot : slot + 1] = value_states
        self.positions[slot] = self._next_position
        self._next_position += 1
        # the slot after it holds the oldest non-sink token: per-step eviction drops it after this step's attention
        self._next = slot + 1 if slot + 1 < len(self.positions) else self.n_sinks
        return self.keys, self.values  # (B, H_kv, size + 1, D) each

    def get_seq_length(self) -> int:
        """Tokens held: every slot but the one written next (dead or free). The mask size is this + the query."""
        return self.keys.shape[2] - 1

    def held_positions(self) -> list[int]:
        """Absolute positions of the held tokens, ascending (what per-step eviction's layer holds, in order)."""
        return sorted(p for slot, p in enumerate(self.positions) if slot != self._next)

    def crop(self, tokens_to_remove: int) -> None:
        raise KvbenchError("a StreamingLLM ring layer cannot be cropped (its slots are not in position order)")
