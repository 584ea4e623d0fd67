"""Method-specific checks against the papers' definitions (tiny models, fp32)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from kvbench.methods import Budget, build_method
from kvbench.methods.pyramidkv import PyramidKV
from kvbench.model.attention import StatsRequest, register
from kvbench.model.load import LoadedModel, byte_tokenizer
from kvbench.native.engine import Engine
from tests.conftest import compressed


@pytest.fixture(scope="module")
def mha():
    """A tiny multi-head (not GQA) Llama: per-query-head selection of the originals applies unchanged."""
    torch.manual_seed(1)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        vocab_size=320,
        max_position_embeddings=4096,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation(register())
    return LoadedModel("tiny-mha", model, byte_tokenizer(), torch.device("cpu"), torch.float32)


def _eager_attentions(lm, ids):
    lm.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return lm.model(input_ids=torch.tensor([ids]), output_attentions=True).attentions  # (B, H, T, T) each
    finally:
        lm.model.set_attn_implementation(register())


def _kept_rows(cache_keys, prefill_keys):
    """Which prefill positions each head kept, found by matching key vectors: (B, H, N)."""
    match = (cache_keys[:, :, :, None, :] == prefill_keys[:, :, None, :, :]).all(-1)  # (B, H, N, T)
    return match.float().argmax(-1)


def test_snapkv_matches_the_original_selection(mha, prompt_ids):
    ids = prompt_ids[:200]
    window, kernel, n_keep = 16, 5, 60
    attentions = _eager_attentions(mha, ids)
    engine = Engine(mha)
    method = build_method("snapkv", {"window_size": window, "kernel_size": kernel})
    prefill = engine.prefill(ids, method.stats_request())
    cache = method.compress(prefill.kv, prefill.stats, Budget.parse(n_keep))
    for layer, weights in enumerate(attentions):
        # FasterDecoding/SnapKV update_kv: window rows, prefix columns, summed, avg-pooled, top-k
        votes = weights[:, :, -window:, :-window].sum(dim=-2)  # (B, H, T − W)
        pooled = F.avg_pool1d(votes, kernel_size=kernel, padding=kernel // 2, stride=1)
        expected = pooled.topk(n_keep - window, dim=-1).indices.sort(-1).values
        kept = _kept_rows(cache.layers[layer].keys, prefill.kv[layer][0])
        assert torch.equal(kept[..., : n_keep - window], expected)
        assert torch.equal(kept[..., n_keep - window :], torch.arange(len(ids) - window, len(ids)).expand(1, 4, -1))


def test_h2o_keeps_heavy_hitters_and_stays_at_budget(mha, prompt_ids):
    ids = prompt_ids[:200]
    attentions = _eager_attentions(mha, ids)
    engine = Engine(mha)
    method = build_method("h2o", {"recent_ratio": 0.5})
    prefill = engine.prefill(ids, method.stats_request())
    cache = method.compress(prefill.kv, prefill.stats, Budget.parse(40))
    for layer, weights in enumerate(attentions):
        accumulated = weights.sum(dim=2)  # (B, H, T): attention received from every prompt query
        heavy = accumulated[..., :-20].topk(20, dim=-1).indices.sort(-1).values
        kept = _kept_rows(cache.layers[layer].keys, prefill.kv[layer][0])
        assert torch.equal(kept[..., :20], heavy)
        assert torch.equal(kept[..., 20:], torch.arange(180, 200).expand(1, 4, -1))
    gen = engine.generate(prefill, method, Budget.parse(40), [], 8)
    assert gen.decode_steps == 7
    assert gen.kv_bytes == 2 * 2 * 4 * 16 * 40 * 4  # still 40 tokens per layer after 7 decode steps


def test_h2o_online_scores_accumulate_decode_attention(tiny_engine, prompt_ids):
    method = build_method("h2o")
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    start = tiny_engine.compressed(prefill, method, Budget.parse(0.2), [])
    tiny_engine.decode(start, method, 5)
    received = start.hooks.received  # the example's accumulated scores (methods/h2o.py's H2OCompression)
    total = sum(s.sum() for s in received.values()) / len(received)
    # each layer's scores sum to the attention mass of the surviving tokens: ≤ queries seen, > 0
    assert 0 < float(total) <= (len(prompt_ids) + 4) * 4


def test_pyramidkv_kvcache_factory_schedule_follows_its_integer_arithmetic():
    method = PyramidKV(window_size=32, beta=20, schedule="kvcache_factory")
    # C = 160 (128 selected + 32 window), 30 layers, 4K prompt: min 6, max 250, step 8
    budgets = method.layer_tokens(160, 30, 4096)
    assert budgets[0] == 250 + 32 and budgets[1] == 242 + 32 and budgets[-1] == 250 - 29 * 8 + 32
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))
    assert sum(method.layer_tokens(96, 32, 4096)) == 3536  # its floors overshoot a 3,072 budget by 15 %
    assert method.layer_tokens(160, 30, 200) == [160] * 30  # short prompt: uniform SnapKV


@pytest.mark.parametrize(
    "n_keep,n_layers,n_prompt", [(96, 32, 4096), (160, 30, 4096), (232, 30, 400), (41, 7, 1000), (300, 2, 5000)]
)
def test_pyramidkv_default_schedule_keeps_exactly_the_budget(n_keep, n_layers, n_prompt):
    budgets = PyramidKV(window_size=32, beta=20).layer_tokens(n_keep, n_layers, n_prompt)
    assert sum(budgets) == n_keep * n_layers
    assert all(a >= b for a, b in zip(budgets, budgets[1:])) and budgets[0] > budgets[-1]
    assert min(budgets) >= 32 and max(budgets) <= n_prompt  # every layer keeps its window, none beyond the prompt


def test_pyramidkv_measured_kept_tokens_equal_the_budget(tiny, tiny_engine, prompt_ids):
    method = build_method("pyramidkv", {"window_size": 16})
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    for budget in (100, 0.25):
        cache = method.compress(prefill.kv, prefill.stats, Budget.parse(budget))
        kept = [layer.keys.shape[2] for layer in cache.layers]
        assert len(set(kept)) > 1  # a pyramid, not uniform
        assert sum(kept) == Budget.parse(budget).tokens(len(prompt_ids)) * tiny.n_layers


def test_random_is_seeded(tiny_engine, prompt_ids):
    prefill = tiny_engine.prefill(prompt_ids, StatsRequest())
    a, b, c = (
        build_method("random", {"seed": s}).compress(prefill.kv, prefill.stats, Budget.parse(0.25)) for s in (0, 0, 1)
    )
    assert torch.equal(a.layers[0].keys, b.layers[0].keys)
    assert not torch.equal(a.layers[0].keys, c.layers[0].keys)


def test_rolling_positions_equal_keys_computed_at_the_new_positions(tiny, tiny_engine, prompt_ids):
    method = build_method("streamingllm", {"positions": "rolling", "start_size": 4})
    prefill = tiny_engine.prefill(prompt_ids, StatsRequest())
    method.bind(tiny)
    compression, cache = compressed(method, prefill.kv, prefill.stats, Budget.parse(100))
    kept = prompt_ids[:4] + prompt_ids[-96:]
    # layer 0's keys depend only on the token and its position: recompute them at positions 0..99
    with torch.no_grad():
        fresh = tiny_engine.prefill(kept, StatsRequest())
    torch.testing.assert_close(cache.layers[0].rolled_keys(), fresh.kv[0][0], atol=1e-5, rtol=1e-5)
    assert compression.position(len(prompt_ids), cache) == 100
    absolute = compressed(build_method("streamingllm"), prefill.kv, prefill.stats, Budget.parse(100))[0]
    assert absolute.position(len(prompt_ids), cache) == len(prompt_ids)


def test_rolling_decode_keeps_generating(tiny_engine, prompt_ids):
    gen = tiny_engine.run(
        build_method("streamingllm", {"positions": "rolling"}), Budget.parse(64), prompt_ids, max_new_tokens=6
    )
    # K/V at 64 tokens + each slot's int32 rotation position (shared by the heads), per layer
    assert gen.decode_steps == 5 and gen.kv_bytes == 4 * (2 * 2 * 16 * 64 * 4 + 64 * 4)


@pytest.mark.parametrize(
    "name,params,budget,match",
    [
        ("snapkv", {"window_size": 64}, 32, r"needs \(65"),
        ("pyramidkv", {"window_size": 64}, 40, r"needs \(65"),
    ],
)
def test_budget_below_the_methods_minimum(tiny_engine, prompt_ids, name, params, budget, match):
    from kvbench import KvbenchError

    method = build_method(name, params)
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    with pytest.raises(KvbenchError, match=match):
        method.compress(prefill.kv, prefill.stats, Budget.parse(budget))


@pytest.mark.parametrize(
    "name,params,minimum", [("snapkv", {"window_size": 64}, 65), ("h2o", {}, 2), ("streamingllm", {}, 5)]
)
def test_a_fraction_of_a_short_prompt_keeps_the_methods_minimum(tiny_engine, prompt_ids, name, params, minimum):
    method = build_method(name, params)
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    cache = method.compress(prefill.kv, prefill.stats, Budget.parse(0.001))  # 1 of 540 tokens asked
    assert [layer.keys.shape[2] for layer in cache.layers] == [minimum] * 4


def test_bad_method_parameters():
    from kvbench import KvbenchError

    with pytest.raises(KvbenchError, match="pooling='median': use one of avg, max"):
        build_method("snapkv", {"pooling": "median"})
    with pytest.raises(KvbenchError, match="positions"):
        build_method("streamingllm", {"positions": "relative"})
    with pytest.raises(KvbenchError, match="recent_ratio"):
        build_method("h2o", {"recent_ratio": 1.5})


def test_model_whose_attention_reports_no_statistics(mha, prompt_ids):
    from kvbench import KvbenchError

    mha.model.set_attn_implementation("sdpa")  # plain sdpa: the statistics hook never runs
    try:
        with pytest.raises(KvbenchError, match="supported: models whose attention goes through"):
            Engine(mha).prefill(prompt_ids[:50], build_method("snapkv").stats_request())
    finally:
        mha.model.set_attn_implementation(register())


@pytest.mark.parametrize("name", ["streamingllm", "h2o"])
def test_context_only_compression_keeps_the_question_on_top_of_the_budget(tiny_engine, prompt_ids, name):
    context, question = prompt_ids[:400], prompt_ids[400:460]
    method = build_method(name)
    prefill = tiny_engine.prefill(context, method.stats_request())
    compression, cache = compressed(method, prefill.kv, prefill.stats, Budget.parse(40))
    tiny_engine._extend(cache, compression, question, len(context))
    assert [layer.keys.shape[2] for layer in cache.layers] == [40 + 60] * 4  # the context budget is intact


def test_rolling_positions_of_an_appended_question_are_consecutive(tiny, tiny_engine, prompt_ids, monkeypatch):
    method = build_method("streamingllm", {"positions": "rolling"})
    method.bind(tiny)
    prefill = tiny_engine.prefill(prompt_ids[:400], StatsRequest())
    compression, cache = compressed(method, prefill.kv, prefill.stats, Budget.parse(100))
    seen = []
    real = tiny_engine.forward
    monkeypatch.setattr(
        tiny_engine, "forward", lambda ids, positions, c, **k: seen.append(positions) or real(ids, positions, c, **k)
    )
    tiny_engine._extend(cache, compression, prompt_ids[400:405], 400)
    assert seen == [[100, 101, 102, 103, 104]]


def test_compose_refuses_decode_eviction_on_layers_that_cannot_drop_tokens():
    from kvbench import KvbenchError
    from kvbench.methods.hf_quant import fp8_available

    quant = {"hf-quant": {"backend": "fp8" if fp8_available() else "quanto"}}  # transformers 5.2 has no fp8 cache
    with pytest.raises(KvbenchError, match="h2o evicts while decoding"):
        build_method("compose", {"stack": ["h2o", "hf-quant"], "overrides": quant})
    build_method("compose", {"stack": ["snapkv", "hf-quant"], "overrides": quant})


def test_shared_prefill_charges_each_method_only_its_own_statistics(tiny_engine, prompt_ids):
    request = build_method("h2o").stats_request() | build_method("snapkv").stats_request()
    prefill = tiny_engine.prefill(prompt_ids, request)
    assert set(prefill.stats.seconds) == {"all", 32}
    assert prefill.stats.seconds_for(StatsRequest()) == 0.0
    assert prefill.stats.seconds_for(request) == sum(prefill.stats.seconds.values())


def test_top_k_sorted_dropping_one_is_topk():
    """The one-token fast path (per-step eviction) returns exactly topk's positions; ties and NaN take topk."""
    import torch

    from kvbench.methods.base import top_k_sorted

    generator = torch.Generator().manual_seed(0)
    for n in (2, 3, 17, 300):
        scores = torch.randn(2, 3, n, generator=generator)
        want = scores.topk(n - 1, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(top_k_sorted(scores, n - 1), want)
    tied = torch.tensor([[[1.0, 0.5, 2.0, 0.5, 3.0]]])  # two lowest: topk's choice, whatever it is
    assert torch.equal(top_k_sorted(tied, 4), tied.topk(4, dim=-1).indices.sort(dim=-1).values)
    with_nan = torch.tensor([[[1.0, float("nan"), 2.0, 0.5]]])
    assert torch.equal(top_k_sorted(with_nan, 3), with_nan.topk(3, dim=-1).indices.sort(dim=-1).values)
