"""Layer kinds the first layout did not know, to the byte of transformers' own DynamicCache: layers reusing another
layer's K/V (Gemma 3n, Gemma 4: `kv_sharing_modes` "reuse") cache nothing, DeepSeek-V3.2's indexed layers cache one
indexer key per token beside the latent, Gemma 4's global layers have their own head_dim; and a sliding layer whose
window never fills this run is typed global (`CacheLayout.at`) with unchanged bytes."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

from kvbench import KvbenchError
from kvbench.model.layout import cache_layout, caches_latent
from kvbench.model.load import cache_kwarg
from tests.model.families import BASE, FAMILIES, MLA, SHARED_KV, WINDOW, build

PROMPT, DECODE = 80, 3
# the layouts these tests hold are transformers 5.24's (5.2, kvpress's venv, lays Gemma 3n and DeepSeek-V3.2 out
# otherwise)
BEFORE_5_24 = tuple(int(p) for p in tf.__version__.split(".")[:2]) < (5, 24)


def held_bytes(cache) -> int:
    """nbytes of every tensor the cache's layers hold (K, V and DeepSeek-V3.2's indexer keys)."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "indexer_keys"):
            tensor = getattr(layer, name, None)
            total += tensor.nbytes if isinstance(tensor, torch.Tensor) else 0
    return total


def own_cache_bytes(model, tokens: int, decode: int) -> int:
    cache, kwarg = DynamicCache(config=model.config), cache_kwarg(model)
    ids = torch.randint(3, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model(input_ids=ids, **{kwarg: cache}, use_cache=True, logits_to_keep=1)
        for _ in range(decode):
            out = model(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), **{kwarg: cache}, use_cache=True)
    return held_bytes(cache)


SMALL = {**BASE, "num_hidden_layers": 6, "num_key_value_heads": 2}  # (DeepSeek-V3.2 below)
CONFIGS = {
    **SHARED_KV,  # Gemma 3n, Gemma 4: the last 2 of 6 layers reuse earlier layers' K/V
    "deepseek-v32": lambda: tf.AutoConfig.for_model(  # latent + one indexer key of 16 per token and layer
        "deepseek_v32", **{**BASE, "num_hidden_layers": 2}, **MLA, index_head_dim=16, index_n_heads=2, index_topk=16
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_full_bytes_equal_transformers_own_cache(name):
    try:
        config = CONFIGS[name]()
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config).eval()
    except (TypeError, ValueError, KeyError) as error:  # this transformers has no such class or knob
        pytest.skip(f"{name} not buildable on transformers {tf.__version__}: {error}")
    layout = cache_layout(model.config, torch.float32)
    if name == "gemma3n" and tuple(int(p) for p in tf.__version__.split(".")[:2]) < (5, 24):
        # transformers 5.2 (kvpress's venv) lays Gemma 3n's cache out otherwise (69,632 bytes here vs 107,008):
        # the layout follows 5.24's; the planner's Gemma 3n figures hold for transformers >= 5.24 only
        pytest.xfail(f"Gemma 3n's cache on transformers {tf.__version__} differs from the layout's (5.24's)")
    assert layout.full_bytes(PROMPT + DECODE) == own_cache_bytes(model, PROMPT, DECODE)
    if name in ("gemma3n", "gemma4"):
        assert layout.kinds[-2:] == ("shared", "shared")  # before: counted as caching layers
    if name == "gemma4":  # before: transformers' AmbiguousGlobalPerLayerAttributeError on config.head_dim
        assert layout.layers[3].key_width == 2 * 32 and layout.layers[0].key_width == 2 * 16
    if name == "deepseek-v32" and caches_latent(config):
        assert layout.layers[0].extra_width == 16  # before: the indexer keys were left out


def test_a_window_that_never_fills_is_global_at_this_context():
    mistral = cache_layout(FAMILIES["mistral"](), torch.float32)  # every layer slides, W = 64
    short, long = mistral.at(WINDOW - 1), mistral.at(WINDOW)
    assert short.kinds == ("global",) * 4 and long.kinds == ("sliding",) * 4
    for tokens in (1, 30, WINDOW - 1):  # the bytes the model's own cache holds are unchanged
        assert short.full_bytes(tokens) == mistral.full_bytes(tokens)
    assert short.growing_share(WINDOW - 1) == 1.0 and mistral.growing_share(WINDOW - 1) == 0.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sliding_window": 1}, "sliding_window=1 for a sliding_attention layer"),
        ({"num_hidden_layers": 2**40}, "num_hidden_layers=1099511627776 is beyond 4096"),
    ],
)
def test_degenerate_configs_are_one_line(fields, message):
    config = tf.MistralConfig(**{**BASE, "num_key_value_heads": 2, "sliding_window": WINDOW})
    for key, value in fields.items():
        config.__dict__[key] = value  # past transformers' own validation, as a hand-written file reaches it
    with pytest.raises(KvbenchError, match=message):
        cache_layout(config, torch.float32)


@pytest.mark.skipif(BEFORE_5_24, reason=f"the layout is transformers 5.24's, this is {tf.__version__}")
@pytest.mark.parametrize("name", sorted(SHARED_KV))
def test_kv_shared_layers_run_their_full_cache_exactly_and_refuse_compression(name):
    """Gemma 3n and Gemma 4 reuse earlier layers' K/V in their last layers: the full cache decodes as transformers'
    own generate and holds its bytes; compression is refused in one line (kvbench.preflight.support)."""
    from kvbench.methods import build_method
    from kvbench.model.load import byte_tokenizer, finish
    from kvbench.native.engine import Engine
    from kvbench.preflight.support import refusal

    model = build(name)
    lm = finish(model, byte_tokenizer(), name, torch.device("cpu"), torch.float32)
    ids = torch.randint(3, 300, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    engine, full = Engine(lm), build_method("full")
    gen = engine.generate(engine.prefill(ids, full.stats_request()), full, None, [], DECODE + 1)
    hf = model.generate(torch.tensor([ids]), max_new_tokens=DECODE + 1, min_new_tokens=DECODE + 1, do_sample=False)
    assert gen.token_ids == hf[0, PROMPT:].tolist()
    assert gen.kv_bytes == gen.kv_bytes_full == own_cache_bytes(model, PROMPT, DECODE)
    assert refusal(full, model.config) is None
    reason = refusal(build_method("snapkv"), model.config)
    assert reason is not None and "\n" not in reason and "reuse an earlier layer's K/V" in reason


@pytest.mark.skipif(BEFORE_5_24, reason=f"the layout is transformers 5.24's, this is {tf.__version__}")
def test_deepseek_v32_is_refused_in_one_line_and_planned():
    from kvbench.methods import build_method
    from kvbench.preflight.support import refusal

    config = CONFIGS["deepseek-v32"]()
    reason = refusal(build_method("full"), config)
    assert reason is not None and "\n" not in reason and "DSA indexer" in reason
    assert cache_layout(config, torch.float32).full_bytes(100) > 0  # the planner's view still holds
