"""Bad serving input is refused in one line before the model loads (kvbench.serving.inputs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvbench import KvbenchError
from kvbench.serving.engines import engine_need
from kvbench.serving.inputs import check, serving_spec
from tests.conftest import CONF_DIR, skip_without_serving_engines

TINY = [
    "model=tiny-random",
    "dtype=float32",
    "task.context_lengths=[400,600]",
    "task.depths=[0.2,0.8]",
    "task.max_new_tokens=6",
    "serving.kv_budget_bytes=[2000000]",
    "grid.method=[snapkv,streamingllm]",
    "serving.engines=null",
]


def serving_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("serving", overrides=[*TINY, *overrides])


def test_the_preset_passes():
    spec, confs = check(serving_config())
    assert [c.method.name for c in confs] == ["full", "snapkv", "streamingllm"]
    assert spec.kv_budgets == (2_000_000,) and spec.arrival == "poisson"


@pytest.mark.parametrize(
    "override,expected",
    [
        ("serving.rate=0", "serving.rate=0 must be a number > 0"),
        ("serving.rate=-2.5", "serving.rate=-2.5 must be a number > 0"),
        ("serving.requests=0", "serving.requests=0 must be an integer in [1, 100000]"),
        ("serving.arrival=uniform", "serving.arrival='uniform': use serving.arrival=burst"),
        ("serving.slo_tpot_s=6.0", "the SLOs are in the wrong order"),
        ("serving.slo_ttft_s=0", "serving.slo_ttft_s=0 must be a number of seconds > 0"),
        ("serving.kv_budget_bytes=500000", "serving.kv_budget_bytes=500,000 holds not one request"),
        ("serving.kv_budget_bytes=[2000000,100]", "serving.kv_budget_bytes=100 holds not one request"),
        ("serving.kv_budget_bytes=null", "must be an integer ≥ 1 or a list of them"),
        ("serving.kv_budget_bytes=[]", "must be an integer ≥ 1 or a list of them"),
        ("task.context_lengths=[17000]", "more than the model's context of 16,384"),
        ("serving.prompt_tokens=[50,20]", "need 1 ≤ min ≤ max"),
        ("serving.output_tokens=0", "serving.output_tokens=0 must be ≥ 1"),
        ("serving.shared_prefix=1.0", "serving.shared_prefix=1.0 must be in [0, 1)"),
        ("+serving.rates=2", "serving.rates is not a serving setting"),
        ("serving.engines=[tgi:full]", "serving.engines: tgi is no serving engine; use vllm or openvino"),
        ("serving.engines=[vllm:q8_0]", "vllm:q8_0 is not an option vllm serves a trace with; use one of vllm:full"),
        ("serving.engines=[vllm]", "must be a list of <engine>:<option>"),
        ("engine=vllm", "engine=vllm with a serving trace: engines serve it through serving.engines"),
        ("prefix_cache=true", "the scheduler has no prefix cache; compare prefix caching with"),
    ],
)
def test_bad_input_is_one_line(override, expected):
    with pytest.raises(KvbenchError) as error:
        check(serving_config(override))
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


def test_random_prompts_above_the_context_are_refused():
    with pytest.raises(KvbenchError, match="20,000 prompt \\+ 16 output tokens is more than the model's context"):
        check(serving_config("serving.prompts=random", "serving.prompt_tokens=[100,20000]"))


def test_budget_need_counts_the_longest_request_under_the_full_cache():
    # 600-token prompt + 6 new: the full cache holds 606 tokens at its last step, + the step's new token
    token = 1024  # tiny-random fp32: 4 layers × 2 × 2 heads × 16 × 4 bytes
    need = 607 * token
    check(serving_config(f"serving.kv_budget_bytes={need}"))
    with pytest.raises(KvbenchError, match=f"use serving.kv_budget_bytes ≥ {need:,}"):
        check(serving_config(f"serving.kv_budget_bytes={need - 1}"))


def test_spec_defaults():
    spec = serving_spec({"kv_budget_bytes": 10**6})
    assert spec.requests == 8 and spec.arrival == "burst" and spec.output_tokens is None


def test_entry_exits_2_with_one_line_before_the_model_loads(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvbench.serving", *TINY, "serving.rate=0", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "kvbench.serving: error: serving.rate=0 must be a number > 0 (requests per second); use serving.rate=2"
    ]


def test_engine_blocks_need_whole_blocks_of_the_longest_request():
    # vLLM's CPU blocks are 16 tokens: 606 tokens take 38 blocks = 608 tokens of 1,024 bytes, more than kvbench's
    # own need (607 tokens); OpenVINO's 32-token blocks take 19 × 32 = 608 tokens too
    need = 608 * 1024
    skip_without_serving_engines(".venv-vllm", ".venv-openvino")
    check(serving_config(f"serving.kv_budget_bytes={need}", "serving.engines=[vllm:full,openvino:full]"))
    with pytest.raises(KvbenchError, match=f"holds not one request in vllm:full's blocks .* ≥ {need:,}"):
        check(serving_config(f"serving.kv_budget_bytes={need - 1}", "serving.engines=[vllm:full]"))
    # fp8 blocks hold a byte per element (a quarter of float32's four); OpenVINO's blocks are 32 tokens
    assert engine_need("vllm", "fp8", 1024, 256, 606) == 608 * 256
    assert engine_need("openvino", "full", 1024, 256, 609) == 640 * 1024


def test_main_entry_routes_the_serving_experiment_and_refuses_bad_input_in_one_line(tmp_path: Path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbench",
            "+experiment=serving",
            *TINY,
            "serving.slo_tpot_s=9",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvbench: error: serving.slo_tpot_s=9 > serving.slo_ttft_s=5.0: the SLOs are in the wrong order (the first "
        "token includes a prefill, so its bound is the larger); swap them"
    ]
