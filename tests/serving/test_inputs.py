"""Bad serving input is refused in one line before the model loads (kvbench.serving.inputs)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
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
        ("serving.kv_budget_bytes=null", "must be bytes (an integer ≥ 1), a multiple ≥ 1x"),
        ("serving.kv_budget_bytes=[]", "must be bytes (an integer ≥ 1), a multiple ≥ 1x"),
        ("serving.kv_budget_bytes=0.5x", "serving.kv_budget_bytes='0.5x' must be bytes"),
        ("serving.kv_budget_bytes=[2x,2y]", "serving.kv_budget_bytes=['2x', '2y'] must be bytes"),
        ("serving.kv_budget_bytes=[2x,0]", "use serving.kv_budget_bytes=[1.6x,10x] or [20000000,80000000]"),
        ("serving.kv_budget_bytes=1.5", "serving.kv_budget_bytes=1.5 must be bytes"),
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


def test_a_multiple_is_of_the_longest_requests_full_cache_need():
    need = 607 * 1024  # as above: 1x holds the longest request alone, in the model's dtype
    spec, _ = check(serving_config("serving.kv_budget_bytes=[1x,2.5x,3000000]"))
    assert spec.kv_budget_forms == (1.0, 2.5, 3_000_000) and spec.request_bytes == need
    assert spec.kv_budgets == (need, math.ceil(2.5 * need), 3_000_000)
    spec, _ = check(serving_config("serving.kv_budget_bytes=2x", "dtype=bfloat16"))
    assert spec.kv_budgets == (607 * 512 * 2,)  # bf16: half the bytes, the same number of requests


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_shipped_preset_holds_its_requests_in_any_dtype(monkeypatch, dtype):
    """conf/experiment/serving.yaml as shipped, on SmolLM2-135M's shape in bf16 (AVX512-BF16) and fp32 (AVX2 only):
    the first budget holds one 1K request but not two, the second every request at once; no fp8 (AVX-512 in vLLM)."""
    from transformers import LlamaConfig

    import kvbench.model.load

    smollm2 = LlamaConfig(
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        max_position_embeddings=8192,
    )
    monkeypatch.setattr(kvbench.model.load, "model_config", lambda cfg, cheap=False: smollm2)
    monkeypatch.setattr(kvbench.model.load, "resolve_dtype", lambda name, device=None: dtype)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("serving", overrides=["serving.engines=null"])
    spec, _ = check(cfg)
    one = 2 * 30 * 3 * 64 * dtype.itemsize * (1024 + 16 + 1)  # the 1K prompt, 16 tokens out, the step's new one
    assert spec.request_bytes == one and one < spec.kv_budgets[0] < 2 * one
    assert spec.kv_budgets[1] >= spec.requests * one
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        engines = compose("serving").serving.engines
    assert engines and not any("fp8" in e for e in engines)


def test_spec_defaults():
    spec = serving_spec({"kv_budget_bytes": 10**6})
    assert spec.requests == 8 and spec.arrival == "burst" and spec.output_tokens is None


def entry(tmp_path: Path, module: str, *overrides: str) -> subprocess.CompletedProcess:
    """`python -m MODULE` on the tiny serving config with `overrides`, in the repository, its output captured."""
    command = [sys.executable, "-m", module, *TINY, *overrides, f"hydra.run.dir={tmp_path}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])


def test_entry_exits_2_with_one_line_before_the_model_loads(tmp_path: Path):
    proc = entry(tmp_path, "kvbench.serving", "serving.rate=0")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "kvbench.serving: error: serving.rate=0 must be a number > 0 (requests per second); use serving.rate=2"
    ]


def test_a_bad_multiple_exits_2_with_one_line(tmp_path: Path):
    proc = entry(tmp_path, "kvbench.serving", "serving.kv_budget_bytes=[2x,0.5x]")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvbench.serving: error: serving.kv_budget_bytes=['2x', '0.5x'] must be bytes (an integer ≥ 1), a multiple "
        "≥ 1x of one request's full cache (2x) or a list of them; use serving.kv_budget_bytes=[1.6x,10x] or "
        "[20000000,80000000]"
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
    proc = entry(tmp_path, "kvbench", "+experiment=serving", "serving.slo_tpot_s=9")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvbench: error: serving.slo_tpot_s=9 > serving.slo_ttft_s=5.0: the SLOs are in the wrong order (the first "
        "token includes a prefill, so its bound is the larger); swap them"
    ]
