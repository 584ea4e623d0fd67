"""`python -m kvbench.plan` on bad input, by class: each case is one KvbenchError line naming the fix, raised before
any arithmetic (kvbench.plan.inputs), and exit 2 from the command line."""

from __future__ import annotations

import json
import sys

import pytest
from hydra import compose, initialize_config_dir

from kvbench import KvbenchError
from kvbench.plan.planner import run_plan
from tests.conftest import CONF_DIR

GOOD = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 100,
    "max_position_embeddings": 2048,
}
BIG = "1" + "0" * 400

# (class, overrides, config.json fields replacing GOOD's (None: no file), text the one-line message must contain)
CASES = [
    ("hardware", ["hardware.memory_gib=abc"], None, "hardware.memory_gib=80"),
    # the run's pre-load refusals, and the nested settings' rules
    ("refusal", ["model=tiny-random", "method=snapkv", "budget=16"], None, "fewer than snapkv keeps at least (33"),
    ("refusal", ["model=tiny-random", "method=headmerge", "method.kv_heads=3"], None, "does not divide Llama's 2"),
    ("count", ["model=tiny-random", "method=h2o", "method.evict_every=20000"], None, "beyond Llama's context"),
    ("count", ["model=tiny-random", "prefix=1099511627776"], None, "prefix=1099511627776 must be ≤"),
    ("nested", ["model=tiny-random", "method=adakv", "+method.scorer_params.window_size=-1"], None, "adakv.scorer_p"),
    ("nested", ["model=tiny-random", "model.init_seed=1.0"], None, "model.init_seed=1.0 is a float"),
    ("hardware", ["hardware.bandwidth_gb_s=-5"], None, "must be > 0"),
    ("hardware", ["hardware.peak_tflops=0"], None, "hardware.peak_tflops=989"),
    ("hardware", ["hardware.memory_gib=true"], None, "is not a number"),
    ("hardware", ["+hardware.mem=5"], None, "hardware.mem is not a planner setting"),
    ("hardware", ["hardware=h200", "hardware.memory_gib=null"], None, "lacks memory_gib"),
    ("model config", ["model=hub"], {"hidden_size": "64"}, 'hidden_size="64" is not a number'),
    ("model config", ["model=hub"], {"num_attention_heads": 2.5}, "num_attention_heads=2.5 is not an integer"),
    ("model config", ["model=hub"], {"num_key_value_heads": 3}, "does not divide num_attention_heads=4"),
    ("model config", ["model=hub"], {"layer_types": ["full_attention", 5]}, "layer_types[1]=5"),
    ("model config", ["model=hub"], {"layer_types": ["full_attention"]}, "num_hidden_layers=2 entries"),
    ("model config", ["model=hub"], {"layer_types": ["sliding_attention"] * 2}, "sliding_window is not set"),
    ("model config", ["model=hub"], {"sliding_window": "abc"}, 'sliding_window="abc"'),
    ("model config", ["model=hub"], {"kv_lora_rank": 16}, "qk_rope_head_dim is not"),
    ("model config", ["model=hub"], {"kv_lora_rank": -1}, "kv_lora_rank=-1 must be ≥ 1"),
    ("model config", ["model=tiny-random", "model.architecture.hidden_size=abc"], None, "model.architecture"),
    ("minimal model config", ["model=hub"], {"num_hidden_layers": None}, "has no num_hidden_layers"),
    ("minimal model config", ["model=hub"], {"num_attention_heads": None}, "has no num_attention_heads"),
    ("minimal model config", ["model=hub"], {"hidden_size": None}, "has no hidden_size"),
    ("minimal model config", ["model=hub"], {"vocab_size": None}, "has no vocab_size"),
    ("headroom", ["headroom=abc"], None, "headroom=0.1"),
    ("headroom", ["headroom=[0.1]"], None, "is not a number"),
    ("headroom", ["headroom=1"], None, "must be < 1"),
    ("headroom", ["headroom=-0.1"], None, "must be ≥ 0"),
    ("token count", ["context=4096.5"], None, "context=4096.5 is not an integer"),
    ("token count", ["context=true"], None, "context=true is not a number"),
    ("token count", ["context=[4096,true]"], None, "item 1 (true) is not a number"),
    ("token count", ["batch=1.5"], None, "batch=8"),
    ("token count", ["batch=0"], None, "must be ≥ 1"),
    ("token count", ["context=[]"], None, "is an empty list"),
    ("token count", [f"context={BIG}"], None, "too large"),
    ("token count", ["prefix=2.5"], None, "prefix=0"),
    ("token count", ["page_size=false"], None, "page_size=16"),
    ("context limit", ["context=100000"], None, "add extrapolate=true"),
    ("context limit", ["context=100000000"], None, "must be ≤ 16777216"),
    ("context limit", ["model=hub", "context=4096"], {}, "max_position_embeddings=2048"),
    ("planner key", ["+contxt=5"], None, "did you mean context?"),
    ("planner key", ["+verdict.recall_high=0.5"], None, "verdict is not a planner setting"),
    ("planner key", ["plot=maybe"], None, "plot=true"),
    ("planner key", ["extrapolate=1"], None, "extrapolate=true"),
    ("planner key", ["reuse_from=/no/such/rows"], None, "does not exist"),
    ("method", ["method=snapkv", "method.window_size=abc"], None, "method.window_size=32"),
    ("method", ["grid.method=[snapkv,nope]"], None, "valid methods"),
    ("method", ["grid.budget=[0.5,0]"], None, "grid.budget=[0.25,0.5]"),
    ("method", ["budget=inf"], None, "budget=0.25"),
    ("method", ["dtype=int8"], None, "dtype=auto"),
]


def plan_config(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("plan", overrides=["plot=false", *overrides])


def _overrides(tmp_path, overrides, fields):
    if fields is None:
        return list(overrides)
    written = {k: v for k, v in {**GOOD, **fields}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(written))
    return [*overrides, f"model.name_or_path={tmp_path / 'config.json'}"]


@pytest.mark.parametrize("kind,overrides,fields,fix", CASES, ids=[f"{c[0]}: {' '.join(c[1])} {c[2]}" for c in CASES])
def test_bad_plan_input_is_one_line_before_any_arithmetic(tmp_path, kind, overrides, fields, fix):
    with pytest.raises(KvbenchError) as error:
        run_plan(plan_config(*_overrides(tmp_path, overrides, fields)), tmp_path / "out")
    message = str(error.value)
    assert fix in message and "\n" not in message, message
    assert not (tmp_path / "out" / "plan.csv").exists()


@pytest.mark.parametrize(
    "overrides",
    [["model=hub", "context=[1024,2048]", "batch=[1,8]"], ["model=hub", "context=4096", "extrapolate=true"]],
)
def test_good_plan_input_passes(tmp_path, overrides):
    frame = run_plan(plan_config(*_overrides(tmp_path, overrides, {})), tmp_path / "out")
    assert len(frame) and (tmp_path / "out" / "plan.csv").exists()


@pytest.mark.parametrize("content", ["{bad", "[1, 2]", '{"cpu": {"memory_bytes": "x"}}'])
def test_a_damaged_cpu_calibration_cache_says_delete_it(tmp_path, monkeypatch, content):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    (tmp_path / "hardware-cpu.json").write_text(content)
    with pytest.raises(KvbenchError, match=f"delete it \\(rm {tmp_path / 'hardware-cpu.json'}\\)"):
        run_plan(plan_config("model=tiny-random", "hardware=cpu"), tmp_path / "out")


def test_bad_plan_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    from kvbench.plan.planner import _main

    argv = ["kvbench.plan", "model=tiny-random", "hardware.memory_gib=abc", f"hydra.run.dir={tmp_path}"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        _main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "kvbench.plan: error: hardware.memory_gib=abc is not a number; use hardware.memory_gib=80 (GiB of device "
        "memory, > 0)"
    ]
