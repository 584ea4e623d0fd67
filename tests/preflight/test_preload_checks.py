"""What the configuration and the model's config decide is refused before the model loads
(kvbench.preflight.entrance.check_run, exit 2), not after the baseline is computed: a token budget below a method's
minimum, head merging to a count that does not divide the model's KV heads."""

from __future__ import annotations

import pytest

from kvbench import KvbenchError
from kvbench.preflight.entrance import check_run
from kvbench.run import runner
from tests.conftest import compose_config, tiny_overrides

CASES = [
    (["method=snapkv", "budget=16"], "budget=16 tokens is fewer than snapkv keeps at least (33"),
    (["grid.method=[streamingllm,snapkv]", "grid.budget=[8]"], "fewer than snapkv keeps at least (33"),
    (["method=adakv", "budget=20"], "fewer than adakv keeps at least (33"),
    (["method=streamingllm", "budget=3"], "fewer than streamingllm keeps at least (5"),
    (["method=compose", "method.stack=[snapkv,kivi]", "budget=10"], "fewer than snapkv keeps at least (33"),
    (["method=headmerge", "method.kv_heads=3"], "headmerge kv_heads=3 does not divide Llama's 2 KV heads"),
    (["method=headmerge", "method.kv_heads=4"], "give method.kv_heads= one of 1, 2"),
    (["method=headmerge", "method.kv_heads=0"], "method.kv_heads=0 must be ≥ 1"),
    (
        ["method=compose", "method.stack=[headmerge,snapkv]", "+method.overrides.headmerge.kv_heads=4"],
        "headmerge kv_heads=4 does not divide",
    ),
    # token counts: at most 2^24 without a model, at most the model's context (tiny-random: 16,384) with one
    (["method=expected_attention", "method.n_future_positions=1000000000"], "must be ≤ 16777216"),
    (["method=expected_attention", "method.n_future_positions=100000"], "beyond Llama's context of 16,384 tokens"),
    (["method=h2o", "method.evict_every=1000000000"], "method.evict_every=1000000000 must be ≤ 16777216"),
    (["method=h2o", "method.evict_every=20000"], "h2o evict_every=20,000 is beyond Llama's context"),
    (["method=decoding", "method.decode_budget=20000"], "decoding decode_budget=20,000 is beyond"),
    (["method=streamingllm", "method.start_size=20000"], "streamingllm start_size=20,000 is beyond"),
    (
        ["method=adakv", "method.scorer=expected_attention", "+method.scorer_params.n_future_positions=20000"],
        "expected_attention n_future_positions=20,000 is beyond",
    ),
]


@pytest.mark.parametrize("overrides,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_refused_before_the_model_loads(tmp_path, monkeypatch, overrides, message):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(runner, "load_model", no_load)
    cfg = compose_config(*tiny_overrides(tmp_path, *overrides))
    with pytest.raises(KvbenchError) as error:
        runner.run(cfg, tmp_path / "out")
    assert message in str(error.value) and error.value.exit_code == 2


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=snapkv", "budget=33"],
        ["method=snapkv", "budget=0.01"],  # a fraction keeps the minimum on a short prompt
        ["method=headmerge", "method.kv_heads=2"],
        ["method=kivi", "method.group_size=16"],
    ],
)
def test_what_runs_passes(tmp_path, overrides):
    check_run(compose_config(*tiny_overrides(tmp_path, *overrides)))


def test_limit_builds_only_the_examples_it_takes(tmp_path, monkeypatch):
    from kvbench.tasks.longgen import LongGeneration

    built = []
    real = LongGeneration._example

    def counted(self, length, index):
        built.append(index)
        return real(self, length, index)

    monkeypatch.setattr(LongGeneration, "_example", counted)
    overrides = [
        "model=tiny-random",
        "device=cpu",
        "dtype=float32",
        f"results_dir={tmp_path / 'store'}",
        "report=false",
    ]
    overrides += ["task=longgen", "task.trace_tokens=[16]", "task.n_facts=1000", "limit=1", "task.max_new_tokens=2"]
    rows = runner.run(compose_config(*overrides), tmp_path / "out")
    assert built == [0]  # before: all 1,000 facts were built, then cut to one
    assert rows.example_id.nunique() == 1


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["task=niah", "task.value_length=1000000000"], "does not fit the shortest context of 1,024 tokens"),
        (["task=longgen", "task.value_length=10000"], "task.value_length=10,000 is beyond 4,096"),
        (["task=shared_doc", "task.value_length=5000"], "does not fit the shortest context of 2,048 tokens"),
    ],
)
def test_a_needle_value_is_bounded_by_its_haystack(overrides, message):
    with pytest.raises(KvbenchError, match=message):  # before: a billion-digit value built (a hang), or a traceback
        check_run(compose_config("model=tiny-random", "device=cpu", *overrides))
