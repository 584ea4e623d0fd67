"""SnapKV knobs for reproducing papers: per-query-head selection (the original's layout), odd pooling kernels."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method
from kvbench.methods.snapkv import QueryHeadLayer
from kvbench.model.attention import StatsRequest
from kvbench.model.cache import cache_from_kv
from tests.conftest import eager_attentions


def test_per_query_head_selection_matches_the_original(tiny, tiny_engine, prompt_ids):
    ids, window, kernel, n_keep = prompt_ids[:200], 16, 5, 60
    attentions = eager_attentions(tiny, ids)  # per layer (B, H_q, T, T)
    method = build_method("snapkv", {"window_size": window, "kernel_size": kernel, "aggregate": "none"})
    prefill = tiny_engine.prefill(ids, method.stats_request())
    cache = method.compress(prefill.kv, prefill.stats, Budget.parse(n_keep))
    for layer, weights, (keys, _) in zip(cache.layers, attentions, prefill.kv):
        # FasterDecoding/SnapKV update_kv after repeat_kv: every query head votes and selects on its own
        votes = weights[:, :, -window:, :-window].sum(dim=-2)  # (B, H_q, T − W)
        pooled = F.avg_pool1d(votes, kernel_size=kernel, padding=kernel // 2, stride=1)
        expected = pooled.topk(n_keep - window, dim=-1).indices.sort(-1).values  # (B, H_q, n − W)
        index = torch.cat([expected, torch.arange(200 - window, 200).expand(1, 4, -1)], dim=-1)
        expanded = keys.repeat_interleave(2, dim=1)  # repeat_kv: (B, H_q, T, D)
        assert isinstance(layer, QueryHeadLayer) and layer.keys.shape == (1, 4, n_keep, 16)
        assert torch.equal(layer.keys, expanded.gather(2, index[..., None].expand(-1, -1, -1, 16)))
    grouped = build_method("snapkv", {"window_size": window, "kernel_size": kernel})
    per_head = tiny_engine.generate(prefill, method, Budget.parse(n_keep), [], 4)
    per_kv = tiny_engine.generate(prefill, grouped, Budget.parse(n_keep), [], 4)
    assert per_head.kv_bytes == 2 * per_kv.kv_bytes  # G = 2 query heads per KV head: G× the memory


def test_query_head_layout_decodes_like_the_kv_head_layout(tiny_engine, prompt_ids):
    """Nothing evicted, every query head holding its KV head's copy: the same logits as the plain cache."""
    prefill = tiny_engine.prefill(prompt_ids, StatsRequest())
    full = tiny_engine.generate(prefill, build_method("full"), None, [], 6, keep_logits=True)
    method = build_method("snapkv", {"aggregate": "none"})
    expanded = cache_from_kv(prefill.kv)
    expanded.layers = [
        QueryHeadLayer.holding(k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 2) for k, v in prefill.kv
    ]
    given = dataclasses.replace(prefill, compressed=expanded)  # decoded as it is, as a prefill=inline cache
    gen = tiny_engine.generate(given, method, Budget.parse(0.5), [], 6, keep_logits=True)
    assert gen.token_ids == full.token_ids
    for a, b in zip(gen.logits[1:], full.logits[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert gen.kv_bytes == 2 * full.kv_bytes


@pytest.mark.parametrize("kernel", [0, 2, 4, 6])
def test_even_pooling_kernels_are_refused(kernel):
    refused = "must be ≥ 1" if kernel == 0 else "odd pooling kernel"  # 0: the field's own rule (min=1) first
    with pytest.raises(KvbenchError, match=refused):
        build_method("snapkv", {"kernel_size": kernel})
    with pytest.raises(KvbenchError, match=refused):
        build_method("pyramidkv", {"kernel_size": kernel})
