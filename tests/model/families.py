"""Tiny random-weight models of every architecture family kvbench is tested on, built from transformers' own
config classes (no download): hidden 64, 4 layers (Gemma 3: 6, its 5:1 pattern), vocabulary 1,000.

A sliding window of 64 is shorter than the tests' prompts, so windows bite. `FAMILIES` maps a name to a function
returning the config; `build(name)` returns the model in eval mode, seeded.
"""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 1000
WINDOW = 64
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=2048,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(num_experts_per_tok=2)
PATTERN = ["linear_attention", "full_attention"] * 2  # a hybrid's layers: state, attention, state, attention
GDN = dict(  # Gated DeltaNet layers (Qwen3.5, Qwen3-Next): 2 key heads, 4 value heads of 16
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    layer_types=PATTERN,
)
SHARED = {**BASE, "num_hidden_layers": 6, "num_key_value_heads": 2}  # Gemma 3n / 4: 6 layers, the last 2 reuse K/V
# multi-head latent attention with DeepSeek's MoE (DeepSeek-V3; V3.2 adds its indexer: test_layout_kinds.py)
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    **MOE,
)
QWEN_MOE = dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **MOE)

FAMILIES = {
    "llama-mha": lambda: tf.LlamaConfig(**BASE, num_key_value_heads=4),
    "llama-gqa": lambda: tf.LlamaConfig(**BASE, num_key_value_heads=2),
    "llama-mqa": lambda: tf.LlamaConfig(**BASE, num_key_value_heads=1),
    "qwen2": lambda: tf.Qwen2Config(**BASE, num_key_value_heads=2),
    "qwen3": lambda: tf.Qwen3Config(**BASE, num_key_value_heads=2, head_dim=32),  # QK-norm per head
    "mistral": lambda: tf.MistralConfig(**BASE, num_key_value_heads=2, sliding_window=WINDOW),  # every layer slides
    "gemma2": lambda: tf.Gemma2Config(  # soft cap, alternating window (layer 0 slides)
        **BASE, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=32
    ),
    "gemma3": lambda: tf.Gemma3TextConfig(  # 5:1 sliding/global, one KV head, head_dim 256, a RoPE per layer type
        **{**BASE, "num_hidden_layers": 6},
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=WINDOW,
        query_pre_attn_scalar=256,
    ),
    "phi3": lambda: tf.Phi3Config(**BASE, num_key_value_heads=2),  # fused qkv_proj
    "olmo2": lambda: tf.Olmo2Config(**BASE, num_key_value_heads=2),  # q/k norms over the full width
    "gpt-neox": lambda: tf.GPTNeoXConfig(**BASE),  # partial rotary (0.25), fused query_key_value
    "falcon": lambda: tf.FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        multi_query=True,
        new_decoder_architecture=False,
        max_position_embeddings=2048,
    ),
    "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=2048),  # absolute
    "mixtral": lambda: tf.MixtralConfig(**BASE, num_key_value_heads=2, num_local_experts=4, **MOE),
    "qwen3-moe": lambda: tf.Qwen3MoeConfig(
        **BASE, num_key_value_heads=2, head_dim=32, num_experts=4, moe_intermediate_size=32, **MOE
    ),
    "gpt-oss": lambda: tf.GptOssConfig(  # attention sinks, alternating window
        **BASE, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, num_local_experts=4, **MOE
    ),
    "deepseek-v3": lambda: tf.DeepseekV3Config(**BASE, **MLA),  # multi-head latent attention
    # hybrids: linear-attention / Mamba / conv layers beside attention (kvbench.model.states); 2 of 4 layers attention
    "qwen3_5": lambda: tf.Qwen3_5TextConfig(**BASE, num_key_value_heads=2, head_dim=16, **GDN),  # Gated DeltaNet
    "qwen3_5-moe": lambda: tf.Qwen3_5MoeTextConfig(**BASE, num_key_value_heads=2, head_dim=16, **GDN, **QWEN_MOE),
    "qwen3_next": lambda: tf.Qwen3NextConfig(**BASE, num_key_value_heads=2, head_dim=16, **GDN, **QWEN_MOE),
    "olmo_hybrid": lambda: tf.OlmoHybridConfig(**BASE, num_key_value_heads=2, layer_types=PATTERN),
    "nemotron_h": lambda: tf.NemotronHConfig(  # Mamba-2, an MoE and an MLP block (no cache), no RoPE
        **BASE,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["mamba", "moe", "attention", "mlp"],
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
        n_routed_experts=4,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        num_experts_per_tok=2,
    ),
    "granitemoehybrid": lambda: tf.GraniteMoeHybridConfig(  # Granite 4.0-H: Mamba-2
        **BASE,
        num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
    ),
    "bamba": lambda: tf.BambaConfig(
        **BASE, num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16
    ),  # Mamba-2, partial rotary
    "jamba": lambda: tf.JambaConfig(  # Mamba (1), no RoPE, MoE every other layer
        **BASE,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=2,
        expert_layer_period=2,
        expert_layer_offset=1,
    ),
    "lfm2": lambda: tf.Lfm2Config(  # short convolutions
        **BASE, num_key_value_heads=2, layer_types=["conv", "full_attention"] * 2
    ),
    "falcon_h1": lambda: tf.FalconH1Config(  # every layer runs attention and Mamba-2 in parallel: one cache layer
        **BASE, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_d_ssm=128
    ),
    "zamba2": lambda: tf.Zamba2Config(  # Mamba-2 layers and "hybrid" layers calling one shared attention block
        **BASE, num_key_value_heads=2, layers_block_type=["mamba", "hybrid"] * 2, n_mamba_heads=8
    ),
    "kimi_linear": lambda: tf.KimiLinearConfig(  # Kimi Delta Attention beside latent attention (MLA)
        **{**BASE, "num_key_value_heads": 4},
        layer_types=PATTERN,
        linear_num_heads=4,
        linear_head_dim=16,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_local_experts=4,
        moe_intermediate_size=32,
        **MOE,
    ),
}
# not run: MiniMax, whose model keeps a cache of its own (refused in one line, kvbench.preflight.support)
HYBRIDS = (
    "qwen3_5",
    "qwen3_5-moe",
    "qwen3_next",
    "olmo_hybrid",
    "nemotron_h",
    "granitemoehybrid",
    "bamba",
    "jamba",
    "lfm2",
    "falcon_h1",
    "zamba2",
    "kimi_linear",
)

# layers reusing an earlier layer's K/V (transformers' kv_sharing_modes "reuse": they cache nothing): the full cache
# runs exactly, compression is refused (kvbench.preflight.support); tests/model/test_layout_kinds.py
SHARED_KV = {
    "gemma3n": lambda: tf.Gemma3nTextConfig(  # the last 2 of 6 layers reuse earlier layers' K/V
        **{k: v for k, v in SHARED.items() if k != "intermediate_size"},
        intermediate_size=[128] * 6,
        head_dim=16,
        sliding_window=WINDOW,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=1000,
        laurel_rank=8,
        altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    ),
    "gemma4": lambda: (
        tf.AutoConfig.for_model(  # alternating sliding/global, global head_dim 32, last 2 layers reuse K/V
            "gemma4_text",
            **{k: v for k, v in SHARED.items() if k not in ("pad_token_id", "bos_token_id")},
            head_dim=16,
            global_head_dim=32,
            sliding_window=WINDOW,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=1000,
            layer_types=["sliding_attention", "full_attention"] * 3,
        )
    ),
}


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    factory = {**FAMILIES, **SHARED_KV}[name]
    if name in HYBRIDS and not hasattr(tf.cache_utils, "LinearAttentionLayer"):
        import pytest

        pytest.skip(f"transformers {tf.__version__} keeps no hybrid's states in DynamicCache (5.24+ does)")
    try:
        config = factory()
    except (AttributeError, ValueError, KeyError) as error:  # a family newer than this transformers (5.2, kvpress's)
        import pytest

        pytest.skip(f"transformers {tf.__version__} does not build {name}: {error}")
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
