"""Re-rotating cached keys to new RoPE positions (StreamingLLM's rolling positions).

RoPE rotates each (x_i, x_{i+D/2}) pair by angle position·inv_freq_i, so a key rotated for position p becomes the
key for position p' by one more rotation of (p' − p): k' = k·cos(Δθ) + rotate_half(k)·sin(Δθ).
"""

from __future__ import annotations

import torch


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
