"""RoPE re-indexing for StreamingLLM's rolling positions, without drift.

RoPE rotates each (x_i, x_{i+D/2}) pair by angle position·inv_freq_i, so a key rotated for position p becomes the
key for position p' by one more rotation of (p' − p): k' = k·cos(Δθ) + rotate_half(k)·sin(Δθ).

Rolling positions move every recent token down one slot at each decode step. Re-rotating the stored keys in place
rounds them to the model dtype every time, and the error accumulates (bf16: ~5 % after 100 steps, ~50 % after
1,000). `RollingLayer` instead stores each key once, as the model produced it, with the position it was rotated
at, and rotates on read to the key's current slot (the original code stores pre-RoPE keys and rotates on read):
every key the attention sees is one fp32 rotation away from the model's own key, however long it streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rerotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """keys (B, H_kv, T, D) rotated by delta (T,) positions, computed in fp32."""
    freqs = delta.float()[:, None] * inv_freq.float()[None, :]  # (T, D/2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (T, D)
    k = keys.float()
    return (k * angles.cos() + rotate_half(k) * angles.sin()).to(keys.dtype)  # (B, H_kv, T, D)


def inv_freq_of(model) -> torch.Tensor:
    """The model's RoPE inverse frequencies (transformers keeps them on the rotary embedding module)."""
    for module in model.modules():
        if hasattr(module, "inv_freq") and "Rotary" in type(module).__name__:
            return module.inv_freq
    raise ValueError(f"{type(model).__name__} has no rotary embedding with inv_freq")


@dataclass(frozen=True)
class Rope:
    """The model's RoPE inverse frequencies, held outside the layer's tensors: not KV memory (cache_nbytes)."""

    inv_freq: torch.Tensor


class RollingLayer(DynamicLayer):
    """A cache layer whose attention sees slot t's key rotated to position t (rolling positions).

    `keys` (B, H_kv, T, D) are stored as the model rotated them, at `rotated_at` (T,) int32 positions (prompt
    tokens: their absolute position; tokens decoded with rolling positions: the slot they arrived in); `update`
    returns them rotated by (slot − rotated_at) in fp32, a copy that is not kept. Eviction (`select`) gathers
    keys, values and positions — never re-rotating what is stored. Every KV head keeps the same positions.
    """

    keys: torch.Tensor  # set at construction (DynamicLayer declares them Optional until lazy initialization)
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rotated_at: torch.Tensor, inv_freq: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.rotated_at = rotated_at.to(device=keys.device, dtype=torch.int32)  # (T,): held, so counted in kv_bytes
        self.rope = Rope(inv_freq.to(keys.device))

    def rolled_keys(self) -> torch.Tensor:
        """The keys as attention sees them: slot t rotated to position t, (B, H_kv, T, D)."""
        slots = torch.arange(self.keys.shape[2], device=self.keys.device)  # (T,)
        return rerotate(self.keys, slots - self.rotated_at, self.rope.inv_freq)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append key/value_states (B, H_kv, n, D), rotated by the model at the next n slots; return rolled K/V."""
        n_old, n_new = self.keys.shape[2], key_states.shape[2]
        slots = torch.arange(n_old, n_old + n_new, device=self.keys.device, dtype=torch.int32)  # (n,)
        self.rotated_at = torch.cat([self.rotated_at, slots])
        super().update(key_states, value_states, *args, **kwargs)
        return self.rolled_keys(), self.values

    def select(self, index: torch.Tensor) -> None:
        """Keep slots `index` (B, H_kv, N), the same for every head (StreamingLLM's sinks + recent)."""
        expanded = index.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])  # (B, H_kv, N, D)
        self.keys, self.values = self.keys.gather(2, expanded), self.values.gather(2, expanded)
        self.rotated_at = self.rotated_at[index[0, 0]]  # (N,)
