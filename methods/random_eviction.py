"""Random eviction: each KV head keeps a uniformly random subset of the budget — the floor every method must beat
(kvpress's RandomPress)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.base import METHODS, Method


@METHODS.register("random")
@dataclass
class RandomEviction(Method):
    seed: int = 0

    def keep_indices(self, layer_idx, keys, values, stats, n_keep):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + layer_idx)  # reproducible per layer
        scores = torch.rand(keys.shape[:3], generator=generator)  # (B, H_kv, T)
        return scores.topk(n_keep, dim=-1).indices.sort(dim=-1).values.to(keys.device)  # (B, H_kv, n_keep)
