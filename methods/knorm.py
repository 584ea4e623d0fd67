"""Knorm — keep the keys with the lowest L2 norm (Devoto et al. 2024, https://arxiv.org/abs/2406.11430;
kvpress's KnormPress).

The paper observes that low-norm keys draw high attention, so a key's score is −‖k‖₂ and each KV head keeps its
lowest-norm positions. No attention statistics are needed. RoPE is a rotation, so post-RoPE cached keys have the
norms of the pre-RoPE ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.methods.base import METHODS, Method


@METHODS.register("knorm")
@dataclass
class Knorm(Method):
    def scores(self, layer_idx, keys, values, stats):
        return -keys.float().norm(dim=-1)  # (B, H_kv, T)
