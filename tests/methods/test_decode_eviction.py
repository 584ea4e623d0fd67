"""Decode-time eviction (methods/decode_eviction.py) shared by H2O and StreamingLLM: sizes held, positions drift-free."""

import pytest
import torch

from kvbench.methods import Budget, build_method
from kvbench.model.attention import StatsRequest, recording
from kvbench.model.cache import layer_lengths
from kvbench.model.rope import inv_freq_of, rotate_half
from tests.conftest import compressed


def _rope64(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """keys (B, H, T, D) rotated to positions (T,) in float64: the exact reference."""
    freqs = positions.double()[:, None] * inv_freq.double()[None, :]  # (T, D/2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (T, D)
    return keys * angles.cos() + rotate_half(keys) * angles.sin()


def _attended_keys(layer) -> torch.Tensor:
    return layer.rolled_keys() if hasattr(layer, "rolled_keys") else layer.keys  # what attention reads


def test_rolling_positions_do_not_drift_over_1000_bf16_decode_steps(tiny):
    torch.manual_seed(0)
    method = build_method("streamingllm", {"positions": "rolling", "start_size": 4})
    method.bind(tiny)
    inv_freq = inv_freq_of(tiny.model)
    n_prompt, n_keep, steps = 64, 32, 1000
    n_total = n_prompt + steps
    raw = torch.randn(1, 2, n_total, 2 * inv_freq.numel(), dtype=torch.float64)  # (B, H_kv, T, D) pre-RoPE keys
    values = torch.zeros(1, 2, n_prompt, raw.shape[-1], dtype=torch.bfloat16)
    prompt_keys = _rope64(raw[:, :, :n_prompt], torch.arange(n_prompt), inv_freq).bfloat16()  # as the model stores
    compression, cache = compressed(method, [(prompt_keys, values)], None, Budget.parse(n_keep))
    arrived_at = {}
    for token in range(n_prompt, n_total):  # the engine's decode loop: rotate at its position, append, evict
        position = compression.position(token, cache)
        arrived_at[token] = position
        key = _rope64(raw[:, :, token : token + 1], torch.tensor([position]), inv_freq).bfloat16()  # (1, 2, 1, D)
        cache.layers[0].update(key, values[:, :, :1])
        compression.on_decode_step(cache, None)
    assert layer_lengths(cache) == [n_keep]
    tokens = list(range(4)) + list(range(n_total - (n_keep - 4), n_total))  # sinks + recent
    exact = _rope64(raw[:, :, tokens], torch.arange(n_keep), inv_freq)  # each kept token at its slot
    error = ((_attended_keys(cache.layers[0]).double() - exact).norm(dim=-1) / exact.norm(dim=-1)).max()
    # one rotation: the key as the model produced it (bf16), rotated once in fp32 to its slot, rounded to bf16
    produced = torch.cat(
        [
            prompt_keys[:, :, :4],
            torch.cat(
                [_rope64(raw[:, :, t : t + 1], torch.tensor([arrived_at[t]]), inv_freq).bfloat16() for t in tokens[4:]],
                2,
            ),
        ],
        2,
    )
    delta = torch.arange(n_keep) - torch.tensor(list(range(4)) + [arrived_at[t] for t in tokens[4:]])
    once = _rope64(produced.double(), delta, inv_freq).bfloat16().double()
    one_rotation = ((once - exact).norm(dim=-1) / exact.norm(dim=-1)).max()
    assert error <= 1.01 * one_rotation + 1e-6 and error < 0.005, (float(error), float(one_rotation))


def _decode(engine, method, budget, prompt, n_new):
    """The engine's greedy loop, without stopping at EOS: returns the layers' lengths after every step."""
    prefill = engine.prefill(prompt, method.stats_request())
    method.bind(engine.lm)
    compression, cache = compressed(method, prefill.kv, prefill.stats, budget)
    token, lengths = int(prefill.last_logits.argmax()), []
    for position in range(len(prompt), len(prompt) + n_new):
        with recording(compression.decode_request()) as stats:
            logits = engine.forward([token], [compression.position(position, cache)], cache)[-1]
        compression.on_decode_step(cache, stats)
        token = int(logits.argmax())
        lengths.append(layer_lengths(cache))
    return lengths


def _decode_synthetic(method, budget, n_prompt, n_new, n_layers=2, heads=(4, 2), dim=16):
    """The same loop on random queries/keys (no model): each step appends one token and records its attention."""
    torch.manual_seed(0)
    n_q, n_kv = heads
    keys = [torch.randn(1, n_kv, n_prompt, dim) for _ in range(n_layers)]  # (B, H_kv, T, D)
    with recording(method.stats_request()) as stats:
        for layer_idx, k in enumerate(keys):
            stats.record(layer_idx, torch.randn(1, n_q, n_prompt, dim), k, dim**-0.5)
    compression, cache = compressed(method, [(k, torch.randn_like(k)) for k in keys], stats, budget)
    lengths = []
    for _ in range(n_new):
        with recording(compression.decode_request()) as stats:
            for layer_idx, layer in enumerate(cache.layers):
                k, v = layer.update(torch.randn(1, n_kv, 1, dim), torch.randn(1, n_kv, 1, dim))
                if stats.request:
                    stats.record(layer_idx, torch.randn(1, n_q, 1, dim), k, dim**-0.5)
        compression.on_decode_step(cache, stats)
        lengths.append(layer_lengths(cache))
    return lengths


@pytest.mark.parametrize("name,params", [("h2o", {}), ("h2o", {"score": "mean"}), ("streamingllm", {})])
def test_an_absolute_budget_above_the_prompt_still_holds_the_cache_at_the_budget(name, params):
    # budget 512 ≥ a 300-token prompt: nothing evicted at prefill; decoding fills up to 512, then holds there
    lengths = _decode_synthetic(build_method(name, params), Budget.parse(512), 300, 400)
    assert lengths[99] == [400, 400] and lengths[211] == [512, 512] and lengths[-1] == [512, 512]


@pytest.mark.parametrize("name,params", [("h2o", {}), ("streamingllm", {"positions": "rolling"})])
def test_the_engine_holds_an_absolute_budget_above_the_prompt(tiny_engine, prompt_ids, name, params):
    lengths = _decode(tiny_engine, build_method(name, params), Budget.parse(48), prompt_ids[:30], 30)
    n_layers = len(lengths[0])
    assert lengths[9] == [40] * n_layers and lengths[17] == [48] * n_layers and lengths[-1] == [48] * n_layers


@pytest.mark.parametrize("name", ["h2o", "streamingllm"])
def test_budget_one_never_evicts_while_decoding(tiny_engine, prompt_ids, name):
    lengths = _decode(tiny_engine, build_method(name), Budget.parse(1.0), prompt_ids[:40], 10)
    assert lengths[-1] == [50] * len(lengths[0])


def test_h2o_mean_score_divides_by_the_queries_each_key_received(tiny_engine, prompt_ids):
    """kvpress's ObservedAttentionPress: attention summed over the queries, ÷ (T − i) queries seen by key i."""
    ids = prompt_ids[:120]
    prefill = tiny_engine.prefill(ids, StatsRequest(all_queries=True))
    summed, mean = (
        build_method("h2o", {"recent_ratio": 0.0}),
        build_method("h2o", {"recent_ratio": 0.0, "score": "mean"}),
    )
    fresh = [method.begin(120, len(prefill.kv), Budget.parse(120 // 4)) for method in (summed, mean)]
    for compression in fresh:
        compression.receive(0, prefill.stats, prefill.kv[0][0].shape[1])
    n_kv = prefill.kv[0][0].shape[1]
    columns = prefill.stats.all_queries[0]  # (B, H_q, T)
    expected = columns.view(1, n_kv, -1, 120).sum(2) / torch.arange(120, 0, -1).float()  # (B, H_kv, T)
    torch.testing.assert_close(fresh[1].ranking(0), expected)
    torch.testing.assert_close(fresh[0].ranking(0), columns.view(1, n_kv, -1, 120).sum(2))
    # while decoding every cached key receives one more query per step; the new token its own
    held, cache = compressed(mean, prefill.kv, prefill.stats, Budget.parse(200))  # ≥ the prompt: held at 200
    assert torch.equal(held.queries[0][0, 0], torch.arange(120, 0, -1).float())
    with recording(held.decode_request()) as stats:
        tiny_engine.forward([5], [120], cache)
    held.on_decode_step(cache, stats)
    assert torch.equal(held.queries[0][0, 0], torch.cat([torch.arange(121, 1, -1), torch.ones(1)]).float())


# ---- block eviction (evict_every = k) -----------------------------------------------------------------------------
def _held_caches(method, budget, n_prompt, n_new, dim=16):
    """The synthetic decode loop (one layer, random K/V, no model): each step's (keys, values) after eviction, and
    the example's compression."""
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, n_prompt + n_new, dim), torch.randn(1, 2, n_prompt + n_new, dim)  # (B, H, T, D)
    queries = torch.randn(n_prompt + n_new, 1, 4, 1, dim)  # one (B, H_q, 1, D) query per step
    with recording(method.stats_request()) as stats:
        stats.record(0, torch.randn(1, 4, n_prompt, dim), keys[:, :, :n_prompt], dim**-0.5)
    compression, cache = compressed(method, [(keys[:, :, :n_prompt], values[:, :, :n_prompt])], stats, budget)
    held = []
    for t in range(n_prompt, n_prompt + n_new):
        with recording(compression.decode_request()) as stats:
            k, _ = cache.layers[0].update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
            if stats.request:
                stats.record(0, queries[t], k, dim**-0.5)
        compression.on_decode_step(cache, stats)
        held.append((cache.layers[0].keys.clone(), cache.layers[0].values.clone()))
    return held, compression


@pytest.mark.parametrize("name,params", [("h2o", {}), ("h2o", {"score": "mean"}), ("streamingllm", {}), ("tova", {})])
@pytest.mark.parametrize("every", [1, 4, 7])
def test_block_eviction_holds_between_budget_and_budget_plus_slack(name, params, every):
    held, _ = _held_caches(build_method(name, {**params, "evict_every": every}), Budget.parse(24), 60, 40)
    lengths = [keys.shape[2] for keys, _ in held]
    # after step s (1-based) a layer holds 24 + (s mod k): it grows for k − 1 steps, the k-th drops k tokens at once
    assert lengths == [24 + (step % every) for step in range(1, 41)]
    assert max(lengths) <= 24 + every - 1


@pytest.mark.parametrize("every", [4, 7])
def test_streamingllm_blocks_keep_what_per_step_eviction_keeps_at_every_kth_step(every):
    per_step, _ = _held_caches(build_method("streamingllm"), Budget.parse(24), 60, 40)
    blocks, _ = _held_caches(build_method("streamingllm", {"evict_every": every}), Budget.parse(24), 60, 40)
    for step in range(every - 1, 40, every):  # right after each block eviction: sinks + the same recent window
        assert all(torch.equal(a, b) for a, b in zip(per_step[step], blocks[step]))


@pytest.mark.parametrize("score", ["sum", "mean"])
def test_h2o_blocks_drop_the_lowest_accumulated_scores_with_every_step_voting(score):
    method = build_method("h2o", {"evict_every": 5, "score": score})
    held, compression = _held_caches(method, Budget.parse(24), 60, 10)
    # the scores follow the held tokens and count every query so far: after 10 steps the recent window's newest
    # token has been seen by 1 query, the oldest kept prompt token by 60 + 10 (mean's denominators)
    assert compression.received[0].shape[-1] == held[-1][0].shape[2] == 24
    if score == "sum":  # only mean counts the queries
        assert compression.queries == {}
    else:
        assert compression.queries[0][0, 0, -1] == 1 and compression.queries[0][0, 0, 0] == 70


@pytest.mark.parametrize("name", ["h2o", "streamingllm"])
def test_block_eviction_bytes_are_what_is_held_and_what_the_planner_predicts(name, tiny_engine, prompt_ids):
    from kvbench.model.cache import full_cache_nbytes
    from kvbench.model.kv_bytes import KVShape, predict_kv_bytes

    lm = tiny_engine.lm
    method = build_method(name, {"evict_every": 5})
    gen = tiny_engine.run(method, Budget.parse(0.25), prompt_ids, max_new_tokens=13)  # 12 decode steps: 2 held over
    assert gen.decode_steps == 12
    held = 135 + 12 % 5  # per layer: the budget + the steps since the last block eviction
    assert gen.kv_bytes == full_cache_nbytes(lm.n_layers, lm.n_kv_heads, lm.head_dim, held, lm.dtype)
    shape = KVShape(lm.n_layers, lm.n_kv_heads, lm.head_dim, lm.dtype)
    predicted = predict_kv_bytes(method, Budget.parse(0.25), shape, len(prompt_ids), 0, gen.decode_steps)
    assert predicted.exact and predicted.kv_bytes == gen.kv_bytes and set(predicted.layer_tokens) == {held}


def test_evict_every_must_be_a_positive_integer():
    from kvbench import KvbenchError

    with pytest.raises(KvbenchError, match=r"method.evict_every=0 must be ≥ 1"):  # the field's rule, wherever given
        build_method("h2o", {"evict_every": 0})
    with pytest.raises(KvbenchError, match=r"method.evict_every=2.5 is not an integer"):
        build_method("h2o", {"evict_every": 2.5})


def test_tova_evicts_by_the_step_query_on_the_shared_component():
    """TOVA on DecodeEviction: each step keeps the top tokens by that step's query, head-averaged (its formula)."""
    torch.manual_seed(0)
    method = build_method("tova")
    keys, values = torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)  # (B, H_kv, T, D)
    with recording(method.stats_request()) as stats:
        stats.record(0, torch.randn(1, 4, 60, 16), keys[:, :, :60], 0.25)
    compression, cache = compressed(method, [(keys[:, :, :60], values[:, :, :60])], stats, Budget.parse(20))
    for t in range(60, 70):
        before = torch.cat([cache.layers[0].keys, keys[:, :, t : t + 1]], 2)  # (1, 2, 21, 16)
        query = torch.randn(1, 4, 1, 16)
        with recording(compression.decode_request()) as stats:
            k, _ = cache.layers[0].update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
            stats.record(0, query, k, 0.25)
        compression.on_decode_step(cache, stats)
        row = (query @ before.repeat_interleave(2, 1).transpose(-1, -2) * 0.25).softmax(-1)  # (1, 4, 1, 21)
        kept = row.mean(1)[0, 0].topk(20).indices.sort().values  # head-averaged: the same positions for every head
        assert torch.equal(cache.layers[0].keys, before[:, :, kept])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_h2os_step_over_every_layer_at_once_is_its_layer_by_layer_step(dtype):
    """H2O's decode step stacked over layers that stand alike (kvbench's common case) keeps, step after step, the
    very positions and scores the layer-by-layer step keeps — ties at the lowest score included (topk decides)."""

    from kvbench.methods.decode_eviction import Evicting
    from kvbench.model.attention import StatsRecorder

    generator = torch.Generator().manual_seed(0)
    n_layers, n_kv, n_q, n_prompt, dim = 3, 2, 4, 40, 8

    def rand(*shape):
        return torch.rand(*shape, generator=generator)

    kv = [(rand(1, n_kv, n_prompt, dim).to(dtype), rand(1, n_kv, n_prompt, dim).to(dtype)) for _ in range(n_layers)]
    prefill = StatsRecorder(StatsRequest(all_queries=True))
    prefill.all_queries = {i: rand(1, n_q, n_prompt) for i in range(n_layers)}
    runs = []
    for _ in range(2):
        method = build_method("h2o", {})
        hooks = method.begin(n_prompt, n_layers, Budget.parse(0.5))
        runs.append((hooks, hooks.run([(k.clone(), v.clone()) for k, v in kv], prefill)))
    for step in range(12):
        new = [(rand(1, n_kv, 1, dim).to(dtype), rand(1, n_kv, 1, dim).to(dtype)) for _ in range(n_layers)]
        n_tokens = runs[0][1].layers[0].get_seq_length() + 1
        votes = {i: rand(1, n_q, n_tokens) for i in range(n_layers)}
        if step % 4 == 3:  # ties: the two lowest scores of a layer equal
            votes[1][..., :2] = 0.0
            for hooks, _ in runs:
                hooks.received[1][..., :2] = 0.0
        for r, (hooks, cache) in enumerate(runs):
            for layer, (k, v) in zip(cache.layers, new):
                layer.update(k, v)
            stats = StatsRecorder(StatsRequest(all_queries=True))
            stats.all_queries = {i: t.clone() for i, t in votes.items()}
            if r == 0:
                hooks._evict_layer = None  # the stacked step must not fall back to it
                hooks.on_decode_step(cache, stats)  # every layer at once
            else:
                Evicting.on_decode_step(hooks, cache, stats)  # layer by layer
        (a, cache_a), (b, cache_b) = runs
        for i in range(n_layers):
            assert torch.equal(a.received[i], b.received[i]), (step, i)
            assert torch.equal(cache_a.layers[i].keys, cache_b.layers[i].keys), (step, i)
            assert torch.equal(cache_a.layers[i].values, cache_b.layers[i].values), (step, i)
    assert runs[0][1].layers[0].get_seq_length() == 20  # held at its size
