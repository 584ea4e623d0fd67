"""Attention statistics from Q/K chunks equal eager attention's weights, and recording does not change outputs."""

import torch

from kvbench.kernels import attention_column_sums, attention_stats
from kvbench.model.attention import StatsRequest, recording


def _eager_column_sums(query, key, scaling):
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1).float()  # (B, H_q, T, D)
    scores = query.float() @ k.transpose(-1, -2) * scaling  # (B, H_q, Q, T)
    T, Q = key.shape[2], query.shape[2]
    future = torch.arange(T)[None, :] > (T - Q + torch.arange(Q))[:, None]
    return scores.masked_fill(future, float("-inf")).softmax(-1).sum(2)  # (B, H_q, T)


def test_column_sums_match_eager_for_gqa_and_windows(monkeypatch):
    torch.manual_seed(0)
    query, key = torch.randn(1, 6, 50, 8), torch.randn(1, 2, 50, 8)
    monkeypatch.setattr(attention_stats, "_SCORE_ROWS", 3 * 7)  # force several chunks (7 queries × 3 heads)
    for window in (50, 7, 1):
        got = attention_column_sums(query[:, :, -window:], key, 0.3)
        torch.testing.assert_close(got, _eager_column_sums(query[:, :, -window:], key, 0.3))
        assert torch.allclose(got.sum(-1), torch.full((1, 6), float(window)))


def test_recorded_stats_match_the_models_eager_attention(tiny, prompt_ids):
    ids = torch.tensor([prompt_ids[:64]])
    model = tiny.model
    with recording(StatsRequest(windows=frozenset({8}), all_queries=True)) as stats:
        ours = model(input_ids=ids, use_cache=True)
    model.set_attn_implementation("eager")
    try:
        eager = model(input_ids=ids, output_attentions=True)
    finally:
        from kvbench.model.attention import register

        model.set_attn_implementation(register())
    torch.testing.assert_close(ours.logits, eager.logits, atol=1e-5, rtol=1e-5)
    for layer, weights in enumerate(eager.attentions):  # (B, H_q, T, T)
        torch.testing.assert_close(stats.all_queries[layer], weights.sum(2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stats.window[8][layer], weights[:, :, -8:].sum(2), atol=1e-5, rtol=1e-5)


def _direct_column_sums(query, key, scaling, allowed, softcap=None):
    """softmax over the allowed (Q, T) keys, computed directly: the definition the chunked statistics must meet."""
    group = query.shape[1] // key.shape[1]
    scores = query.double() @ key.repeat_interleave(group, dim=1).double().transpose(-1, -2) * scaling  # (B, H, Q, T)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1).sum(2).float()  # (B, H_q, T)


def test_column_sums_follow_a_sliding_window_mask_and_softcap(monkeypatch):
    torch.manual_seed(0)
    query, key = torch.randn(1, 6, 40, 8) * 3, torch.randn(1, 2, 40, 8) * 3
    monkeypatch.setattr(attention_stats, "_SCORE_ROWS", 3 * 7)  # several chunks
    q_pos, k_pos = torch.arange(40)[:, None], torch.arange(40)[None, :]
    window = (k_pos <= q_pos) & (q_pos - k_pos < 5)  # (Q, T): the last 5 positions, as transformers' sliding window
    for softcap in (None, 2.0):
        got = attention_column_sums(query, key, 0.5, window[None, None], softcap)
        torch.testing.assert_close(got, _direct_column_sums(query, key, 0.5, window, softcap), atol=1e-5, rtol=1e-4)
        assert float(got.max()) <= 5 + 1e-4  # each key is seen by at most 5 queries
    additive = torch.zeros(40, 40).masked_fill(~window, float("-inf"))  # float masks add
    torch.testing.assert_close(
        attention_column_sums(query, key, 0.5, additive[None, None]),
        _direct_column_sums(query, key, 0.5, window),
        atol=1e-5,
        rtol=1e-4,
    )
    capped = attention_column_sums(query, key, 0.5, None, 2.0)  # no mask: causal, capped
    torch.testing.assert_close(capped, _direct_column_sums(query, key, 0.5, k_pos <= q_pos, 2.0), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(capped, attention_column_sums(query, key, 0.5))


def _tiny(config_cls, **extra):
    from transformers import AutoModelForCausalLM

    from kvbench.model.attention import register

    torch.manual_seed(0)
    config = config_cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=320,
        max_position_embeddings=512,
        **extra,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation(register())
    return model


def _stats_and_eager(model, ids):
    from kvbench.model.attention import register

    with torch.no_grad(), recording(StatsRequest(windows=frozenset({8}), all_queries=True)) as stats:
        ours = model(input_ids=ids, use_cache=True)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            eager = model(input_ids=ids, output_attentions=True)
    finally:
        model.set_attn_implementation(register())
    return ours, stats, eager


def test_sliding_window_and_softcapped_models_record_the_attention_they_compute():
    from transformers import Gemma2Config, MistralConfig

    ids = torch.randint(0, 320, (1, 48), generator=torch.Generator().manual_seed(0))
    mistral = _tiny(MistralConfig, sliding_window=12)  # Mistral v0.1: a window on every layer
    gemma2 = _tiny(Gemma2Config, sliding_window=12, attn_logit_softcapping=5.0, query_pre_attn_scalar=16)
    for model in (mistral, gemma2):
        ours, stats, eager = _stats_and_eager(model, ids)
        torch.testing.assert_close(ours.logits, eager.logits, atol=1e-4, rtol=1e-4)
        for layer, weights in enumerate(eager.attentions):  # (B, H_q, T, T), with the window and the cap
            torch.testing.assert_close(stats.all_queries[layer], weights.sum(2), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(stats.window[8][layer], weights[:, :, -8:].sum(2), atol=1e-5, rtol=1e-4)
    # the window is real: the first key of a windowed layer is seen by its window of queries only
    _, stats, _ = _stats_and_eager(mistral, ids)
    assert float(stats.all_queries[0][..., 0].max()) <= 12


def test_h2o_keeps_the_positions_eager_attention_weights_select(tiny, prompt_ids):
    """The chunked column sums (normalisation folded into a product) select what eager attention's weights do."""
    from types import SimpleNamespace

    from kvbench.methods import Budget, build_method
    from kvbench.native.engine import Engine
    from tests.conftest import compressed, eager_attentions

    ids = prompt_ids[:300]
    prefill = Engine(tiny).prefill(ids, StatsRequest(all_queries=True))
    eager = SimpleNamespace(all_queries={i: w.sum(2) for i, w in enumerate(eager_attentions(tiny, ids))})  # (B, H_q, T)
    for params in ({}, {"score": "mean"}, {"recent_ratio": 0.1}):
        ours, reference = build_method("h2o", params), build_method("h2o", params)
        ours_kept = compressed(ours, prefill.kv, prefill.stats, Budget.parse(0.2))[0].kept
        reference_kept = compressed(reference, prefill.kv, eager, Budget.parse(0.2))[0].kept
        assert all(torch.equal(a, b) for a, b in zip(ours_kept, reference_kept))


def test_a_decode_step_records_its_row_and_attends_with_one_softmax():
    """One query, no mask: the output equals sdpa's and the recorded row equals the chunked column sums."""
    from kvbench.kernels.attention_stats import decode_attention_with_probs

    torch.manual_seed(0)
    query, key, value = torch.randn(2, 6, 1, 8), torch.randn(2, 2, 30, 8), torch.randn(2, 2, 30, 8)
    out, row = decode_attention_with_probs(query, key, value, 0.3)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), scale=0.3
    )  # (B, H_q, 1, D)
    torch.testing.assert_close(out, sdpa.transpose(1, 2))
    torch.testing.assert_close(row, attention_column_sums(query, key, 0.3))
    torch.testing.assert_close(row, _eager_column_sums(query, key, 0.3))


def test_column_sums_add_a_finite_additive_mask_in_natural_units(monkeypatch):
    """Scores live in log2 units inside the kernel; an additive (bias) mask is in the logits' units."""
    torch.manual_seed(1)
    query, key = torch.randn(1, 4, 30, 8), torch.randn(1, 2, 30, 8)
    monkeypatch.setattr(attention_stats, "_SCORE_ROWS", 2 * 4)  # several chunks
    causal = torch.arange(30)[None, :] <= torch.arange(30)[:, None]  # (Q, T)
    bias = (torch.randn(30, 30) * 2).masked_fill(~causal, float("-inf"))  # (Q, T)
    k = key.repeat_interleave(2, dim=1)  # (B, H_q, T, D)
    expected = ((query @ k.transpose(-1, -2)) * 0.4 + bias).softmax(-1).sum(2)  # (B, H_q, T)
    torch.testing.assert_close(attention_column_sums(query, key, 0.4, bias[None, None]), expected)
