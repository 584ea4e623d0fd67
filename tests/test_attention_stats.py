"""Attention statistics from Q/K chunks equal eager attention's weights, and recording does not change outputs."""

import torch

from kvbench.attention import StatsRequest, recording
from kvbench.kernels import attention_column_sums
from kvbench.kernels import attention_stats


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
    monkeypatch.setattr(attention_stats, "_MAX_CHUNK_ELEMENTS", 6 * 50 * 7)  # force several chunks
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
        from kvbench.attention import register

        model.set_attn_implementation(register())
    torch.testing.assert_close(ours.logits, eager.logits, atol=1e-5, rtol=1e-5)
    for layer, weights in enumerate(eager.attentions):  # (B, H_q, T, T)
        torch.testing.assert_close(stats.all_queries[layer], weights.sum(2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stats.window[8][layer], weights[:, :, -8:].sum(2), atol=1e-5, rtol=1e-5)
