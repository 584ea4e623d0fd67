"""Decode-time compression (`decoding`, kvpress's DecodingPress): cache size over time and what it keeps."""

import pytest
import torch

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method
from kvbench.model.attention import StatsRequest, recording
from tests.conftest import compressed

BYTES_PER_TOKEN = 2 * 4 * 2 * 16 * 4  # tiny model: K and V × 4 layers × 2 KV heads × head_dim 16 × fp32


def test_cache_oscillates_between_decode_budget_and_budget_plus_interval(tiny_engine, prompt_ids):
    method = build_method("decoding", {"scorer": "knorm", "compress_every": 8, "decode_budget": 100})
    gen = tiny_engine.run(method, Budget.parse(1.0), prompt_ids, max_new_tokens=30)
    assert gen.decode_steps == 29  # compressions after steps 8, 16, 24 → 100 tokens, then 5 more steps
    assert gen.kv_bytes == BYTES_PER_TOKEN * 105
    early = tiny_engine.run(method, Budget.parse(1.0), prompt_ids, max_new_tokens=8)  # 7 steps: none yet
    assert early.kv_bytes == BYTES_PER_TOKEN * (len(prompt_ids) + 7)


def test_appended_tokens_are_decode_steps(tiny_engine, prompt_ids):
    """A forced trace (query_aware=false suffix) goes through the same per-token compression."""
    method = build_method("decoding", {"scorer": "tova", "compress_every": 10, "decode_budget": 50})
    prefill = tiny_engine.prefill(prompt_ids[:200], method.stats_request())
    compression, cache = compressed(method, prefill.kv, prefill.stats, Budget.parse(1.0))
    tiny_engine._extend(cache, compression, prompt_ids[200:245], 200)  # 45 tokens: compressions at 10, 20, 30, 40
    assert [layer.keys.shape[2] for layer in cache.layers] == [55] * 4


def test_compression_keeps_the_scorers_top_tokens_of_the_whole_cache(tiny_engine, prompt_ids):
    method = build_method("decoding", {"scorer": "knorm", "compress_every": 3, "decode_budget": 64})
    prefill = tiny_engine.prefill(prompt_ids[:100], method.stats_request())
    compression, cache = compressed(method, prefill.kv, prefill.stats, Budget.parse(1.0))
    for step, token in enumerate(prompt_ids[100:103]):
        if step == 2:
            before = [layer.keys.clone() for layer in cache.layers]
        with recording(compression.decode_request()) as stats:
            tiny_engine.forward([token], [100 + step], cache)
        if step == 2:
            full = [torch.cat([b, layer.keys[:, :, -1:]], dim=2) for b, layer in zip(before, cache.layers)]
        compression.on_decode_step(cache, stats)
    for layer, keys in zip(cache.layers, full):  # 103 tokens → the 64 lowest-norm keys of each head
        index = (-keys.norm(dim=-1)).topk(64, dim=-1).indices.sort(-1).values  # (B, H_kv, 64)
        assert torch.equal(layer.keys, keys.gather(2, index[..., None].expand(-1, -1, -1, 16)))


def test_decode_rows_sum_to_the_observation_window(tiny_engine, prompt_ids):
    """W single-query steps' attention rows, summed, equal the window statistics of those W queries at once."""
    method = build_method("decoding", {"scorer": "snapkv", "compress_every": 1000, "decode_budget": 10})
    w = method._scorer.window_size
    ids = prompt_ids[: 100 + w]
    prefill = tiny_engine.prefill(ids[:100], method.stats_request())
    compression, cache = compressed(method, prefill.kv, prefill.stats, Budget.parse(1.0))
    tiny_engine._extend(cache, compression, ids[100:], 100)
    window = compression.window_stats(cache)
    reference = tiny_engine.prefill(ids, StatsRequest(windows=frozenset({w}))).stats
    for layer_idx in range(4):
        torch.testing.assert_close(window.window[w][layer_idx], reference.window[w][layer_idx], rtol=1e-4, atol=1e-5)


def test_decoding_refuses_methods_without_scores():
    with pytest.raises(KvbenchError, match="scorer='h2o': use one of"):
        build_method("decoding", {"scorer": "h2o"})
    with pytest.raises(KvbenchError, match="decode_budget=0"):
        build_method("decoding", {"decode_budget": 0})


def test_prompt_compression_is_the_scorers(tiny_engine, prompt_ids):
    method = build_method("decoding", {"scorer": "keydiff"})
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    ours = method.compress(prefill.kv, prefill.stats, Budget.parse(0.25))
    theirs = build_method("keydiff").compress(prefill.kv, prefill.stats, Budget.parse(0.25))
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(ours.layers, theirs.layers))
