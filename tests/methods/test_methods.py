"""Invariants every registered method must satisfy (a new method is tested here for free)."""

import pytest
import torch

from kvbench import KvbenchError
from kvbench.methods import METHODS, Budget, build_method, method_defaults
from kvbench.model.attention import StatsRequest
from tests.conftest import native_method_names

ALL_METHODS = native_method_names()
EVICTING = [n for n in ALL_METHODS if METHODS.get(n).caps.family == "eviction"]


@pytest.mark.parametrize("name", ALL_METHODS)
def test_budget_one_reproduces_full_cache_exactly(name, tiny, tiny_engine, prompt_ids):
    full = tiny_engine.run(build_method("full"), None, prompt_ids, max_new_tokens=8, keep_logits=True)
    params = METHODS.get(name).lossless_params(tiny)
    if params is None:
        pytest.skip(f"{name} has no lossless setting")
    method = build_method(name, params)
    other = tiny_engine.run(method, Budget.parse(1.0), prompt_ids, max_new_tokens=8, keep_logits=True)
    assert other.token_ids == full.token_ids
    assert len(other.logits) == len(full.logits) == 8
    for a, b in zip(other.logits, full.logits):
        assert torch.equal(a, b)
    assert other.kv_bytes == full.kv_bytes == full.kv_bytes_full


@pytest.mark.parametrize("name", EVICTING)
@pytest.mark.parametrize("budget", [0.25, 0.5, 100])
def test_eviction_shrinks_every_layer_to_the_budget(name, budget, tiny_engine, tiny, prompt_ids):
    method = build_method(name)
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    cache = method.compress(prefill.kv, prefill.stats, Budget.parse(budget))
    n_keep = Budget.parse(budget).tokens(len(prompt_ids))
    total = 0
    for layer, (keys, _) in zip(cache.layers, prefill.kv):
        if hasattr(layer, "lengths"):  # ragged heads (adakv): the layer's H_kv · n_keep tokens, stored flat
            assert layer.flat_keys.shape == (sum(layer.lengths), keys.shape[-1]) == layer.flat_values.shape
            total += sum(layer.lengths) // keys.shape[1]
            continue
        assert layer.keys.shape[:2] == keys.shape[:2] and layer.keys.shape[-1] == keys.shape[-1]
        assert layer.keys.shape == layer.values.shape
        assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * layer.keys.element_size()
        total += layer.keys.shape[2]
    assert total == sum(min(n, len(prompt_ids)) for n in method.layer_tokens(n_keep, tiny.n_layers, len(prompt_ids)))
    assert tiny_engine.generate(prefill, method, Budget.parse(budget), [], 4).kv_ratio < 1.0


def test_streamingllm_keeps_exactly_sinks_and_recent(tiny_engine, prompt_ids):
    method = build_method("streamingllm", {"start_size": 4})
    prefill = tiny_engine.prefill(prompt_ids, StatsRequest())
    T = len(prompt_ids)
    cache = method.compress(prefill.kv, prefill.stats, Budget.parse(100))
    keep = list(range(4)) + list(range(T - 96, T))
    for layer, (keys, values) in zip(cache.layers, prefill.kv):
        assert torch.equal(layer.keys, keys[:, :, keep])
        assert torch.equal(layer.values, values[:, :, keep])


def test_streamingllm_cache_stays_constant_while_decoding(tiny_engine, prompt_ids):
    method = build_method("streamingllm")
    gen = tiny_engine.run(method, Budget.parse(64), prompt_ids, max_new_tokens=10)
    assert gen.decode_steps == 9
    # 64 tokens per layer at the end, not 64 + 9: 2 × layers × kv_heads × head_dim × 64 × 4 bytes
    assert gen.kv_bytes == 2 * 4 * 2 * 16 * 64 * 4
    grow = tiny_engine.run(
        build_method("streamingllm", {"evict_during_decode": False}), Budget.parse(64), prompt_ids, max_new_tokens=10
    )
    assert grow.kv_bytes == 2 * 4 * 2 * 16 * (64 + 9) * 4


def test_budget_parsing():
    assert Budget.parse(0.5).tokens(1000) == 500
    assert Budget.parse(1.0).tokens(1000) == 1000
    assert Budget.parse(256).tokens(1000) == 256
    assert Budget.parse(4096).tokens(1000) == 1000
    assert Budget.parse("0.25").tokens(10) == 2  # round(2.5) → banker's rounding 2
    for bad in (0, -0.1, 1.5, "x", float("inf")):
        with pytest.raises(KvbenchError):
            Budget.parse(bad)


def test_too_small_budget_names_the_minimum(tiny_engine, prompt_ids):
    method = build_method("streamingllm", {"start_size": 8})
    prefill = tiny_engine.prefill(prompt_ids, StatsRequest())
    with pytest.raises(KvbenchError, match=r"needs \(9"):
        method.compress(prefill.kv, prefill.stats, Budget.parse(5))


def test_unknown_method_and_parameter_list_valid_ones():
    with pytest.raises(KvbenchError, match="valid methods: .*full.*streamingllm"):
        build_method("nope")
    knobs = ", ".join(sorted(method_defaults("streamingllm")))  # its dataclass's fields, not restated here
    with pytest.raises(KvbenchError, match=f"valid parameters: {knobs}$"):
        build_method("streamingllm", {"window": 3})


def test_method_modules_are_discovered():
    """methods/__init__.py names no method module: every module in the package is imported and registers itself."""
    import pkgutil
    import re
    from pathlib import Path

    import kvbench.methods as package

    modules = {m.name for m in pkgutil.iter_modules(package.__path__)} - {"base", "compression"}  # the interface
    source = Path(package.__file__).read_text()
    assert not [m for m in modules if re.search(rf"\b{m}\b", source)]
    registered = {package.METHODS.get(n).__module__.rsplit(".", 1)[1] for n in package.METHODS.names()}
    assert registered <= modules and {"h2o", "streamingllm", "compose", "kivi"} <= registered
