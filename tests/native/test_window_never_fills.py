"""A sliding layer whose window never fills in a run (Mistral-7B-v0.1's 4,096 below 4K tokens) grows with the context
like a global layer, so a budget compresses it (kvbench.model.layout.CacheLayout.at); a window the run fills stays
the model's own window, whatever the method."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from kvbench.methods import Budget, build_method, method_defaults
from kvbench.model.kv_bytes import KVShape, predict_kv_bytes
from kvbench.model.load import byte_tokenizer, finish
from kvbench.native.engine import Engine
from tests.model.families import BASE

PROMPT, NEW = 400, 4


def mistral(window: int) -> Engine:
    config = tf.MistralConfig(**BASE, num_key_value_heads=2, sliding_window=window)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return Engine(finish(model, byte_tokenizer(), "tiny-mistral", torch.device("cpu"), torch.float32))


def run(engine: Engine, name: str, budget: float | None, suffix: int = 0):
    ids = torch.randint(3, 300, (PROMPT + suffix,), generator=torch.Generator().manual_seed(1)).tolist()
    method = build_method(name, method_defaults(name))
    prefill = engine.prefill(ids[:PROMPT], method.stats_request())
    budget_ = None if budget is None else Budget.parse(budget)
    return engine.generate(prefill, method, budget_, ids[PROMPT:], NEW, keep_logits=True)


@pytest.mark.parametrize("name", ["snapkv", "knorm"])
def test_a_window_longer_than_the_run_is_compressed(name):
    engine = mistral(window=4096)  # every layer typed sliding; the run feeds it 400 + 3 tokens
    gen = run(engine, name, 0.25)
    assert gen.kv_bytes_full == engine.lm.layout.full_bytes(gen.context_tokens + gen.decode_steps)
    # before: kv_ratio 1.0 (every layer kept its window, the whole prompt); now the budget holds
    assert gen.kv_ratio == pytest.approx((PROMPT * 0.25 + gen.decode_steps) / (PROMPT + gen.decode_steps), abs=0.01)
    shape = KVShape.of(engine.lm)
    predicted = predict_kv_bytes(
        build_method(name, method_defaults(name)), Budget(0.25), shape, PROMPT, 0, gen.decode_steps
    )
    assert gen.kv_bytes == predicted.kv_bytes


def test_a_window_the_decoding_fills_stays_a_window():
    # the prompt fits the window's W − 1 = 401 tokens, the prompt + 3 decoded tokens do not: the layer slides here
    engine = mistral(window=PROMPT + 2)
    gen = run(engine, "snapkv", 0.25)
    assert gen.kv_ratio == pytest.approx(1.0)  # every layer keeps its window, as the model's own cache
    full = run(engine, "full", None)
    assert gen.token_ids == full.token_ids


def test_an_appended_question_counts_toward_the_window():
    engine = mistral(window=PROMPT + 10)  # the prompt fits, prompt + a 20-token question does not
    gen = run(engine, "snapkv", 0.25, suffix=20)
    assert gen.kv_ratio == pytest.approx(1.0)
    alone = run(mistral(window=4096), "snapkv", 0.25, suffix=20)
    assert alone.kv_ratio < 0.5


def test_a_compressed_long_window_at_budget_one_is_the_full_cache():
    engine = mistral(window=4096)
    full, kept = run(engine, "full", None), run(engine, "snapkv", 1.0)
    assert kept.token_ids == full.token_ids and kept.kv_bytes == full.kv_bytes
    assert torch.allclose(torch.stack(kept.logits), torch.stack(full.logits), atol=1e-5)
