"""KeyDiff — keep the keys least similar to the mean key (Park et al. 2025, https://arxiv.org/abs/2504.15364;
kvpress's KeyDiffPress).

Anchor = the mean of the L2-normalised keys of a head; a key's score is −cos(k, anchor), so each KV head keeps its
most distinctive keys. No attention statistics are needed. (The paper evicts block-wise while streaming the
prompt; this is kvpress's one-shot form, as KeyDiffPress without BlockPress.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from kvbench.methods.base import METHODS, Method


@METHODS.register("keydiff")
@dataclass
class KeyDiff(Method):
    def scores(self, layer_idx, keys, values, stats):
        keys = keys.float()
        anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)  # (B, H_kv, 1, D)
        return -F.cosine_similarity(keys, anchor, dim=-1)  # (B, H_kv, T)
