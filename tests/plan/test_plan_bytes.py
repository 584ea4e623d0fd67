"""The planner's byte accounting (kvbench.model.kv_bytes) predicts exactly the kv_bytes the engine measures."""

import pytest
import torch

from kvbench.methods import METHODS, Budget, build_method, method_defaults
from kvbench.model.kv_bytes import OPAQUE_TOLERANCE, KVShape, predict_kv_bytes
from tests.conftest import native_method_names

# knob settings for methods that take no budget (two each); methods with a budget run at two budgets
TINY_SETTINGS = {  # tiny-random: head_dim 16, so groups of 16
    "kivi": [{"bits": 2, "group_size": 16, "residual_length": 32}, {"bits": 4, "group_size": 8, "residual_length": 16}],
    "headmerge": [{"kv_heads": 1}, {"kv_heads": 2}],
    "hf-quant": [{"nbits": 2, "q_group_size": 16, "residual_length": 4}, {"nbits": 4, "q_group_size": 16}],
    "decoding": [{"compress_every": 3, "decode_budget": 100}, {"compress_every": 4, "decode_budget": 500}],
    "compose": [
        {"stack": ["snapkv", "kivi"], "overrides": {"kivi": {"group_size": 16, "residual_length": 32}}},
        {"stack": ["headmerge", "h2o", "kivi"], "overrides": {"kivi": {"group_size": 16, "residual_length": 16}}},
    ],
}
REAL_SETTINGS = {
    "kivi": [{"bits": 2}, {"bits": 4}],
    "headmerge": [{"kv_heads": 1}, {"kv_heads": 3}],
    "decoding": [{"compress_every": 2, "decode_budget": 40}, {}],
    "hf-quant": [{"nbits": 2}, {"nbits": 4}],
    "compose": [{"stack": ["snapkv", "kivi"]}, {"stack": ["headmerge", "h2o", "kivi"]}],
}


def cases(settings: dict, budgets=(0.25, 0.5)):
    for name in native_method_names():  # the planner does not predict kvpress's presses
        for i, params in enumerate(settings.get(name, [{}, {}])):
            yield pytest.param(name, params, budgets[i], id=f"{name}-{i}")


def check(engine, lm, name, params, budget, prompt_ids, suffix_ids=(), max_new_tokens=8):
    method = build_method(name, {**method_defaults(name), **params})
    budget = Budget.parse(budget) if method.caps.has_budget else None
    gen = engine.run(method, budget, prompt_ids, suffix_ids, max_new_tokens=max_new_tokens)
    shape = KVShape(lm.n_layers, lm.n_kv_heads, lm.head_dim, lm.dtype)
    predicted = predict_kv_bytes(method, budget, shape, len(prompt_ids), len(suffix_ids), gen.decode_steps)
    if predicted.bound:  # decode-time eviction on KIVI: an upper bound (dead tokens of live key groups stay)
        assert gen.kv_bytes <= predicted.kv_bytes
    elif predicted.exact:
        assert predicted.kv_bytes == gen.kv_bytes
    else:
        assert abs(predicted.kv_bytes - gen.kv_bytes) <= OPAQUE_TOLERANCE * gen.kv_bytes
    return predicted, gen


@pytest.mark.parametrize("name,params,budget", list(cases(TINY_SETTINGS)))
def test_predicted_bytes_equal_measured(name, params, budget, tiny_engine, tiny, prompt_ids):
    predicted, gen = check(tiny_engine, tiny, name, params, budget, prompt_ids)
    assert gen.decode_steps > 0  # the decoded tokens are part of the accounting


@pytest.mark.parametrize("name", ["snapkv", "h2o", "streamingllm", "kivi", "compose"])
def test_appended_question_is_accounted(name, tiny_engine, tiny, prompt_ids):
    params = TINY_SETTINGS.get(name, [{}])[0]
    check(tiny_engine, tiny, name, params, 0.25, prompt_ids[:400], prompt_ids[400:437])


def test_pyramidkv_counts_differ_per_layer(tiny):
    method = build_method("pyramidkv", {"window_size": 8})
    shape = KVShape(tiny.n_layers, tiny.n_kv_heads, tiny.head_dim, tiny.dtype)
    predicted = predict_kv_bytes(method, Budget.parse(0.25), shape, 540)
    assert list(predicted.layer_tokens) == sorted(predicted.layer_tokens, reverse=True)  # falling linearly
    assert len(set(predicted.layer_tokens)) == tiny.n_layers
    assert abs(sum(predicted.layer_tokens) - tiny.n_layers * 135) <= tiny.n_layers  # ≈ uniform's total (rounding)


def test_seed_worked_example():
    """Seed #307: 40 layers, 8 KV heads, head_dim 128, fp16 — ≈ 5.4 GB at 32K, 21.5 GB at 128K, 172 GB for 8
    requests at 128K (decimal GB: 2 × 32768 × 40 × 8 × 128 × 2 = 5,368,709,120 bytes)."""
    shape = KVShape(40, 8, 128, torch.float16)
    full = build_method("full")
    assert shape.bytes_per_token == 163_840
    at_32k = predict_kv_bytes(full, None, shape, 32 * 1024).kv_bytes
    at_128k = predict_kv_bytes(full, None, shape, 128 * 1024).kv_bytes
    eight = predict_kv_bytes(full, None, shape, 128 * 1024, batch=8).kv_bytes
    assert at_32k == 5_368_709_120 and round(at_32k / 1e9, 1) == 5.4
    assert at_128k == 21_474_836_480 and round(at_128k / 1e9, 1) == 21.5
    assert eight == 8 * at_128k and round(eight / 1e9) == 172


@pytest.mark.real_model
def test_predicted_bytes_equal_measured_on_the_bundled_model():
    """Every registered method at two settings on SmolLM2-135M (bf16): one shared prefill, as a grid run does."""
    from omegaconf import OmegaConf

    from kvbench.model.attention import StatsRequest
    from kvbench.model.load import load_model
    from kvbench.native.engine import Engine
    from tests.conftest import CONF_DIR

    lm = load_model(OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml"), "cpu", "bfloat16")
    engine = Engine(lm)
    prompt_ids = lm.tokenizer("Write one line about the sea. " + "The tide comes in and goes out. " * 20)["input_ids"]
    shape = KVShape(lm.n_layers, lm.n_kv_heads, lm.head_dim, lm.dtype)
    configs = []
    for case in cases(REAL_SETTINGS):
        name, params, budget = case.values
        method = build_method(name, {**method_defaults(name), **params})
        configs.append((method, Budget.parse(budget) if method.caps.has_budget else None))
    request = StatsRequest()
    for method, _ in configs:
        request = request | method.stats_request()
    shared = engine.prefill(prompt_ids, request)
    for method, budget in configs:
        own = engine if method.caps.shares_prefill else engine.prepared(method)
        prefill = shared if method.caps.shares_prefill else own.prefill(prompt_ids, method.stats_request())
        gen = own.generate(prefill, method, budget, [], 4)
        predicted = predict_kv_bytes(method, budget, shape, len(prompt_ids), 0, gen.decode_steps)
        tolerance = 0 if predicted.exact else OPAQUE_TOLERANCE * gen.kv_bytes
        if predicted.bound:
            assert gen.kv_bytes <= predicted.kv_bytes, (method.name, method.params(), budget)
            continue
        assert abs(predicted.kv_bytes - gen.kv_bytes) <= tolerance, (method.name, method.params(), budget)


@pytest.mark.parametrize(
    "name,params",
    [
        ("h2o", {}),
        ("h2o", {"evict_every": 4}),
        ("streamingllm", {}),
        ("streamingllm", {"evict_every": 3}),
        ("streamingllm", {"ring": True}),
        ("tova", {}),
    ],
)
@pytest.mark.parametrize("budget", ["44", "60"])
def test_absolute_budget_above_the_prompt_is_held_while_decoding(name, params, budget, tiny_engine, tiny, prompt_ids):
    """Nothing is evicted at prefill (budget ≥ the 40-token prompt), then H2O/StreamingLLM hold the cache at the
    budget once decoding reaches it (TOVA grows: it evicts only after compressing); the planner predicts each."""
    eos_ids, tiny_engine.eos_ids = tiny_engine.eos_ids, set()  # decode every step: 30 go past both budgets
    try:
        _, gen = check(tiny_engine, tiny, name, params, budget, prompt_ids[:40], max_new_tokens=30)
    finally:
        tiny_engine.eos_ids = eos_ids  # a session-wide engine
    assert gen.decode_steps >= 25
    grows = name == "tova" or 40 + gen.decode_steps <= int(budget)
    per_token = tiny.n_layers * 2 * tiny.n_kv_heads * tiny.head_dim * torch.finfo(tiny.dtype).bits // 8
    assert (gen.kv_bytes // per_token > int(budget) + 3) == grows
