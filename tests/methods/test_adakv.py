"""AdaKV: head-wise budgets stored ragged and physically; ragged attention against dense masked attention."""

import dataclasses

import pytest
import torch

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method, method_defaults
from kvbench.methods.adakv import adaptive_keep
from kvbench.model.attention import StatsRequest
from kvbench.model.cache import cache_nbytes
from kvbench.model.ragged import RaggedKV, RaggedLayer, ragged_attention

BYTES_PER_TOKEN_HEAD = 2 * 16 * 4  # K and V × head_dim 16 × fp32 (tiny model)


def _kvpress_adakv_mask(scores, n_kept, alpha):
    """AdaKVPress.compress, literally: safeguard by finfo.max, then prune the bottom H·(T − n_kept) across heads."""
    scores = scores.clone()
    bsz, n_heads, k_len = scores.shape
    top = torch.topk(scores, int(n_kept * alpha), dim=-1).indices
    scores.scatter_(-1, top, torch.finfo(scores.dtype).max)
    n_pruned = n_heads * (k_len - n_kept)
    pruned = torch.topk(-scores.reshape(bsz, -1), n_pruned, dim=1).indices.flatten()
    keep = torch.ones(bsz, n_heads * k_len, dtype=torch.bool)
    keep[torch.arange(bsz).repeat_interleave(n_pruned), pruned] = False
    return keep.view(bsz, n_heads, k_len)


def test_adaptive_keep_matches_kvpress_and_keeps_the_layer_budget():
    torch.manual_seed(0)
    scores = torch.rand(2, 3, 50) * torch.tensor([1.0, 5.0, 0.2])[None, :, None]  # heads on different scales
    keep = adaptive_keep(scores, 10, 0.2)
    assert torch.equal(keep, _kvpress_adakv_mask(scores, 10, 0.2))
    assert keep.sum((1, 2)).tolist() == [30, 30]  # H_kv · n_keep per sequence
    per_head = keep.sum(-1)
    assert per_head.min() >= 2 and per_head[:, 1].min() > per_head[:, 2].max()  # safeguard; budget follows scores


def test_ragged_attention_equals_dense_attention_with_evicted_keys_masked():
    torch.manual_seed(0)
    keys, values = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)  # (B, H_kv, T, D)
    keep = torch.rand(2, 2, 40) < 0.5
    keep[..., -3:] = True  # the 3 queries' own positions
    query = torch.randn(2, 4, 3, 16)  # (B, H_q, Q, D): the last 3 positions
    layer = RaggedLayer.gather(keys, values, keep)
    ragged = ragged_attention(
        query, RaggedKV(layer.flat_keys, layer.lengths, 2, 2), RaggedKV(layer.flat_values, layer.lengths, 2, 2), 0.25
    )  # (B, Q, H_q, D)
    k, v = keys.repeat_interleave(2, dim=1), values.repeat_interleave(2, dim=1)  # repeat_kv: (B, H_q, T, D)
    scores = query @ k.transpose(-1, -2) * 0.25  # (B, H_q, Q, T)
    causal = torch.arange(40)[None, :] > torch.arange(37, 40)[:, None]  # (Q, T)
    scores = scores.masked_fill(~keep.repeat_interleave(2, dim=1)[:, :, None, :] | causal, float("-inf"))
    dense = (scores.softmax(-1) @ v).transpose(1, 2)  # (B, Q, H_q, D)
    torch.testing.assert_close(ragged, dense, rtol=1e-5, atol=1e-6)


def test_ragged_layer_appends_to_every_head_and_holds_only_kept_rows():
    keys = torch.arange(2 * 5 * 1.0).view(1, 2, 5, 1).expand(-1, -1, -1, 4).contiguous()  # (1, 2, 5, 4)
    keep = torch.tensor([[[True, False, True, False, False], [True, True, True, True, False]]])
    layer = RaggedLayer.gather(keys, keys.clone(), keep)
    assert layer.lengths == [2, 4] and layer.flat_keys[:, 0].tolist() == [0, 2, 5, 6, 7, 8]
    layer.update(torch.full((1, 2, 1, 4), -1.0), torch.full((1, 2, 1, 4), -1.0))
    assert layer.lengths == [3, 5] and layer.flat_keys[:, 0].tolist() == [0, 2, -1, 5, 6, 7, 8, -1]
    assert layer.flat_keys.untyped_storage().nbytes() == 8 * 4 * 4  # no padding anywhere
    with pytest.raises(KvbenchError, match="different lengths"):
        layer.keys  # noqa: B018 (dense consumers get one clear line)


@pytest.mark.parametrize("scorer", ["snapkv", "knorm", "expected_attention"])
def test_measured_bytes_equal_the_budget_and_heads_differ(scorer, tiny_engine, prompt_ids):
    method = build_method("adakv", {"scorer": scorer})
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    cache = method.compress(prefill.kv, prefill.stats, Budget.parse(0.25))
    n_keep = Budget.parse(0.25).tokens(len(prompt_ids))  # 135 per head on average
    for layer_idx, layer in enumerate(cache.layers):
        assert sum(layer.lengths) == 2 * n_keep
        keys, values = prefill.kv[layer_idx]
        scores = method._scorer.scores(layer_idx, keys, values, prefill.stats)
        assert layer.lengths == adaptive_keep(scores, n_keep, 0.2).sum(-1).view(-1).tolist()
    assert any(len(set(layer.lengths)) > 1 for layer in cache.layers)  # budgets really move between heads
    assert cache_nbytes(cache) == 4 * 2 * n_keep * BYTES_PER_TOKEN_HEAD  # exactly the budget, nothing else
    gen = tiny_engine.generate(prefill, method, Budget.parse(0.25), [], 5)
    uniform = tiny_engine.generate(prefill, build_method(scorer), Budget.parse(0.25), [], 5)
    assert gen.kv_bytes == uniform.kv_bytes == 4 * 2 * (n_keep + 4) * BYTES_PER_TOKEN_HEAD


def test_all_kept_ragged_cache_reproduces_the_full_cache(tiny_engine, prompt_ids):
    """A ragged layer keeping everything decodes like the dense cache (up to fp32 summation order)."""
    from transformers import DynamicCache

    prefill = tiny_engine.prefill(prompt_ids, StatsRequest())
    full = tiny_engine.generate(prefill, build_method("full"), None, [], 6, keep_logits=True)
    method = build_method("adakv")
    ragged = DynamicCache()
    for keys, values in prefill.kv:
        ragged.layers.append(RaggedLayer.gather(keys, values, torch.ones(keys.shape[:3], dtype=torch.bool)))
    given = dataclasses.replace(prefill, compressed=ragged)  # decoded as it is, as a prefill=inline cache
    gen = tiny_engine.generate(given, method, Budget.parse(0.5), [], 6, keep_logits=True)
    assert gen.token_ids == full.token_ids
    for a, b in zip(gen.logits[1:], full.logits[1:]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_adakv_pyramid_layer_budgets_and_refusals(tiny_engine, prompt_ids):
    method = build_method("adakv", {"scorer": "pyramidkv"})
    assert method.layer_tokens(160, 30, 4096) == build_method("pyramidkv").layer_tokens(160, 30, 4096)
    with pytest.raises(KvbenchError, match="scorer='h2o'"):
        build_method("adakv", {"scorer": "h2o"})
    with pytest.raises(KvbenchError, match="alpha_safeguard"):
        build_method("adakv", {"alpha_safeguard": 1.5})


def test_full_safeguard_is_the_scorers_own_selection_through_the_ragged_path(tiny_engine, prompt_ids):
    """alpha_safeguard=1 guarantees every head its own top n_keep: AdaKV then keeps exactly what SnapKV keeps, so
    decoding through the ragged layers must give SnapKV's logits (up to fp32 summation order)."""
    ada = build_method("adakv", {"scorer": "snapkv", "alpha_safeguard": 1.0})
    prefill = tiny_engine.prefill(prompt_ids, ada.stats_request())
    ours = tiny_engine.generate(prefill, ada, Budget.parse(0.25), [], 6, keep_logits=True)
    snap = tiny_engine.generate(prefill, build_method("snapkv"), Budget.parse(0.25), [], 6, keep_logits=True)
    assert ours.token_ids == snap.token_ids and ours.kv_bytes == snap.kv_bytes
    for a, b in zip(ours.logits, snap.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_scorer_params_set_the_wrapped_scorers_knobs(tiny_engine, prompt_ids):
    """`scorer_params` over the scorer's defaults (kvpress's AdaKVPress(SnapKVPress()) has window 64, kvbench 32);
    a knob the scorer lacks is one line naming its knobs."""
    method = build_method("adakv", {"scorer": "snapkv", "scorer_params": {"window_size": 64}})
    default = method_defaults("snapkv")["window_size"]  # the scorer's own default, from its dataclass
    assert method._scorer.window_size == 64 != default and build_method("adakv")._scorer.window_size == default
    assert build_method("decoding", {"scorer_params": {}})._scorer.name == "knorm"
    with pytest.raises(KvbenchError, match="window") as error:
        build_method("adakv", {"scorer": "snapkv", "scorer_params": {"windw_size": 64}})
    assert "\n" not in str(error.value)
    wide, narrow = (build_method("adakv", {"scorer_params": {"window_size": w}}) for w in (64, 32))
    prefill = tiny_engine.prefill(prompt_ids, wide.stats_request() | narrow.stats_request())
    kept = [m.compress(prefill.kv, prefill.stats, Budget.parse(0.25)).layers[0].lengths for m in (wide, narrow)]
    assert kept[0] != kept[1]  # the window changes what the heads keep
