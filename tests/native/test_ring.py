"""StreamingLLM ring=true (kvbench/model/ring.py): the same tokens as per-step eviction, held in place, size + 1 slots."""

from dataclasses import replace

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method
from kvbench.methods.streamingllm import sink_and_recent
from kvbench.model.attention import recording
from kvbench.model.cache import full_cache_nbytes
from kvbench.model.kv_bytes import KVShape, predict_kv_bytes
from kvbench.model.ring import RingLayer
from kvbench.native.engine import Engine


@pytest.fixture(scope="module")
def engine(tiny):
    engine = Engine(tiny)
    engine.eos_ids = set()  # always max_new_tokens
    return engine


def streaming(ring: bool, **knobs):
    return build_method("streamingllm", {"ring": ring, **knobs})


def assert_same_decoding(ring, per_step, tolerance=1e-5):
    assert ring.token_ids == per_step.token_ids and ring.decode_steps == per_step.decode_steps
    assert len(ring.logits) == len(per_step.logits)
    for step, (a, b) in enumerate(zip(ring.logits, per_step.logits)):
        assert float((a - b).abs().max()) <= tolerance, step


# (start_size, budget, prompt tokens, new tokens): windows of 12-60 slots wrapped 2-9 times; prompts longer than
# the budget (evicted at prefill) and shorter (the layers grow to the budget while decoding, then ring)
CASES = [(4, 16, 100, 80), (1, 24, 60, 90), (0, 10, 40, 60), (8, 0.25, 540, 120), (4, 48, 30, 100)]


@pytest.mark.parametrize("start_size,budget,n_prompt,n_new", CASES)
def test_ring_decodes_the_tokens_of_per_step_eviction(engine, prompt_ids, start_size, budget, n_prompt, n_new):
    ids, budget = prompt_ids[:n_prompt], Budget.parse(budget)
    per_step = engine.run(streaming(False, start_size=start_size), budget, ids, max_new_tokens=n_new, keep_logits=True)
    ring = engine.run(streaming(True, start_size=start_size), budget, ids, max_new_tokens=n_new, keep_logits=True)
    assert_same_decoding(ring, per_step)
    lm, size = engine.lm, int(budget.value) if budget.is_tokens else budget.tokens(n_prompt)
    per_token = full_cache_nbytes(lm.n_layers, lm.n_kv_heads, lm.head_dim, 1, lm.dtype)
    assert per_step.kv_bytes == size * per_token  # per-step eviction holds the budget
    assert ring.kv_bytes == (size + 1) * per_token  # the ring: the budget + the slot written next
    shape = KVShape(lm.n_layers, lm.n_kv_heads, lm.head_dim, lm.dtype)
    if n_prompt > size:  # the planner's exact rule (a budget above the prompt is not modelled there)
        predicted = predict_kv_bytes(streaming(True, start_size=start_size), budget, shape, n_prompt, 0, n_new - 1)
        assert predicted.exact and predicted.kv_bytes == ring.kv_bytes and set(predicted.layer_tokens) == {size + 1}
        plain = predict_kv_bytes(streaming(False, start_size=start_size), budget, shape, n_prompt, 0, n_new - 1)
        assert plain.kv_bytes == per_step.kv_bytes


@pytest.mark.parametrize("start_size,budget,n_prompt", [(4, 16, 100), (2, 40, 30)])
def test_ring_holds_streamingllms_positions_and_keys_at_every_step(engine, prompt_ids, start_size, budget, n_prompt):
    """Engine.decode's loop, both methods fed the same tokens: after every step each ring layer holds exactly the
    sinks + the most recent tokens, and their keys/values are per-step eviction's (in position order)."""
    ids = prompt_ids[:n_prompt]
    methods = [streaming(False, start_size=start_size), streaming(True, start_size=start_size)]
    starts = []
    for method in methods:
        prefill = engine.prefill(ids, method.stats_request())
        starts.append(engine.compressed(prefill, method, Budget.parse(budget), []))
        starts[-1].hooks.on_decode_start(starts[-1].cache, n_prompt)
    caches = [start.cache for start in starts]
    token, rings = ids[-1], 0
    for position in range(n_prompt, n_prompt + 3 * budget):
        for start, cache in zip(starts, caches):
            with recording(start.hooks.decode_request()) as stats:
                logits = engine.forward([token], [position], cache)[-1]
            start.hooks.on_decode_step(cache, stats)
        token = int(logits.argmax())
        for plain, layer in zip(caches[0].layers, caches[1].layers):
            if not isinstance(layer, RingLayer):
                assert type(layer) is DynamicLayer and layer.get_seq_length() < budget  # still growing
                continue
            rings += 1
            held = sink_and_recent(position + 1, start_size, budget, layer.keys)[0, 0].tolist()
            assert layer.held_positions() == held and layer.get_seq_length() == plain.get_seq_length() == budget
            order = sorted(range(budget + 1), key=lambda slot: layer.positions[slot])  # slots by position
            live = [slot for slot in order if slot != layer._next]
            torch.testing.assert_close(layer.keys[:, :, live], plain.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(layer.values[:, :, live], plain.values, rtol=1e-5, atol=1e-5)
    assert rings > 2 * budget * engine.lm.n_layers  # checked while wrapping, on every layer


@pytest.mark.parametrize("chunk", [None, 64])
def test_ring_after_inline_prefill_and_prefill_chunk(engine, prompt_ids, chunk):
    from kvbench.native import inline

    budget = Budget.parse(0.2)
    runs = []
    for ring in (False, True):
        method = streaming(ring)
        prefill = inline.prefill(engine, method, budget, prompt_ids[:300], chunk)
        runs.append(engine.generate(prefill, method, budget, [], 70, keep_logits=True))
        assert all(isinstance(layer, RingLayer) == ring for layer in prefill.compressed.layers)  # what was decoded
    assert_same_decoding(runs[1], runs[0])
    assert runs[1].kv_bytes - runs[0].kv_bytes == full_cache_nbytes(
        engine.lm.n_layers, engine.lm.n_kv_heads, engine.lm.head_dim, 1, engine.lm.dtype
    )


def test_ring_with_an_appended_question(engine, prompt_ids):
    """query_aware=false: the suffix (appended in one forward after compression) grows the size; then the ring."""
    budget, suffix = Budget.parse(32), prompt_ids[200:215]
    runs = []
    for ring in (False, True):
        method = streaming(ring)
        prefill = engine.prefill(prompt_ids[:150], method.stats_request())
        start = engine.compressed(prefill, method, budget, suffix)
        assert all(type(layer) is DynamicLayer for layer in start.cache.layers)  # no ring before decoding
        runs.append((engine.decode(start, method, 60, keep_logits=True), start.cache))
    assert_same_decoding(runs[1][0], runs[0][0])
    assert all(type(layer) is RingLayer and layer.get_seq_length() == 32 + 15 for layer in runs[1][1].layers)


def test_batched_examples_ring_like_each_alone(engine, tiny):
    """batch_size > 1 (kvbench.native.batched): the rows' layers ring together, each row equal to its one-by-one run."""
    from kvbench.native.batched import run_batch

    texts = ["The quick brown fox jumps over the lazy dog. ", "Pack my box with five dozen liquor jugs!!!!! "]
    prompts = [tiny.tokenizer(text * 4)["input_ids"] for text in texts]  # equal token counts: one batch
    budget = Budget.parse(24)
    rows = run_batch(engine, streaming(True), budget, prompts, max_new_tokens=50, keep_logits=True)
    for prompt, row in zip(prompts, rows):
        alone = engine.run(streaming(True), budget, prompt, max_new_tokens=50, keep_logits=True)
        assert_same_decoding(row, alone, tolerance=1e-4)
        per_token = full_cache_nbytes(tiny.n_layers, tiny.n_kv_heads, tiny.head_dim, 1, tiny.dtype)
        assert row.kv_bytes == alone.kv_bytes == 25 * per_token  # the budget + the ring's slot written next


def test_budget_one_never_rings(engine, prompt_ids):
    full = engine.run(build_method("full"), None, prompt_ids[:80], max_new_tokens=20, keep_logits=True)
    method = streaming(True)
    prefill = engine.prefill(prompt_ids[:80], method.stats_request())
    start = engine.compressed(prefill, method, Budget.parse(1.0), [])
    gen = engine.decode(start, method, 20, keep_logits=True)
    assert all(type(layer) is DynamicLayer for layer in start.cache.layers)
    assert gen.token_ids == full.token_ids and gen.kv_bytes == full.kv_bytes
    assert all(torch.equal(a, b) for a, b in zip(gen.logits, full.logits))


def test_paged_prefix_layers_keep_per_step_eviction(engine, prompt_ids):
    """Prefix caching: layers over shared pages (nothing evicted at prefill) are not plain tensors: no ring."""
    from kvbench.native.prefix_cache import PagedLayer, PrefixCache, page_of, share_pages

    ids, budget = prompt_ids[:64], Budget.parse(80)  # ≥ the prompt: the pages stay shared until the budget
    runs = []
    for ring in (False, True):
        method = streaming(ring)
        prefill = engine.prefill(ids, method.stats_request())
        kv = prefill.kv
        pages = PrefixCache(page_size=16).insert(ids, lambda i, kv=kv: page_of(kv, 16 * i, 16 * i + 16))
        prefill = replace(prefill, adopt=lambda cache, kv=kv, pages=pages: share_pages(cache, kv, pages))
        start = engine.compressed(prefill, method, budget, [])
        runs.append(engine.decode(start, method, 40, keep_logits=True))
        assert all(type(layer) is PagedLayer for layer in start.cache.layers)
    assert_same_decoding(runs[1], runs[0], tolerance=0.0)
    assert runs[1].kv_bytes == runs[0].kv_bytes


def test_grid_rows_with_a_ring_decode_alone(engine, prompt_ids):
    from kvbench.native.grid_decode import decodes_in_grid

    for ring in (False, True):
        method = streaming(ring)
        prefill = engine.prefill(prompt_ids[:100], method.stats_request())
        start = engine.compressed(prefill, method, Budget.parse(0.3), [])
        assert decodes_in_grid(method, start) is not ring


@pytest.mark.parametrize(
    "knobs,match",
    [
        ({"positions": "rolling"}, "needs positions=absolute"),
        ({"evict_every": 8}, "evict_every=1"),
        ({"evict_during_decode": False}, "evict_during_decode=true"),
    ],
)
def test_ring_refuses_what_it_cannot_hold(knobs, match):
    with pytest.raises(KvbenchError, match=match):
        streaming(True, **knobs)


def test_compose_refuses_a_ring():
    with pytest.raises(KvbenchError, match="ring=true without compose"):
        build_method("compose", {"stack": ["streamingllm", "kivi"], "overrides": {"streamingllm": {"ring": True}}})


def test_ring_layer_takes_one_token_per_forward():
    layer = RingLayer(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), 2, list(range(6)))  # (B, H_kv, T, D)
    with pytest.raises(KvbenchError, match="one token per forward"):
        layer.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    keys, _ = layer.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert keys.shape == (1, 2, 7, 4) and keys is layer.keys and torch.equal(keys[:, :, 6], torch.ones(1, 2, 4))
    assert layer.held_positions() == [0, 1, 3, 4, 5, 6]  # slot 2 (position 2) is next: dropped after this step
    layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))  # over position 2, in place
    assert layer.positions == [0, 1, 7, 3, 4, 5, 6] and layer.held_positions() == [0, 1, 4, 5, 6, 7]
    assert keys.data_ptr() == layer.keys.data_ptr()  # no new storage
