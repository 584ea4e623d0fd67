"""The constant-size state a hybrid model's linear-attention, Mamba and convolution layers keep per request.

transformers keeps it in the same `DynamicCache(config=...)` as the attention K/V: a `LinearAttentionLayer` per such
layer (a `LinearAttentionAndFullAttentionLayer` where one layer runs both, Falcon-H1 and Zamba2's "hybrid" layers),
holding a convolution state (B, C, K) in the model's dtype and a recurrent state in fp32 (transformers' reference
kernels and its Mamba `mamba_ssm_cache_dtype` both keep it in fp32, whatever the model's dtype). Neither grows with
the context, so a KV method cannot shrink it; it is what the whole cache holds beside the attention layers.

Per mixer (C = conv channels, K = conv kernel; the recurrent state's elements):
- Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid): C = 2·H_k·D_k + H_v·D_v, recurrent H_v·D_k·D_v;
- Mamba-2 (Nemotron-H, Granite 4.0-H, Bamba, Falcon-H1, Zamba2): C = H·P + 2·G·N, recurrent H·P·N
  (H heads of P channels, G groups, N state size);
- Mamba (Jamba): C = E·d (the expanded width), recurrent E·d·N;
- Kimi Delta Attention (Kimi Linear): C = 3·H·D (q, k and v convolved), recurrent H·D·D;
- short convolution (LFM2, LFM3): C = d (the hidden size), no recurrent state.
tests/model/test_hybrids.py checks each against the bytes transformers' own cache holds after a forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench import KvbenchError

RECURRENT_DTYPE = torch.float32  # transformers keeps every family's recurrent state in fp32
STATE_TYPES = ("linear_attention", "conv", "mamba")  # a layer of state alone
HYBRID_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}  # state + attention in one layer
NO_CACHE_TYPES = ("moe", "mlp")  # Nemotron-H's MLP/MoE blocks: nothing cached

# Mamba-2 families: attribute names of (heads, head channels, groups, state size, conv kernel)
MAMBA2 = {
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel"),
    "granitemoehybrid": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"),
    "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"),
    "falcon_h1": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"),
    "zamba2": ("n_mamba_heads", "mamba_headdim", "mamba_ngroups", "mamba_d_state", "mamba_d_conv"),
}
GATED_DELTANET = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid")
MAMBA1 = ("jamba",)
KDA = ("kimi_linear",)
SHORT_CONV = ("lfm2", "lfm2_moe", "lfm3")


@dataclass(frozen=True)
class LayerState:
    """What one layer keeps per request beside (or instead of) K/V: `conv` elements in the model's dtype and
    `recurrent` elements in fp32."""

    conv: int
    recurrent: int

    def nbytes(self, dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        return self.conv * element + self.recurrent * torch.tensor([], dtype=RECURRENT_DTYPE).element_size()


def _ints(config, names) -> list[int]:
    values = [getattr(config, name, None) for name in names]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        given = ", ".join(f"{n}={v}" for n, v in zip(names, values))
        raise KvbenchError(
            f"{type(config).__name__}: its state size cannot be read from the config ({given}); set each to a "
            "positive integer"
        )
    return [int(v) for v in values if v is not None]


def layer_state(config) -> LayerState:
    """The state one linear/Mamba/convolution layer of a model with `config` keeps per request."""
    kind = getattr(config, "model_type", "")
    if kind in MAMBA2:
        heads, channels, groups, state, kernel = _ints(config, MAMBA2[kind])
        return LayerState((heads * channels + 2 * groups * state) * kernel, heads * channels * state)
    if kind in GATED_DELTANET:
        names = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim")
        h_k, d_k, h_v, d_v, kernel = _ints(config, names + ("linear_conv_kernel_dim",))
        return LayerState((2 * h_k * d_k + h_v * d_v) * kernel, h_v * d_k * d_v)
    if kind in KDA:  # Kimi Delta Attention: q, k and v each through a short conv, one H·D·D state
        heads, width, kernel = _ints(config, ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"))
        return LayerState(3 * heads * width * kernel, heads * width * width)
    if kind in MAMBA1:
        expand, hidden, state, kernel = _ints(config, ("mamba_expand", "hidden_size", "mamba_d_state", "mamba_d_conv"))
        return LayerState(expand * hidden * kernel, expand * hidden * state)
    if kind in SHORT_CONV:
        hidden, kernel = _ints(config, ("hidden_size", "conv_L_cache"))
        return LayerState(hidden * kernel, 0)
    known = sorted(set(MAMBA2) | set(GATED_DELTANET) | set(MAMBA1) | set(KDA) | set(SHORT_CONV))
    raise KvbenchError(
        f"{type(config).__name__} has linear-attention or state-space layers whose state kvbench does not know how "
        f"to size; supported hybrids: {', '.join(known)}"
    )
