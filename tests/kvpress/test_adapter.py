"""method=kvpress: press specs checked before the model loads, and what a press physically holds on the bundled
model — gathered presses hold their ratio, head-wise (masking) presses the full cache while claiming the ratio."""

import pytest

from tests.kvpress.conftest import NO_KVPRESS

pytest.importorskip("kvpress", reason=NO_KVPRESS)

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method
from kvbench.methods.kvpress import compression_ratio
from kvbench.model.attention import ATTN_IMPLEMENTATION
from tests.conftest import compose_config, tiny_overrides

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize(
    ("press", "kwargs", "message"),
    [
        ("SnapKvPress", {}, "kvpress has no press 'SnapKvPress'; did you mean SnapKVPress"),
        (
            "SnapKVPress",
            {"window": 64},
            "SnapKVPress has no field 'window'; its fields: compression_ratio, window_size",
        ),
        ({"name": "AdaKVPress"}, {}, "AdaKVPress needs press (a press)"),
        ({"name": "AdaKVPress", "press": "KVzipPress"}, {}, "kvpress refuses AdaKVPress"),
        ({"name": "AdaKVPress", "press": "SnapKVPress"}, {"alpha_safeguard": 2.0}, "alpha_safeguard should be in"),
        (3, {}, "give a kvpress class name"),
    ],
)
def test_bad_press_specs_are_one_line_each(press, kwargs, message):
    with pytest.raises(KvbenchError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        build_method("kvpress", {"press": press, "press_kwargs": kwargs})
    assert "\n" not in str(error.value)


def test_a_bad_press_exits_2_before_the_model_loads(tmp_path, monkeypatch):
    """The whole command: validated when the configurations are built (kvbench.preflight.entrance.check_run)."""
    from kvbench.preflight.entrance import check_run

    cfg = compose_config(*tiny_overrides(tmp_path, "method=kvpress", "method.press=NoSuchPress"))
    with pytest.raises(KvbenchError, match="kvpress has no press 'NoSuchPress'"):
        check_run(cfg)
    cfg = compose_config(*tiny_overrides(tmp_path, "method=kvpress", "prefill=inline"))
    with pytest.raises(KvbenchError, match=r"method=kvpress \(kvpress's hooks\) does not combine with prefill=inline: .*inside its own prefill"):
        check_run(cfg)


def test_budget_maps_to_compression_ratio():
    assert compression_ratio(Budget(0.25), 301) == 0.75
    assert int(301 * (1 - compression_ratio(Budget(75), 301))) == 75  # a token count survives kvpress's int()
    assert (
        build_method("kvpress", {"press": {"name": "DecodingPress", "base_press": "KnormPress"}}).caps.has_budget
        is False
    )


@pytest.mark.parametrize(
    ("press", "held_in_full"),
    [
        ("SnapKVPress", False),
        ("KnormPress", False),
        ("ObservedAttentionPress", False),  # its prefill runs eager attention, then kvbench's again
        ({"name": "AdaKVPress", "press": "SnapKVPress"}, True),
        ("KVzipPress", True),
    ],
)
def test_measured_bytes_are_what_the_cache_holds(smol_fp32, niah_prompt, press, held_in_full):
    lm, engine = smol_fp32
    _, ex = niah_prompt
    method = build_method("kvpress", {"press": press})
    prompt, suffix = ex.split(True)
    gen = engine.hooked_generate(method, Budget(0.25), prompt, suffix, 4)
    nominal = method.kv_ratio_nominal(gen.context_tokens, gen.decode_steps)
    tokens = gen.context_tokens + gen.decode_steps
    assert nominal == pytest.approx((int(len(prompt) * 0.25) + gen.decode_steps) / tokens)
    if held_in_full:  # kvpress masks: every key stays in the cache (attention_patch.py's fake keys)
        assert gen.kv_ratio == 1.0
    else:
        assert gen.kv_ratio == pytest.approx(nominal)
    kept = method.kept_masks  # what each head attends to, either way: the claimed share of the prompt
    assert all(m is not None for m in kept)
    assert sum(int(m.sum()) for m in kept) == pytest.approx(len(kept) * 3 * int(len(prompt) * 0.25), rel=0.01)
    assert all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in lm.model.model.layers)
    assert lm.model.config._attn_implementation == ATTN_IMPLEMENTATION


def test_run_rows_have_the_nominal_ratio_and_the_peak(tmp_path):
    """A whole run on the tiny model: kvpress rows beside the baseline, kv_ratio_nominal and peak_mem_delta_bytes."""
    from kvbench.run.runner import run

    cfg = compose_config(
        *tiny_overrides(tmp_path, "method=kvpress", "method.press=KnormPress", "budget=0.5", "limit=1")
    )
    rows = run(cfg, tmp_path / "out")
    press = rows[rows["method"] == "kvpress"].iloc[0]
    assert press["kv_ratio"] == pytest.approx(press["kv_ratio_nominal"])
    assert press["kv_ratio"] < 1 and press["peak_mem_delta_bytes"] > 0
    assert '"name": "KnormPress"' in press["method_params"]


def test_a_sweep_runs_kvbenchs_ragged_and_quantized_methods_after_a_press(tmp_path):
    """kvpress wraps every attention function (its import, and the adapter for kvbench's): the wrapper reads
    key.shape, which adakv's ragged and kivi's quantized layers lack, so only modules holding kvpress's masks go
    through it — a grid with a head-wise press first and adakv, kivi after it runs every configuration."""
    from kvbench.run.runner import run

    grid = (
        "grid.method=[{name: kvpress, press: {name: AdaKVPress, press: KnormPress}},adakv,{name: kivi, group_size: 16}]"
    )
    cfg = compose_config(*tiny_overrides(tmp_path, grid, "grid.budget=[0.5]", "limit=1"))
    rows = run(cfg, tmp_path / "out")
    assert {"kvpress", "adakv", "kivi"} <= set(rows["method"])
    assert rows.set_index("method").loc[["adakv", "kivi"], "kv_ratio"].lt(1).all()
