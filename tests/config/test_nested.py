"""Settings below the top level go through the same rules as their top-level form, before the model loads: the
model group's keys, a wrapped scorer's knobs (adakv's, decoding's, chunkkv's `scorer_params`), a composition's
`overrides`; a count written as a float is refused wherever an integer is meant; device strings are checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbench import KvbenchError
from kvbench.config.rules import Rule, check_value
from kvbench.methods import build_method, method_defaults
from kvbench.preflight.entrance import check_run
from tests.conftest import compose_config

ROOT = Path(__file__).resolve().parents[2]

CASES = [
    # model.*: "no" is a string a loader would read as true; a misspelt key would be ignored
    (
        ["model=hub", "model.name_or_path=/nowhere", "model.allow_missing_weights=no"],
        "model.allow_missing_weights=no is not a boolean",
    ),
    (["model=hub", "model.name_or_path=/nowhere", "model.allow_missing_weights=1"], "model.allow_missing_weights=true"),
    (["model=tiny-random", "+model.allow_mising_weights=true"], "did you mean model.allow_missing_weights?"),
    (["model=tiny-random", "model.init_seed=1.5"], "model.init_seed=1.5 is not an integer"),
    (["model=tiny-random", "model.loader=magic"], "model.loader=magic is not one of"),
    # a float where the architecture's integer belongs: refused here, not by transformers' strict config mid-load
    (["model=tiny-random", "model.architecture.num_hidden_layers=2.0"], "num_hidden_layers=2.0 is a float"),
    # a wrapped scorer's knobs by the scorer's own rules
    (["method=adakv", "+method.scorer_params.window_size=-1"], "adakv.scorer_params.window_size=-1 must be ≥ 1"),
    (["method=adakv", "method.scorer=pyramidkv", "+method.scorer_params.beta=0"], "adakv.scorer_params.beta=0"),
    (["method=decoding", "method.scorer=snapkv", "+method.scorer_params.window_size=-1"], "decoding.scorer_params"),
    (["method=adakv", "method.scorer_params=3"], "method.scorer_params=3 is not a mapping"),
    (["method=chunkkv", "+method.scorer_params.kernel_size=0"], "chunkkv.scorer_params.kernel_size=0 must be ≥ 1"),
    (["method=compose", "method.overrides={kivi:{bits:-2}}"], "compose.overrides.kivi.bits=-2 must be ≥ 0"),
    (["grid.method=[{name: adakv, scorer_params: {window_size: -1}}]"], "adakv.scorer_params.window_size=-1"),
    (["method=pyramidkv", "method.beta=0"], "method.beta=0 must be ≥ 1"),  # min = (C − W) / β
    # knobs a method's layer or schedule would refuse mid-run (or divide by)
    (["method=hf-quant", "method.nbits=3"], "hf-quant nbits=3 with backend=quanto: use one of 2, 4"),
    (["method=hf-quant", "method.axis_key=2"], "hf-quant axis_key=2 with backend=quanto: use one of 0, -1"),
    (["method=hf-quant", "method.q_group_size=0"], "method.q_group_size=0 must be ≥ 1"),
    (["method=snapkv", "method.window_size=100000"], "snapkv window_size=100,000 is beyond Llama's context"),
    # integral floats: a count is an integer
    (["limit=3.0"], "limit=3.0 is a float, not an integer"),
    (["method=snapkv", "method.window_size=32.0"], "method.window_size=32.0 is a float"),
    (["batch_size=2.0"], "batch_size=2.0 is a float"),
    # device strings
    (["device=cuda0"], "device='cuda0' is not a device"),
    (["device=cpu:1"], "device='cpu:1' is not a device"),
    (["device=gpu"], "use device=auto, device=cpu, device=cuda or cuda:N"),
]


@pytest.mark.parametrize("overrides,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_nested_settings_are_checked_before_the_model_loads(overrides, message):
    with pytest.raises(KvbenchError, match=None) as error:
        check_run(compose_config("model=tiny-random", "device=cpu", *overrides))
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: cuda:0 is a device here")
def test_a_gpu_device_on_a_cpu_only_torch_is_one_line_exit_2(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "kvbench", "model=tiny-random", "device=cuda:0", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2  # before: a traceback from torch, exit 1
    assert done.stderr.strip().splitlines()[-1].startswith("kvbench: error: device=cuda:0 but no CUDA GPU is visible")


def test_a_wrapped_scorers_good_knobs_build():
    method = build_method("adakv", {**method_defaults("adakv"), "scorer_params": {"window_size": 8}})
    assert method._scorer.window_size == 8


@pytest.mark.parametrize("value", [3.0, 1e6, True, "3"])
def test_the_int_rule_takes_integers_only(value):
    with pytest.raises(KvbenchError):
        check_value("n", value, Rule("int", "n=3"))
    check_value("n", 3, Rule("int", "n=3"))
