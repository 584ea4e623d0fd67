"""Composition: structure × eviction × precision; ratios multiply, bad stacks are refused."""

import pytest

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method


def _run(engine, prompt_ids, name, params=None, budget=None):
    return engine.run(
        build_method(name, params or {}), Budget.parse(budget) if budget else None, prompt_ids, max_new_tokens=4
    )


@pytest.mark.parametrize(
    "stack,parts",
    [
        (
            ["snapkv", "kivi"],
            [
                ("snapkv", {"window_size": 16}, 0.25),
                ("kivi", {"bits": 4, "group_size": 16, "residual_length": 16}, None),
            ],
        ),
        (
            ["headmerge", "h2o", "kivi"],
            [
                ("headmerge", {"kv_heads": 1}, None),
                ("h2o", {}, 0.25),
                ("kivi", {"bits": 2, "group_size": 16, "residual_length": 16}, None),
            ],
        ),
    ],
)
def test_composed_ratio_is_about_the_product(tiny_engine, prompt_ids, stack, parts):
    overrides = {name: params for name, params, _ in parts}
    composed = _run(tiny_engine, prompt_ids, "compose", {"stack": stack, "overrides": overrides}, 0.25)
    product = 1.0
    for name, params, budget in parts:
        product *= _run(tiny_engine, prompt_ids, name, params, budget).kv_ratio
    # not exactly the product: KIVI's full-precision residual is a fixed number of tokens, a larger share of
    # an evicted cache (here 16 of ~135 tokens) than of the full one; and H2O's decode-time evictions inside a
    # quantized key group stay stored (dead) until the whole group is evicted, since KIVI never re-quantizes
    assert composed.kv_ratio == pytest.approx(product, rel=0.3)
    assert composed.kv_ratio < min(_run(tiny_engine, prompt_ids, n, p, b).kv_ratio for n, p, b in parts)


def test_order_of_the_stack_does_not_matter(tiny_engine, prompt_ids):
    a = build_method("compose", {"stack": ["kivi", "snapkv"]})
    b = build_method("compose", {"stack": ["snapkv", "kivi"]})
    assert a.params()["stack"] == b.params()["stack"] == ["snapkv", "kivi"]


@pytest.mark.parametrize(
    "params,match",
    [
        ({"stack": ["snapkv", "h2o"]}, "snapkv and h2o are both eviction methods"),
        ({"stack": ["kivi", "hf-quant"]}, "both precision methods"),
        ({"stack": ["full", "kivi"]}, "cannot be stacked"),
        ({"stack": ["snapkv"], "overrides": {"kivi": {"bits": 2}}}, "not in stack"),
        ({"stack": ["streamingllm", "kivi"], "overrides": {"streamingllm": {"positions": "rolling"}}}, "rolling"),
        ({"stack": ["nope"]}, "valid methods"),
    ],
)
def test_bad_stacks(params, match):
    with pytest.raises(KvbenchError, match=match):
        build_method("compose", params)


def test_budget_only_with_an_eviction_part():
    assert build_method("compose", {"stack": ["snapkv", "kivi"]}).caps.has_budget
    assert not build_method("compose", {"stack": ["headmerge", "kivi"]}).caps.has_budget
    assert not build_method("compose", {"stack": ["headmerge"]}).caps.shares_prefill
