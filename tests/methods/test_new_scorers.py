"""TOVA, Knorm, KeyDiff and Expected Attention against their papers' / kvpress's formulas (tiny GQA Llama, fp32)."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvbench.methods import Budget, build_method
from kvbench.model.attention import StatsRequest, recording
from tests.conftest import compressed, eager_attentions


def _kept_rows(cache_keys, prefill_keys):
    """Which prefill positions each head kept, found by matching key vectors: (B, H, N)."""
    match = (cache_keys[:, :, :, None, :] == prefill_keys[:, :, None, :, :]).all(-1)  # (B, H, N, T)
    return match.float().argmax(-1)


def _compress(engine, name, ids, n_keep, **params):
    method = build_method(name, params)
    prefill = engine.prefill(ids, method.stats_request())
    return method, prefill, method.compress(prefill.kv, prefill.stats, Budget.parse(n_keep))


def test_knorm_keeps_the_lowest_norm_keys(tiny_engine, prompt_ids):
    _, prefill, cache = _compress(tiny_engine, "knorm", prompt_ids, 100)
    for layer, (keys, values) in zip(cache.layers, prefill.kv):
        expected = (-keys.norm(dim=-1)).topk(100, dim=-1).indices.sort(-1).values  # (B, H_kv, 100)
        assert torch.equal(_kept_rows(layer.keys, keys), expected)
        assert torch.equal(layer.values, values.gather(2, expected[..., None].expand(-1, -1, -1, values.shape[-1])))
        kept_norms, all_norms = layer.keys.norm(dim=-1), keys.norm(dim=-1)
        assert kept_norms.amax() <= all_norms.sort(-1).values[..., 99:100].amax()  # nothing above the 100th lowest


def test_keydiff_keeps_keys_least_similar_to_the_mean_direction(tiny_engine, prompt_ids):
    _, prefill, cache = _compress(tiny_engine, "keydiff", prompt_ids, 100)
    for layer, (keys, _) in zip(cache.layers, prefill.kv):
        unit = keys / keys.norm(dim=-1, keepdim=True)  # (B, H, T, D)
        anchor = unit.mean(2, keepdim=True)  # (B, H, 1, D)
        cosine = (unit * anchor).sum(-1) / anchor.norm(dim=-1)  # (B, H, T)
        expected = cosine.topk(100, dim=-1, largest=False).indices.sort(-1).values
        assert torch.equal(_kept_rows(layer.keys, keys), expected)


def _eager_last_row(lm, ids):
    return [a[:, :, -1, :] for a in eager_attentions(lm, ids)]  # per layer (B, H_q, T)


def test_tova_keeps_the_last_querys_head_averaged_top_tokens(tiny, tiny_engine, prompt_ids):
    rows = _eager_last_row(tiny, prompt_ids)
    _, prefill, cache = _compress(tiny_engine, "tova", prompt_ids, 64)
    for layer, (keys, _), row in zip(cache.layers, prefill.kv, rows):
        # tova_cache.py reduce(): mean over heads of attn_weights[:, :, -1, :], top cache_size, sorted
        expected = row.mean(1).topk(64, dim=-1).indices.sort(-1).values  # (B, 64)
        kept = _kept_rows(layer.keys, keys)  # (B, H_kv, 64)
        assert torch.equal(kept, expected[:, None].expand_as(kept))  # every KV head of the layer: the same set


def test_tova_evicts_the_least_attended_token_at_every_decode_step(tiny_engine, prompt_ids):
    method = build_method("tova")
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    compression, cache = compressed(method, prefill.kv, prefill.stats, Budget.parse(64))
    with recording(StatsRequest(windows=frozenset({1}))) as stats:
        tiny_engine.forward([prompt_ids[0]], [len(prompt_ids)], cache)  # appends one token: 65 per layer
    expected = []
    for layer_idx, layer in enumerate(cache.layers):
        row = stats.window[1][layer_idx].mean(1)  # (B, 65): the new query's head-averaged attention
        dropped = int(row.argmin())
        expected.append(layer.keys[:, :, [i for i in range(65) if i != dropped]])
    compression.on_decode_step(cache, stats)
    for layer, keys in zip(cache.layers, expected):
        assert torch.equal(layer.keys, keys)
    gen = tiny_engine.generate(prefill, method, Budget.parse(64), [], 10)
    assert gen.decode_steps == 9 and gen.kv_bytes == 2 * 4 * 2 * 16 * 64 * 4  # still 64 tokens per layer


def _kvpress_expected_attention(lm, ids, keys_per_layer, values_per_layer, n_sink=4, n_future=512):
    """ExpectedAttentionPress.score, literally: pre-RoPE queries from q_proj on the attention's input hidden
    states, mean/cov over positions ≥ n_sink, RoPE averaged over the next n_future positions."""
    captured = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: captured.__setitem__(i, kwargs["hidden_states"]), with_kwargs=True
        )
        for i, layer in enumerate(lm.model.model.layers)
    ]
    try:
        with torch.no_grad():
            lm.model(input_ids=torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    rotary = lm.model.model.rotary_emb
    scores = []
    for i, attn in enumerate(lm.model.model.layers):
        module = attn.self_attn
        hidden = captured[i][:, n_sink:]
        q = module.q_proj(hidden).view(1, hidden.shape[1], -1, module.head_dim).transpose(1, 2)  # (B, H, N, D)
        mu = q.mean(dim=2, keepdim=True)
        centered = q - mu
        cov = torch.einsum("bnsi,bnsj->bnij", centered, centered) / hidden.shape[1]
        mu = mu.squeeze(2)
        d = module.head_dim
        cos, sin = rotary(mu, torch.arange(len(ids), len(ids) + n_future)[None])
        cos, sin = cos[0], sin[0]
        eye = torch.eye(d)
        P = torch.zeros(d, d)
        P[d // 2 :, : d // 2], P[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
        R = (cos.unsqueeze(1) * eye + sin.unsqueeze(1) * P).mean(0)
        mu, cov = mu @ R.T, R @ cov @ R.T
        keys, values = keys_per_layer[i][:, :, n_sink:], values_per_layer[i][:, :, n_sink:]
        groups = mu.shape[1] // keys.shape[1]
        k = keys.repeat_interleave(groups, dim=1).transpose(2, 3)  # repeat_kv
        s = torch.matmul(mu.unsqueeze(2), k).squeeze(2) / math.sqrt(d)
        s = s + torch.einsum("bhin,bhij,bhjn->bhn", k, cov, k) / d / 2
        s = F.softmax(s, dim=-1).view(1, keys.shape[1], groups, -1).mean(2)
        s = s * values.norm(dim=-1)
        scores.append(F.pad(s, (n_sink, 0), value=s.max().item() + 1))
    return scores


def test_expected_attention_matches_kvpress(tiny, tiny_engine, prompt_ids):
    ids = prompt_ids[:300]
    method, prefill, cache = _compress(tiny_engine, "expected_attention", ids, 80)
    reference = _kvpress_expected_attention(tiny, ids, [k for k, _ in prefill.kv], [v for _, v in prefill.kv])
    for layer_idx, (layer, (keys, values)) in enumerate(zip(cache.layers, prefill.kv)):
        ours = method.scores(layer_idx, keys, values, prefill.stats)  # (B, H_kv, T)
        torch.testing.assert_close(ours[..., 4:], reference[layer_idx][..., 4:], rtol=1e-4, atol=1e-7)
        expected = reference[layer_idx].topk(80, dim=-1).indices.sort(-1).values
        assert torch.equal(_kept_rows(layer.keys, keys), expected)
        assert torch.equal(_kept_rows(layer.keys, keys)[..., :4], torch.arange(4).expand(1, 2, 4))  # sinks kept


def test_query_moments_rotate_back_to_the_pre_rope_queries(tiny, tiny_engine, prompt_ids):
    """Σq recorded from post-RoPE queries equals Σ q_proj(h) over positions ≥ 4 (independent of chunking)."""
    ids = prompt_ids[:200]
    one = tiny_engine.prefill(ids, StatsRequest(query_moments=frozenset({4}))).stats.moments[4]
    from transformers import DynamicCache

    cache = DynamicCache()
    with recording(StatsRequest(query_moments=frozenset({4}))) as chunked:
        tiny_engine.forward(ids[:120], list(range(120)), cache)
        tiny_engine.forward(ids[120:], list(range(120, 200)), cache)
    for layer_idx, moments in one.items():
        other = chunked.moments[4][layer_idx]
        assert moments.count == other.count == 196
        torch.testing.assert_close(moments.total, other.total, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(moments.outer, other.outer, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("name", ["tova", "knorm", "keydiff", "expected_attention"])
def test_new_scorers_keep_exactly_the_budget_and_reproduce_the_full_cache_at_one(name, tiny_engine, prompt_ids):
    method, prefill, cache = _compress(tiny_engine, name, prompt_ids, 0.25)
    assert [layer.keys.shape[2] for layer in cache.layers] == [135] * 4
    full = method.compress(prefill.kv, prefill.stats, Budget.parse(1.0))
    assert all(a.keys is k for a, (k, _) in zip(full.layers, prefill.kv))


def test_query_moments_use_the_models_rounded_rope(tiny):
    """A bf16 model's RoPE buffer is rounded with its weights; un-rotating with exact fp32 frequencies would be off
    by position × rounding error (1.4 rad at position 1000 on the bundled model)."""
    import copy

    from kvbench.model.attention import rope_of
    from kvbench.model.rope import inv_freq_of

    model = copy.deepcopy(tiny.model).to(torch.bfloat16)
    inv_freq, _ = rope_of(model.model.layers[0].self_attn)
    assert torch.equal(inv_freq, inv_freq_of(model).float())


def test_query_moments_take_each_layers_own_rope_on_gemma3():
    """Gemma 3 has a RoPE per layer type (sliding layers θ = 10K, global layers θ = 1M): a layer's query moments are
    un-rotated with its own type's frequencies and scaling, as the model rotated them."""
    from kvbench.model.attention import rope_of
    from tests.model.families import build

    model = build("gemma3")
    rotary, types = model.model.rotary_emb, model.config.layer_types
    for i, layer in enumerate(model.model.layers):
        inv_freq, scaling = rope_of(layer.self_attn)
        assert torch.equal(inv_freq, getattr(rotary, f"{types[i]}_inv_freq").float())
        assert scaling == getattr(rotary, f"{types[i]}_attention_scaling")
    assert not torch.equal(rotary.sliding_attention_inv_freq, rotary.full_attention_inv_freq)
