"""kvbench.model.layout on every family: the full cache it predicts is what transformers' own cache holds, to the
byte, after the same prefill and decode; sliding layers at their window, latent layers at their latent width."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvbench.model.layout import cache_layout, caches_latent
from kvbench.model.load import cache_kwarg
from tests.model.families import FAMILIES, WINDOW, build

PROMPT, DECODE = 300, 5


def transformers_cache_bytes(model, tokens: int, decode: int) -> int:
    """Prefill `tokens` random ids, decode `decode` greedy steps with the model's own DynamicCache; its nbytes."""
    cache, kwarg = DynamicCache(config=model.config), cache_kwarg(model)
    ids = torch.randint(3, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model(
            input_ids=ids, position_ids=torch.arange(tokens)[None], **{kwarg: cache}, use_cache=True, logits_to_keep=1
        )
        for step in range(decode):
            token = out.logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
            position = torch.tensor([[tokens + step]])
            out = model(input_ids=token, position_ids=position, **{kwarg: cache}, use_cache=True, logits_to_keep=1)
    kv = sum(
        layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if getattr(layer, "keys", None) is not None
    )
    states = [getattr(layer, name, {}) for layer in cache.layers for name in ("conv_states", "recurrent_states")]
    return kv + sum(t.nbytes for held in states for t in held.values() if t is not None)  # a hybrid's states


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_bytes_equal_transformers_own_cache(family):
    model = build(family)
    layout = cache_layout(model.config, torch.float32)
    assert layout.full_bytes(PROMPT + DECODE) == transformers_cache_bytes(model, PROMPT, DECODE)


def test_the_figures_the_issue_names():
    # sliding layers hold W - 1 tokens; every layer of a Mistral-style model slides
    mistral = cache_layout(FAMILIES["mistral"](), torch.float32)
    assert mistral.kinds == ("sliding",) * 4
    assert mistral.full_bytes(305) == 4 * 2 * 2 * 16 * (WINDOW - 1) * 4
    assert mistral.dense_bytes(305) == 4 * 2 * 2 * 16 * 305 * 4
    gemma3 = cache_layout(FAMILIES["gemma3"](), torch.float32)
    assert gemma3.kinds == ("sliding",) * 5 + ("global",)
    assert gemma3.growing_share(4096) == pytest.approx(4096 / (4096 + 5 * (WINDOW - 1)))
    # latent attention: kv_lora_rank + qk_rope_head_dim per token and layer, not heads x head_dim
    # (transformers 5.2, kvpress's pin, caches every head's expanded K and V: that is then the model's own cache)
    config = FAMILIES["deepseek-v3"]()
    mla = cache_layout(config, torch.float32)
    if caches_latent(config):
        assert mla.kinds == ("latent",) * 4 and mla.full_bytes(305) == 4 * (32 + 8) * 305 * 4
    else:
        qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
        assert mla.kinds == ("global",) * 4
        assert mla.full_bytes(305) == 4 * config.num_attention_heads * (qk + v) * 305 * 4
    # Falcon's multi_query caches one head although config.num_kv_heads says 4
    falcon = cache_layout(FAMILIES["falcon"](), torch.float32)
    assert falcon.full_bytes(1) == 4 * 2 * 1 * 16 * 4


def test_a_hybrid_layout_is_its_attention_layers_plus_constant_states():
    import transformers as tf

    config = tf.Qwen3NextConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    layout = cache_layout(config, torch.float32)  # 3 Gated DeltaNet layers, then full attention
    assert layout.kinds == ("global",) and layout.decoder_index == (3,)
    conv, recurrent = (2 * 2 * 16 + 4 * 16) * 4, 4 * 16 * 16  # channels × kernel 4; value heads × D_k × D_v
    assert layout.state_bytes() == 3 * (conv * 4 + recurrent * 4)
    assert layout.full_bytes(100) == 2 * 2 * 32 * 100 * 4 + layout.state_bytes()
