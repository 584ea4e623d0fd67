"""Head merging: convert the model to fewer KV heads by mean-pooling each group's K and V projections — the GQA
paper's checkpoint conversion (Ainslie et al. 2023, https://arxiv.org/abs/2305.13245), without its uptraining.

KV cache size ∝ KV heads, so `kv_heads=N` shrinks every layer's cache by N / H_kv (`kv_heads=1` is MQA). It
compresses the head dimension and composes with token eviction (sequence) and quantization (precision). It
changes the prefill itself, so it opts out of shared-prefill sweeps. RoPE commutes with the pooling (both
linear), so pooling the projections equals pooling the rotated keys.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from kvbench import KvbenchError
from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, Capabilities, Method
from kvbench.methods.modes import ChangesModel


def merge_kv_heads(model, kv_heads: int):
    """A copy of `model` with each layer's K/V projections mean-pooled from H_kv to `kv_heads` heads."""
    config = model.config
    n_kv, n_q = config.num_key_value_heads, config.num_attention_heads
    if kv_heads < 1 or n_kv % kv_heads:
        valid = [n for n in range(1, n_kv + 1) if n_kv % n == 0]
        raise KvbenchError(
            f"headmerge kv_heads={kv_heads} must divide the model's {n_kv} KV heads; "
            f"valid values: {', '.join(map(str, valid))} (1 = MQA)"
        )
    merged = copy.deepcopy(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_q
    for layer in merged.model.layers:
        attn = layer.self_attn
        for proj in (attn.k_proj, attn.v_proj):
            weight = proj.weight.data.view(kv_heads, n_kv // kv_heads, head_dim, -1)  # (N, group, D, hidden)
            proj.weight = torch.nn.Parameter(weight.mean(1).reshape(kv_heads * head_dim, -1), requires_grad=False)
            if proj.bias is not None:
                bias = proj.bias.data.view(kv_heads, n_kv // kv_heads, head_dim).mean(1).reshape(-1)  # (N·D,)
                proj.bias = torch.nn.Parameter(bias, requires_grad=False)
            proj.out_features = kv_heads * head_dim
        attn.num_key_value_groups = n_q // kv_heads
    merged.config.num_key_value_heads = kv_heads
    return merged


@METHODS.register("headmerge")
@dataclass
class HeadMerge(ChangesModel, Method):
    kv_heads: int = knob(1, min=1)  # target KV heads; must divide the model's

    caps = Capabilities(
        family="structure", has_budget=False, shares_prefill=False, needs=frozenset({"qkv_projections"})
    )

    @classmethod
    def lossless_params(cls, lm) -> dict:
        return {"kv_heads": lm.n_kv_heads}

    def prepare_model(self, model):
        if self.kv_heads == model.config.num_key_value_heads:
            return model  # nothing to merge: exactly the original
        return merge_kv_heads(model, self.kv_heads)
